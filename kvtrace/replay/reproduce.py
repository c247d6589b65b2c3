"""Re-execute recorded requests and judge the result: the reproduction control and the counterfactual.

``replay_episodes``: every request of the episodes on its own recorded path; each must generate
exactly its recorded tokens (the study's "40/40" control). Requests of other episodes whose end
state an episode's requests started from are re-executed too (first) and checked the same way.

``counterfactual``: at a fork of runs A and B (same prompt, different output), each side's request
runs on its own recorded path (the fork must reproduce) and on the other side's path, everything
else held fixed (at a ``batch_composition`` fork both took one path, and the batch is switched).
``confirmed``: the switched paths move the fork token to the other side's token; ``not_cache``: the
fork stays with its request; ``not_reproduced``: the recorded paths do not give the recorded fork,
so something the spans do not record differs.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Optional

from kvtrace import semconv as sc
from kvtrace.analysis.forks import Fork
from kvtrace.progress import Progress
from kvtrace.replay import batch
from kvtrace.replay.backends import Backend
from kvtrace.replay.recorded import (VLLM, EngineConfiguration, RecordedRequest, RecordedRun, ReplayRefused, Step,
                                     as_factual_steps, one_configuration, step)

A_ON_B_PATH, B_ON_A_PATH = "a-on-b-path", "b-on-a-path"
"""Step keys of the two switched re-executions (the others are keyed by their request's span id)."""


@dataclass
class RequestReplay:
    """One re-executed request against its record."""

    episode_id: str
    turn: int
    span_id: str
    path: str
    tokens: int
    tokens_reproduced: int
    """Leading generated tokens equal to the recorded ones."""
    path_reproduced: bool
    """The engine reused as many prompt tokens as recorded."""

    @property
    def reproduced(self) -> bool:
        return self.path_reproduced and self.tokens_reproduced == self.tokens


@dataclass
class Reproduction:
    """The control: how many requests and tokens re-executed exactly as recorded."""

    run_id: str
    episodes: list[str]
    requests: list[RequestReplay] = field(default_factory=list)
    """The episodes' own requests."""
    dependencies: list[RequestReplay] = field(default_factory=list)
    """Requests of other episodes whose end state the episodes' requests started from."""
    seconds: float = 0.0
    """The re-execution's wall time, the engine's start (or the server's checks) included."""
    recorded_seconds: float = 0.0
    """What the same requests took when they were recorded: their spans' durations added up."""

    @property
    def requests_reproduced(self) -> int:
        return sum(r.reproduced for r in self.requests)

    @property
    def tokens(self) -> int:
        return sum(r.tokens for r in self.requests)

    @property
    def tokens_reproduced(self) -> int:
        return sum(r.tokens_reproduced for r in self.requests)

    @property
    def exact(self) -> bool:
        return all(r.reproduced for r in self.requests + self.dependencies)

    def to_json(self) -> dict[str, Any]:
        return {"run": self.run_id, "episodes": self.episodes, "exact": self.exact,
                "requests": len(self.requests), "requests_reproduced": self.requests_reproduced,
                "tokens": self.tokens, "tokens_reproduced": self.tokens_reproduced,
                "dependencies": len(self.dependencies),
                "dependencies_reproduced": sum(r.reproduced for r in self.dependencies),
                "seconds": round(self.seconds, 3), "recorded_seconds": round(self.recorded_seconds, 3),
                "per_request": [asdict(r) | {"reproduced": r.reproduced} for r in self.requests + self.dependencies]}


@dataclass
class Counterfactual:
    """The verdict on one fork, with what each re-execution chose at the fork position."""

    run_a: str
    run_b: str
    episode: str
    turn: int
    position: int
    attribution: str
    span_a: str
    span_b: str
    verdict: str
    explanation: str
    recorded: tuple[int, int]
    """The recorded tokens at the fork: A's, B's."""
    own_path: tuple[int, int]
    """What A's and B's requests chose on their own recorded paths."""
    switched_path: tuple[int, int]
    """What A's request chose on B's path, and B's on A's."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _judge(request: RecordedRequest, outcome: dict[str, Any], expected_reuse: Optional[int] = None) -> RequestReplay:
    produced, recorded = outcome["token_ids"], request.output
    same = 0
    while same < min(len(produced), len(recorded)) and produced[same] == recorded[same]:
        same += 1
    reuse = request.reused_tokens if expected_reuse is None else expected_reuse
    return RequestReplay(request.episode_id, request.turn, request.span_id, request.path(), len(recorded), same,
                         path_reproduced=outcome["reused"] == reuse)


def replay_episodes(run: RecordedRun, episodes: list[str], backend: Backend,
                    progress: Progress = Progress()) -> Reproduction:
    """Re-execute ``episodes`` of ``run`` (and what they depend on) and compare every generated token."""
    targets = [r for e in episodes for r in run.episode(e)]
    needed = run.needed_for(targets)
    started = time.monotonic()
    outcomes = backend.execute(one_configuration(needed), as_factual_steps(needed), progress)
    result = Reproduction(run.run_id, episodes, seconds=time.monotonic() - started,
                          recorded_seconds=sum(r.duration_ns for r in needed) / 1e9)
    wanted = set(episodes)
    for request in needed:
        judged = _judge(request, outcomes[request.span_id])
        (result.requests if request.episode_id in wanted else result.dependencies).append(judged)
    return result


def refuse_unless_replayable(fork: Fork) -> None:
    """``ReplayRefused`` for a fork the counterfactual cannot judge, before any engine is loaded."""
    if fork.kind != sc.FORK_KIND_OUTPUT or fork.position < 0:
        raise ReplayRefused(f"episode {fork.episode} forked at {fork.where()} because the prompts already differ "
                            f"there (an earlier turn's output differs upstream); the counterfactual switches the "
                            f"cache path of a request whose prompt both runs share")
    if fork.attribution == sc.ATTRIBUTION_OUTPUT_CANCELLED:
        raise ReplayRefused(f"episode {fork.episode} forked at {fork.where()} because one side's request was "
                            "cancelled there (its client went away) while the other's went on: no token was decided "
                            "to switch a cache path under")


def counterfactual(run_a: RecordedRun, run_b: RecordedRun, fork: Fork, backend: Backend,
                   progress: Progress = Progress()) -> Counterfactual:
    """Switch only the cache path of the forked request between the two sides (at a ``batch_composition``
    fork: only its batch), and judge the fork."""
    refuse_unless_replayable(fork)
    a, b = run_a.by_span[fork.a.span_id], run_b.by_span[fork.b.span_id]
    needed_a, needed_b = run_a.needed_for([a]), run_b.needed_for([b])
    configuration = one_configuration(needed_a + needed_b)
    sources = {r.starts_from for r in needed_a + needed_b if r.starts_from} | {a.starts_from, b.starts_from}
    sources.discard(None)
    steps = [step(r, r.span_id, r.starts_from, sources) for r in needed_a + needed_b]
    if fork.attribution == sc.ATTRIBUTION_BATCH_COMPOSITION:
        return _batch_counterfactual(fork, a, b, configuration, steps, backend, progress)
    steps += [step(a, A_ON_B_PATH, b.starts_from, set()), step(b, B_ON_A_PATH, a.starts_from, set())]
    outcomes = backend.execute(configuration, steps, progress)
    return judge_fork(fork, a, b, outcomes)


def _batch_counterfactual(fork: Fork, a: RecordedRequest, b: RecordedRequest, configuration: EngineConfiguration,
                          steps: list[Step], backend: Backend, progress: Progress) -> Counterfactual:
    """Both sides took the same cache path: each side's request runs on it at its own recorded batch and at the
    other side's (companions of the recorded sizes sent alongside, ``batch``)."""
    if configuration.engine != VLLM:
        raise ReplayRefused(f"episode {fork.episode} forked by batch composition on {configuration.engine}; replay "
                            f"recreates a recorded batch on vLLM only")
    with_a, with_b = batch.companions(a), batch.companions(b)
    steps = [replace(s, companions=with_a) if s.key == a.span_id else
             replace(s, companions=with_b) if s.key == b.span_id else s for s in steps]
    steps += [replace(step(a, A_ON_B_PATH, a.starts_from, set()), companions=with_b),
              replace(step(b, B_ON_A_PATH, b.starts_from, set()), companions=with_a)]
    outcomes = backend.execute(configuration, steps, progress)
    judged = judge_fork(fork, a, b, outcomes, varied="batch", sides=(batch.described(a), batch.described(b)))
    judged.explanation += "; " + "; ".join(
        _reproduces(side, judged.recorded, first, second)
        for side, first, second in (("A", judged.own_path[0], judged.switched_path[1]),
                                    ("B", judged.own_path[1], judged.switched_path[0])))
    return judged


def _reproduces(side: str, recorded: tuple[int, int], first: int, second: int) -> str:
    """Which side's token the two requests chose at ``side``'s batch (both prompts are the same)."""
    whose = {recorded[0]: "A", recorded[1]: "B"}
    if first == second:
        return f"at {side}'s batch both requests reproduce {whose.get(first, 'neither side')}'s token ({first})"
    return f"at {side}'s batch A's request chose {first}, B's {second}"


def judge_fork(fork: Fork, a: RecordedRequest, b: RecordedRequest, outcomes: dict[str, dict[str, Any]],
               varied: str = "cache path", sides: Optional[tuple[str, str]] = None) -> Counterfactual:
    """The verdict from four re-executions in ``outcomes``: each side's request on its own path (keyed by its
    span id) and on the other side's (``A_ON_B_PATH``, ``B_ON_A_PATH``); ``varied`` names what differs between
    a side's path and the other's, ``sides`` says what each side's was (default: the cache paths)."""
    p = fork.position
    common = list(a.output[:p])

    def at_fork(key: str) -> int:
        ids = outcomes[key]["token_ids"]
        return ids[p] if len(ids) > p and ids[:p] == common else -1

    recorded = (a.output[p], b.output[p])
    own = (at_fork(a.span_id), at_fork(b.span_id))
    switched = (at_fork(A_ON_B_PATH), at_fork(B_ON_A_PATH))
    own_a, own_b = sides or (a.path(), b.path())
    paths = f"A: {own_a}, B: {own_b}"
    other = "path" if varied == "cache path" else varied
    if own != recorded:
        unrecorded = sorted(set(a.unrecorded_inputs()) | set(b.unrecorded_inputs()))
        hint = (f"; the record says a {' and a '.join(unrecorded)} was used, which replay cannot re-apply"
                if unrecorded else "")
        verdict = sc.VERDICT_NOT_REPRODUCED
        explanation = (f"on their own recorded paths ({paths}) the requests chose {own[0]} and {own[1]}, not the "
                       f"recorded {recorded[0]} and {recorded[1]}: something the spans do not record differs "
                       f"between the runs{hint}")
    elif switched == (recorded[1], recorded[0]):
        verdict = sc.VERDICT_CONFIRMED
        explanation = (f"switching only the {varied} ({paths}) moves the token at the fork to the other side's: "
                       f"A's request on B's {other} chose {switched[0]}, B's on A's {other} chose {switched[1]}")
    else:
        verdict = sc.VERDICT_NOT_CACHE
        explanation = (f"the fork reproduces on the recorded paths ({paths}) but does not follow the {varied} "
                       f"when it is switched: A's request on B's {other} chose {switched[0]}, B's on A's {other} chose "
                       f"{switched[1]} (recorded {recorded[0]} and {recorded[1]})")
    return Counterfactual(fork.run_a, fork.run_b, fork.episode, fork.turn, p, fork.attribution, a.span_id, b.span_id,
                          verdict, explanation, recorded, own, switched)
