"""Run the advice: for every setting, the experiment's cache comparison (``run_experiment``, each
pass in its own process) and a paired speed probe against the baseline.

All settings share one run-id prefix, so one divergence query covers them all; the settings label
in each run id keeps them apart. A setting whose engine crashes or hangs (the weight repack on an
AMX CPU) is a result — "crashed" — and the next setting runs; Ctrl-C stops and reports what ran.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

from kvtrace.advise.candidates import Candidate
from kvtrace.advise.speed import Cost, PassDied, SpeedSpec, cost, measure
from kvtrace.experiment.plan import Plan
from kvtrace.experiment.runner import Outcome, run_experiment
from kvtrace.progress import Progress


@dataclass(frozen=True)
class AdvicePlan:
    """What ``advise`` runs: the experiment plan of the baseline (one format, the workload, the arms)
    and the candidates, each run as that plan with its own engine settings."""

    experiment: Plan
    candidates: tuple[Candidate, ...]
    """The baseline first (``candidates.BASELINE``)."""
    prompt_tokens: int = 256
    decode_tokens: int = 32
    speed_rounds: int = 5

    def plan_for(self, candidate: Candidate) -> Plan:
        s = candidate.settings
        return replace(self.experiment, n_batch=(s.n_batch,), n_ubatch=(s.n_ubatch,), flash_attn=(s.flash_attn,),
                       kv_type=(s.kv_type,), weight_repack=(s.weight_repack,))

    def speed_spec(self, model: Path, candidate: Candidate) -> SpeedSpec:
        prompt = min(self.prompt_tokens, self.experiment.n_ctx - self.decode_tokens)
        return SpeedSpec(model, self.candidates[0].settings, candidate.settings, self.experiment.n_ctx,
                         self.experiment.n_threads, prompt, self.decode_tokens, self.speed_rounds)


@dataclass
class SettingRun:
    """What running one setting gave: its experiment outcome and its cost (None for the baseline,
    which every cost is relative to, or when the probe crashed: ``speed_failure``)."""

    candidate: Candidate
    outcome: Outcome
    cost: Optional[Cost] = None
    speed_failure: Optional[str] = None

    @property
    def crashed(self) -> Optional[str]:
        """Why the engine died under this setting (in a cache pass or in the speed probe), or None."""
        if self.outcome.failure is not None:
            return self.outcome.failure.cause
        return self.speed_failure


@dataclass
class Advice:
    plan: AdvicePlan
    runs: list[SettingRun]
    interrupted: bool = False


class _OneBar(Progress):
    """One count over every setting: each ``run_experiment`` starts and closes its own, which here
    only moves the shared one."""

    def __init__(self, progress: Progress):
        self.progress = progress
        self.done = 0

    def __call__(self, message: str) -> None:
        self.progress(message)

    def advance(self, n: int = 1) -> None:
        self.done += n
        self.progress.advance(n)

    def catch_up(self, target: int) -> None:
        """A setting that ended early (a crash) still counts as done."""
        if target > self.done:
            self.advance(target - self.done)


def run_advice(plan: AdvicePlan, model: Path, progress: Progress, pass_timeout: float) -> Advice:
    experiment = plan.experiment
    per_setting = len(list(experiment.passes())) * experiment.episodes * experiment.turns
    progress.start(per_setting * len(plan.candidates), "turns")
    bar = _OneBar(progress)
    advice = Advice(plan, [])
    try:
        for i, candidate in enumerate(plan.candidates, 1):
            bar(f"setting {i}/{len(plan.candidates)}: {candidate.name} ({candidate.settings.label})")
            outcome = run_experiment(plan.plan_for(candidate), {experiment.formats[0]: model}, bar, pass_timeout)
            bar.catch_up(per_setting * i)
            run = SettingRun(candidate, outcome)
            advice.runs.append(run)
            if outcome.interrupted:
                advice.interrupted = True
                break
            if i > 1 and outcome.failure is None:  # the baseline's cost is 1 by definition
                _probe(plan, model, run, bar, pass_timeout)
                if run.speed_failure is None and run.cost is None:
                    advice.interrupted = True
                    break
    finally:
        progress.close()
    return advice


def _probe(plan: AdvicePlan, model: Path, run: SettingRun, bar: _OneBar, pass_timeout: float) -> None:
    spec = plan.speed_spec(model, run.candidate)
    try:
        result = measure(spec, pass_timeout, lambda text, n: bar(text))
    except PassDied as died:
        run.speed_failure = died.cause
        return
    if not result.interrupted:
        run.cost = cost(result, spec)
