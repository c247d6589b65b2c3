"""What a setting costs: prefill and decode speed of a candidate against the baseline, measured in
pairs in one process so that a shared, busy machine slows both alike.

One probe process (``speed_process``, started like an experiment pass by ``isolation.run_child``,
so a native crash — the repack on an AMX CPU — ends only the probe) loads the model twice, with the
baseline's settings and the candidate's. Each round times both on the same prompt, in alternating
order (baseline first in even rounds, candidate first in odd ones): a prefill of the prompt from an
empty context, then single-token decode steps. Wall time and process CPU time are both kept: on a
machine others share, wall time grows with their load, CPU time much less. The first round warms
caches and is dropped; ratios are taken per round (paired), then the median over rounds.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

from kvtrace.experiment.isolation import ChildResult, PassDied, run_child
from kvtrace.experiment.plan import EngineSettings

CHILD_MODULE = "kvtrace.advise.speed_process"
PHASES = ("prefill", "decode")
CLOCKS = ("wall", "cpu")


@dataclass(frozen=True)
class SpeedSpec:
    """One probe: the model, the two settings and the shape of what is timed."""

    model: Path
    baseline: EngineSettings
    candidate: EngineSettings
    n_ctx: int
    n_threads: int
    prompt_tokens: int
    decode_tokens: int
    rounds: int
    """Timed rounds, after one warm-up round."""

    def to_json(self) -> str:
        return json.dumps(dict(asdict(self), model=str(self.model)))

    @classmethod
    def from_json(cls, text: str) -> "SpeedSpec":
        data = json.loads(text)
        return cls(**dict(data, model=Path(data["model"]), baseline=EngineSettings(**data["baseline"]),
                          candidate=EngineSettings(**data["candidate"])))


@dataclass
class SpeedResult(ChildResult):
    """The probe's rounds (``requests``: timings taken so far, each a prefill and its decode steps)."""

    rounds: list[dict] = field(default_factory=list)
    """Per timed round: ``{"baseline": timing, "candidate": timing}``, a timing being seconds per
    phase and clock (``prefill_wall``, ``prefill_cpu``, ``decode_wall``, ``decode_cpu``)."""


@dataclass(frozen=True)
class Cost:
    """A candidate's speed relative to the baseline (above 1: faster), per phase and clock, and the
    time of one probe request (the prompt's prefill plus the decode steps) relative to the baseline's."""

    speed_ratio: dict[str, float]
    """``prefill_wall``, ``prefill_cpu``, ``decode_wall``, ``decode_cpu``: median over rounds."""
    request_time_ratio: dict[str, float]
    """``wall``, ``cpu``: candidate's prefill + decode time over the baseline's (median over rounds)."""
    baseline_tokens_per_s: dict[str, float]
    """The baseline's own speed in these rounds, per phase and clock (median)."""
    rounds: int


def measure(spec: SpeedSpec, timeout: float, progress: Callable[[str, int], None] = lambda text, n: None) -> SpeedResult:
    """Run the probe in its own process; ``PassDied`` when it crashes or hangs."""
    return SpeedResult(**run_child(CHILD_MODULE, spec.to_json(), timeout, progress))


def cost(result: SpeedResult, spec: SpeedSpec) -> Optional[Cost]:
    """The paired ratios of a finished probe; None without a timed round."""
    if not result.rounds:
        return None
    tokens = {"prefill": spec.prompt_tokens, "decode": spec.decode_tokens}
    keys = [f"{phase}_{clock}" for phase in PHASES for clock in CLOCKS]

    def median(values: list[float]) -> float:
        return round(statistics.median(values), 3)

    speed = {k: median([r["baseline"][k] / r["candidate"][k] for r in result.rounds]) for k in keys}
    request = {clock: median([sum(r["candidate"][f"{p}_{clock}"] for p in PHASES)
                              / sum(r["baseline"][f"{p}_{clock}"] for p in PHASES) for r in result.rounds])
               for clock in CLOCKS}
    baseline = {k: median([tokens[k.split("_")[0]] / r["baseline"][k] for r in result.rounds]) for k in keys}
    return Cost(speed, request, baseline, len(result.rounds))


__all__ = ["Cost", "PassDied", "SpeedResult", "SpeedSpec", "cost", "measure"]
