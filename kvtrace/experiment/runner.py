"""Run the plan: one fresh engine per pass (``Llama`` here, vLLM's ``LLM`` in ``vllm_pass``), serial
requests, batch size one, greedy decoding.

Each pass runs in a process of its own (``isolation``), so a native crash or hang of the engine
ends that pass with a clear error while the passes before it stay recorded. Every request goes
through the instrumented engine and is tagged with run / episode / turn / arm through
``kvtrace.correlate``, so the spool holds everything the report needs. A Ctrl-C stops between
requests; what was recorded stays usable (the spool is durable) and is reported.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional

from kvtrace import correlate
from kvtrace.experiment.conversation import CONVERSATIONS, Conversation
from kvtrace.experiment.isolation import DEFAULT_PASS_TIMEOUT, PassDied, PassResult, PassSpec, run_isolated
from kvtrace.experiment.plan import CACHE_ARMS, CONTROL_ARM, RESET_ARMS, PassKey, Plan, VllmSettings, format_bytes
from kvtrace.experiment.workload import Episode, episode_order, make_episodes
from kvtrace.patches.llama_cpp.repack import amx_hint, load_llama
from kvtrace.progress import Progress

_GGML_KV_TYPES = {"f32": 0, "f16": 1, "q8_0": 8}
"""``--kv-type`` → ggml type id (``GGML_TYPE_F32``, ``GGML_TYPE_F16``, ``GGML_TYPE_Q8_0``)."""


def engine_crash_hint() -> str:
    """What to suspect when an engine pass dies or hangs: the AMX repack where this CPU has it."""
    return amx_hint() or "run the pass alone with -v to see llama.cpp's own log"


@dataclass(frozen=True)
class PassFailure:
    """A pass whose engine process died or hung; the passes before it finished and are recorded."""

    key: PassKey
    run_id: str
    cause: str
    requests: int
    passes_kept: int

    def describe(self) -> str:
        """One line: which pass, what happened, what is kept, what to try next."""
        k, s = self.key, self.key.settings
        kept = (f"the {self.passes_kept} pass(es) before it are kept (kvtrace runs)" if self.passes_kept
                else "no pass had finished before it")
        where = (f"the engine {self.cause} in pass {self.run_id} (format {k.format}, arm {k.arm}, repeat "
                 f"{k.repeat}, order {k.order}) after {self.requests} finished request(s); {kept}; to "
                 f"reproduce, run that pass alone")
        if isinstance(s, VllmSettings):
            return (f"{where} (kvtrace experiment --engine vllm ... --dtype {k.format} --arms {k.arm} "
                    f"--batch {s.batch}); run it "
                    f"with VLLM_LOGGING_LEVEL=INFO to see vLLM's own log")
        cache = f" --cache-ram {format_bytes(k.cache_ram)}" if k.cache_ram is not None else ""
        return (f"{where} (kvtrace experiment ... --formats {k.format} --arms {k.arm} "
                f"--n-batch {s.n_batch} --n-ubatch {s.n_ubatch} --flash-attn {s.flash_attn} --kv-type "
                f"{s.kv_type} --weight-repack {s.weight_repack}{cache}); {engine_crash_hint()}")


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
    peak_rss_bytes: int = 0
    """The largest peak resident memory of any pass's engine process."""

    def add(self, result: PassResult) -> None:
        self.requests += result.requests
        self.restore_checks += result.restore_checks
        self.restore_mismatches += result.restore_mismatches
        self.interrupted = self.interrupted or result.interrupted
        self.peak_rss_bytes = max(self.peak_rss_bytes, result.peak_rss_bytes)


def open_llama(model: Path, plan: Plan):
    settings = plan.pass_settings  # a pass's plan holds one engine setting (Plan.for_pass)
    kv_type = _GGML_KV_TYPES[settings.kv_type]
    # Threads pinned explicitly: the machine is shared, and steadier timing keeps runs comparable.
    # load_llama: the weight repack off on every CPU (same kernels everywhere; no AMX crash) unless a
    # pass asks for llama.cpp's default on purpose (its own process: a crash ends only that pass).
    return load_llama(model, weight_repack=settings.weight_repack == "on", n_ctx=plan.n_ctx,
                      n_batch=settings.n_batch, n_ubatch=settings.n_ubatch,
                      flash_attn=settings.flash_attn == "on", type_k=kv_type, type_v=kv_type, n_threads=plan.n_threads,
                      n_threads_batch=plan.n_threads, seed=plan.seed, verbose=False)


def run_experiment(plan: Plan, models: dict[str, Path], progress: Progress = Progress(),
                   pass_timeout: float = DEFAULT_PASS_TIMEOUT) -> Outcome:
    """Run every pass of ``plan``, each in its own process; stop at the first that dies or hangs
    (``Outcome.failure``) or at Ctrl-C (``Outcome.interrupted``). ``progress`` counts turns."""
    outcome = Outcome()
    started = time.monotonic()
    keys = list(plan.passes())
    per_pass = plan.episodes * plan.turns
    progress.start(len(keys) * per_pass, "turns")
    try:
        for i, key in enumerate(keys, 1):
            run_id = plan.run_id(key)
            counted = _TurnCounter(progress, f"[{i}/{len(keys)}] ")
            try:
                result = run_isolated(PassSpec(plan, models[key.format], key, run_id), pass_timeout, counted)
            except PassDied as died:
                outcome.failure = PassFailure(key, run_id, died.cause, died.requests, passes_kept=len(outcome.runs))
                break
            progress.advance(per_pass - counted.turns)  # turns an episode skipped with a full context
            outcome.runs.append({"run_id": run_id, "format": key.format, "settings": key.settings.label,
                                 "arm": key.arm, "cache_ram": key.cache_ram, "repeat": key.repeat, "order": key.order,
                                 "batch": getattr(key.settings, "batch", 1)})
            outcome.add(result)
            if outcome.interrupted:
                break
    except KeyboardInterrupt:
        outcome.interrupted = True
    finally:
        outcome.seconds = time.monotonic() - started
        progress.close()
    return outcome


class _TurnCounter:
    """Turns a pass's "about to run turn N" messages into progress counts."""

    def __init__(self, progress: Progress, label: str):
        self.progress, self.label = progress, label
        self.turns = 0

    def __call__(self, text: str, turns_done: int) -> None:
        self.progress.advance(turns_done - self.turns)
        self.turns = turns_done
        self.progress(self.label + text)


@dataclass
class Agent:
    """One episode in flight: its environment and its conversation so far."""

    episode: Episode
    conversation: Conversation
    done: bool = False


def drive_episodes(plan: Plan, key: PassKey, run_id: str, result: PassResult, progress: Callable[[str], None],
                   start_conversation: Callable, turn: Callable[["Agent", int, list[int]], None]) -> None:
    """A pass's episodes in its order and schedule, whatever the engine: a progress message before
    every turn (the parent's sign of life), then ``turn(agent, index, prompt)`` unless the agent is
    done (its context full: the episode ends there, the same way in every run that got there);
    ``result.turns`` counts both. ``start_conversation(opening)``: the engine's
    conversation of the plan's kind."""
    agents = _agents(plan, key, start_conversation)
    for agent, index in schedule_turns(agents, plan.turns, plan.schedule):
        progress(f"{run_id} episode {agent.episode.episode_id} turn {index + 1}/{plan.turns}")
        prompt = _next_prompt(agent, plan)
        if prompt is not None:
            turn(agent, index, prompt)
        result.turns += 1


def drive_turns_together(plan: Plan, key: PassKey, run_id: str, result: PassResult, progress: Callable[[str], None],
                         start_conversation: Callable, turns: Callable[[list], None]) -> None:
    """Like ``drive_episodes``, turn by turn across the episodes, each turn's requests handed over together:
    ``turns([(agent, index, prompt), ...])`` for the agents not done (``--batch`` of ``--engine vllm``)."""
    agents = _agents(plan, key, start_conversation)
    for index in range(plan.turns):
        progress(f"{run_id} turn {index + 1}/{plan.turns} of {len(agents)} episodes")
        requests = [(agent, index, prompt) for agent in agents if (prompt := _next_prompt(agent, plan)) is not None]
        if requests:
            turns(requests)
        result.turns += len(agents)


def _next_prompt(agent: "Agent", plan: Plan) -> Optional[list[int]]:
    """The agent's next prompt; ``None`` once it is done, which a full context makes it (the episode ends
    there, the same way in every run that got there)."""
    if not agent.done:
        prompt = agent.conversation.prompt()
        if len(prompt) + plan.tokens <= plan.n_ctx:
            return prompt
        agent.done = True
    return None


def _agents(plan: Plan, key: PassKey, start_conversation: Callable) -> list["Agent"]:
    episodes = make_episodes(plan.episodes, plan.seed)
    return [Agent(episodes[i], start_conversation(episodes[i].opening()))
            for i in episode_order(plan.episodes, key.order, plan.seed)]


def run_pass(plan: Plan, model: Path, key: PassKey, run_id: str, result: PassResult,
             progress: Callable[[str], None]) -> None:
    """One pass in this process (the child of ``run_isolated``); a message before every turn tells
    the parent it is alive. ``result.turns`` counts the turns done or skipped (context full)."""
    from kvtrace.experiment.caches import open_cache  # imports llama-cpp-python: engine processes only

    llm = open_llama(model, plan.for_pass(key))  # fresh history per pass: nothing cached from another run
    with tempfile.TemporaryDirectory(prefix="kvtrace-disk-cache-") as cache_dir:
        try:
            if key.arm in CACHE_ARMS:
                llm.set_cache(open_cache(key.arm, key.cache_ram, Path(cache_dir)))
            drive_episodes(plan, key, run_id, result, progress,
                           lambda opening: CONVERSATIONS[plan.conversation](llm, opening),
                           lambda agent, turn, prompt: _turn(llm, plan, key, run_id, agent, turn, prompt, result))
        finally:
            cache = getattr(llm, "cache", None)
            if hasattr(cache, "cache"):  # the disk cache's sqlite handle, before its directory goes
                cache.cache.close()
            llm.close()


def schedule_turns(agents: list[Agent], turns: int, schedule: str) -> Iterator[tuple[Agent, int]]:
    """(agent, turn) in the order the server sees the requests."""
    if schedule == "interleaved":
        return ((agent, turn) for turn in range(turns) for agent in agents)
    return ((agent, turn) for agent in agents for turn in range(turns))


def _turn(llm, plan: Plan, key: PassKey, run_id: str, agent: Agent, turn: int, prompt: list[int],
          result: PassResult) -> None:
    episode = agent.episode
    if key.arm in RESET_ARMS:
        llm.reset()  # nothing reused in context: full recompute, or a prompt-cache restore
    snapshot = llm.save_state() if key.arm == "restore" else None
    output = complete(llm, prompt, plan.tokens, run_id, key.arm, episode.episode_id, turn)
    result.requests += 1
    text = output["choices"][0]["text"]
    agent.conversation.add_turn(prompt, output, episode.observe(text, turn))
    if snapshot is not None:
        check_restore(llm, snapshot, prompt, plan.tokens, run_id, episode.episode_id, turn, text, result)


def complete(llm, prompt: list[int], tokens: int, run_id: str, arm: str, episode_id: str, turn: int) -> dict:
    with correlate(run_id=run_id, episode_id=episode_id, turn=turn, arm=arm):
        return llm.create_completion(prompt, max_tokens=tokens, temperature=0.0)


def check_restore(llm, snapshot, prompt, tokens, run_id, episode_id, turn, text, result: PassResult) -> None:
    """The control: restore the state saved before the request and rerun it; it must reproduce exactly.

    The rerun is recorded as run ``<run_id>-replay`` (arm ``restore-replay``) so the database can
    confirm it too; the report shows it as a control, not as an arm.
    """
    llm.load_state(snapshot)
    again = complete(llm, prompt, tokens, run_id + "-replay", CONTROL_ARM, episode_id, turn)
    result.restore_checks += 1
    if again["choices"][0]["text"] != text:
        result.restore_mismatches.append(f"{run_id} {episode_id} turn {turn}")
