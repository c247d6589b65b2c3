"""A reproducible cache-divergence experiment: a seeded multi-turn agentic workload run under
several cache arms and weight formats through the real instrumentation, then reported with the
saved queries (divergence rates, margin shift, flip rate by margin, fork attribution)."""

from kvtrace.experiment.plan import ARMS, ORDERS, Plan
from kvtrace.experiment.runner import run_experiment

__all__ = ["ARMS", "ORDERS", "Plan", "run_experiment"]
