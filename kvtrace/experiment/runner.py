"""Run the plan: one fresh ``Llama`` per pass, serial requests, batch size one, greedy decoding.

Each pass runs in a process of its own (``isolation``), so a native crash or hang of the engine
ends that pass with a clear error while the passes before it stay recorded. Every request goes
through the instrumented engine and is tagged with run / episode / turn / arm through
``kvtrace.correlate``, so the spool holds everything the report needs. A Ctrl-C stops between
requests; what was recorded stays usable (the spool is durable) and is reported.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from kvtrace import correlate
from kvtrace.experiment.isolation import DEFAULT_PASS_TIMEOUT, PassDied, PassResult, PassSpec, run_isolated
from kvtrace.experiment.plan import Plan
from kvtrace.experiment.workload import episode_order, make_episodes
from kvtrace.patches.llama_cpp.repack import amx_hint

RAM_CACHE_BYTES = 1 << 30


def engine_crash_hint() -> str:
    """What to suspect when an engine pass dies or hangs: the AMX repack where this CPU has it."""
    return amx_hint() or "run the pass alone with -v to see llama.cpp's own log"


@dataclass(frozen=True)
class PassFailure:
    """A pass whose engine process died or hung; the passes before it finished and are recorded."""

    format: str
    arm: str
    repeat: int
    order: str
    run_id: str
    cause: str
    requests: int
    passes_kept: int

    def describe(self) -> str:
        """One line: which pass, what happened, what is kept, what to try next."""
        kept = (f"the {self.passes_kept} pass(es) before it are kept (kvtrace runs)" if self.passes_kept
                else "no pass had finished before it")
        return (f"the engine {self.cause} in pass {self.run_id} (format {self.format}, arm {self.arm}, repeat "
                f"{self.repeat}, order {self.order}) after {self.requests} finished request(s); {kept}; to "
                f"reproduce, run that pass alone (kvtrace experiment ... --formats {self.format} --arms "
                f"{self.arm}); {engine_crash_hint()}")


@dataclass
class Outcome:
    """What the harness itself saw (the database holds the rest)."""

    runs: list[dict] = field(default_factory=list)
    requests: int = 0
    restore_checks: int = 0
    restore_mismatches: list[str] = field(default_factory=list)
    interrupted: bool = False
    failure: Optional[PassFailure] = None
    seconds: float = 0.0

    def add(self, result: PassResult) -> None:
        self.requests += result.requests
        self.restore_checks += result.restore_checks
        self.restore_mismatches += result.restore_mismatches
        self.interrupted = self.interrupted or result.interrupted


def open_llama(model: Path, plan: Plan):
    from kvtrace.patches.llama_cpp.repack import load_llama

    # Threads pinned explicitly: the machine is shared, and steadier timing keeps runs comparable.
    # load_llama: the weight repack off on every CPU (same kernels everywhere; no AMX crash).
    return load_llama(model, n_ctx=plan.n_ctx, n_batch=256, n_ubatch=256, n_threads=plan.n_threads,
                      n_threads_batch=plan.n_threads, seed=plan.seed, verbose=False)


def run_experiment(plan: Plan, models: dict[str, Path], progress: Callable[[str], None] = lambda m: None,
                   pass_timeout: float = DEFAULT_PASS_TIMEOUT) -> Outcome:
    """Run every pass of ``plan``, each in its own process; stop at the first that dies or hangs
    (``Outcome.failure``) or at Ctrl-C (``Outcome.interrupted``)."""
    outcome = Outcome()
    started = time.monotonic()
    total = sum(1 for _ in plan.passes())
    try:
        for i, (fmt, arm, repeat, order) in enumerate(plan.passes(), 1):
            run_id = plan.run_id(fmt, arm, repeat, order)
            progress(f"[{i}/{total}] {run_id}")
            try:
                result = run_isolated(PassSpec(plan, models[fmt], run_id, arm, order), pass_timeout, progress)
            except PassDied as died:
                outcome.failure = PassFailure(fmt, arm, repeat, order, run_id, died.cause, died.requests,
                                              passes_kept=len(outcome.runs))
                break
            outcome.runs.append({"run_id": run_id, "format": fmt, "arm": arm, "repeat": repeat, "order": order})
            outcome.add(result)
            if outcome.interrupted:
                break
    except KeyboardInterrupt:
        outcome.interrupted = True
    finally:
        outcome.seconds = time.monotonic() - started
    return outcome


def run_pass(plan: Plan, model: Path, run_id: str, arm: str, order: str, result: PassResult,
             progress: Callable[[str], None]) -> None:
    """One pass in this process (the child of ``run_isolated``); a message before every request
    tells the parent it is alive."""
    import llama_cpp

    llm = open_llama(model, plan)  # fresh history per pass: nothing cached from another run
    try:
        if arm == "prompt-cache":
            llm.set_cache(llama_cpp.LlamaRAMCache(capacity_bytes=RAM_CACHE_BYTES))
        episodes = make_episodes(plan.episodes, plan.seed)
        for n, index in enumerate(episode_order(plan.episodes, order, plan.seed), 1):
            episode = episodes[index]
            prompt = llm.tokenize(episode.opening().encode())
            for turn in range(plan.turns):
                if len(prompt) + plan.tokens > plan.n_ctx:
                    break  # context full: the episode ends here (the same way in every run that got here)
                if arm in ("off", "prompt-cache"):
                    llm.reset()  # nothing reused in context: full recompute, or a prompt-cache restore
                progress(f"{run_id} episode {n}/{plan.episodes} turn {turn + 1}/{plan.turns}")
                snapshot = llm.save_state() if arm == "restore" else None
                text = complete(llm, prompt, plan.tokens, run_id, arm, episode.episode_id, turn)
                result.requests += 1
                after = llm.input_ids[: llm.n_tokens].tolist()
                if snapshot is not None:
                    check_restore(llm, snapshot, prompt, plan.tokens, run_id, episode.episode_id, turn, text, result)
                observation = llm.tokenize(episode.observe(text, turn).encode(), add_bos=False)
                prompt = after + observation
    finally:
        llm.close()


def complete(llm, prompt: list[int], tokens: int, run_id: str, arm: str, episode_id: str, turn: int) -> str:
    with correlate(run_id=run_id, episode_id=episode_id, turn=turn, arm=arm):
        out = llm.create_completion(prompt, max_tokens=tokens, temperature=0.0)
    return out["choices"][0]["text"]


def check_restore(llm, snapshot, prompt, tokens, run_id, episode_id, turn, text, result: PassResult) -> None:
    """The control: restore the state saved before the request and rerun it; it must reproduce exactly.

    The rerun is recorded as run ``<run_id>-replay`` so the database can confirm it too.
    """
    llm.load_state(snapshot)
    again = complete(llm, prompt, tokens, run_id + "-replay", "restore-replay", episode_id, turn)
    result.restore_checks += 1
    if again != text:
        result.restore_mismatches.append(f"{run_id} {episode_id} turn {turn}")
