"""Run the plan: one fresh ``Llama`` per pass, serial requests, batch size one, greedy decoding.

Every request goes through the instrumented engine and is tagged with run / episode / turn / arm
through ``kvtrace.correlate``, so the spool holds everything the report needs. A Ctrl-C stops
between requests; what was recorded stays usable (the spool is durable) and is reported.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from kvtrace import correlate
from kvtrace.experiment.plan import Plan
from kvtrace.experiment.workload import episode_order, make_episodes

RAM_CACHE_BYTES = 1 << 30


@dataclass
class Outcome:
    """What the harness itself saw (the database holds the rest)."""

    runs: list[dict] = field(default_factory=list)
    requests: int = 0
    restore_checks: int = 0
    restore_mismatches: list[str] = field(default_factory=list)
    interrupted: bool = False
    seconds: float = 0.0


def open_llama(model: Path, plan: Plan):
    from kvtrace.patches.llama_cpp_repack import load_llama

    # Threads pinned explicitly: the machine is shared, and steadier timing keeps runs comparable.
    # load_llama: the weight repack off on every CPU (same kernels everywhere; no AMX crash).
    return load_llama(model, n_ctx=plan.n_ctx, n_batch=256, n_ubatch=256, n_threads=plan.n_threads,
                      n_threads_batch=plan.n_threads, seed=plan.seed, verbose=False)


def run_experiment(plan: Plan, models: dict[str, Path],
                   progress: Callable[[str], None] = lambda m: None) -> Outcome:
    from kvtrace.patches import llama_cpp as llama_patch
    from kvtrace.recorder import get_recorder

    # Patched directly (idempotent) rather than through the import hook: llama_cpp is already
    # imported here, and a hook registered earlier in the process may have been unpatched since.
    llama_patch.patch()
    outcome = Outcome()
    started = time.monotonic()
    total = sum(1 for _ in plan.passes())
    try:
        for i, (fmt, arm, repeat, order) in enumerate(plan.passes(), 1):
            run_id = plan.run_id(fmt, arm, repeat, order)
            progress(f"[{i}/{total}] {run_id}")
            outcome.runs.append({"run_id": run_id, "format": fmt, "arm": arm, "repeat": repeat, "order": order})
            run_pass(plan, models[fmt], run_id, arm, order, outcome, progress)
    except KeyboardInterrupt:
        outcome.interrupted = True
    finally:
        recorder = get_recorder()
        if recorder is not None:
            recorder.pipeline.force_flush()
        outcome.seconds = time.monotonic() - started
    return outcome


def run_pass(plan: Plan, model: Path, run_id: str, arm: str, order: str, outcome: Outcome,
             progress: Callable[[str], None]) -> None:
    import llama_cpp

    llm = open_llama(model, plan)  # fresh history per pass: nothing cached from another run
    try:
        if arm == "prompt-cache":
            llm.set_cache(llama_cpp.LlamaRAMCache(capacity_bytes=RAM_CACHE_BYTES))
        episodes = make_episodes(plan.episodes, plan.seed)
        for n, index in enumerate(episode_order(plan.episodes, order, plan.seed), 1):
            episode = episodes[index]
            progress(f"{run_id} episode {n}/{plan.episodes}")
            prompt = llm.tokenize(episode.opening().encode())
            for turn in range(plan.turns):
                if len(prompt) + plan.tokens > plan.n_ctx:
                    break  # context full: the episode ends here (the same way in every run that got here)
                if arm in ("off", "prompt-cache"):
                    llm.reset()  # nothing reused in context: full recompute, or a prompt-cache restore
                snapshot = llm.save_state() if arm == "restore" else None
                text = complete(llm, prompt, plan.tokens, run_id, arm, episode.episode_id, turn)
                outcome.requests += 1
                after = llm.input_ids[: llm.n_tokens].tolist()
                if snapshot is not None:
                    check_restore(llm, snapshot, prompt, plan.tokens, run_id, episode.episode_id, turn, text, outcome)
                observation = llm.tokenize(episode.observe(text, turn).encode(), add_bos=False)
                prompt = after + observation
    finally:
        llm.close()


def complete(llm, prompt: list[int], tokens: int, run_id: str, arm: str, episode_id: str, turn: int) -> str:
    with correlate(run_id=run_id, episode_id=episode_id, turn=turn, arm=arm):
        out = llm.create_completion(prompt, max_tokens=tokens, temperature=0.0)
    return out["choices"][0]["text"]


def check_restore(llm, snapshot, prompt, tokens, run_id, episode_id, turn, text, outcome: Outcome) -> None:
    """The control: restore the state saved before the request and rerun it; it must reproduce exactly.

    The rerun is recorded as run ``<run_id>-replay`` so the database can confirm it too.
    """
    llm.load_state(snapshot)
    again = complete(llm, prompt, tokens, run_id + "-replay", "restore-replay", episode_id, turn)
    outcome.restore_checks += 1
    if again != text:
        outcome.restore_mismatches.append(f"{run_id} {episode_id} turn {turn}")
