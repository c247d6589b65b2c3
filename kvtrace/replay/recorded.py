"""A run read back from the database, and the steps that re-execute part of it.

A request's cache path is one of three: recompute (nothing reused), in-context reuse of N tokens
(the live context: what the run's previous request left in the engine), or a prompt-cache restore of
the state a named request stored (its span id is recorded). Both reuse paths start from the state
another request ended with, so a request is re-executed after the requests it depends on, from that
request's end state, saved and loaded the way the experiment's restore control does it
(``Llama.save_state`` / ``load_state``: the same KV bytes the original request found).

In-context reuse continues from the run's previous request: one engine serves a run, one request
at a time, as kvtrace's experiment passes and tests run it. A llama-server request recorded through
``kvtrace proxy`` names the request that left its slot's state (or stored the restored one) itself:
the proxy read it from the server's log. A vLLM request that hit cached prefix blocks names the
request that stored the last of them (vLLM's block hashes, read by the hooks): the blocks it found are
that request's, so it is re-executed after that request, with the prefix cache holding what that
request and the ones it started from left there.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Optional

from kvtrace import queries
from kvtrace import semconv as sc
from kvtrace.errors import ConfigError
from kvtrace.patches.llama_cpp.engine import ENGINE as LLAMA_CPP
from kvtrace.patches.vllm.common import ENGINE as VLLM

LLAMA_SERVER = "llama-server"
"""The engine name of requests ``kvtrace proxy`` recorded in front of llama.cpp's server."""
REPLAYABLE_ENGINES = (LLAMA_CPP, LLAMA_SERVER, VLLM)

VLLM_RUNTIME_CACHE_SETTINGS = ("num_blocks",)
"""vLLM cache settings that follow from the memory given to the KV cache, not from a choice: not compared."""

UNREPLAYABLE_SAMPLING = ("logits_processor", "grammar")
"""Sampling inputs kvtrace records only as used or not: a replay runs without them."""


GREEDY = {"temp": 0.0, "temperature": 0.0, "repeat_penalty": 1.0, "repetition_penalty": 1.0, "frequency_penalty": 0.0,
          "presence_penalty": 0.0}
"""Sampling settings at which the chosen token is the logits' arg-max: the only requests whose generated
ids replay can read back exactly (``completion_token_ids``: the last one is the arg-max of the last row).
``temp`` as llama-cpp-python records it, ``temperature`` as a client of llama-server or vLLM sent it."""


class ReplayRefused(ConfigError):
    """What was recorded cannot be re-executed faithfully (exit 2); the message says why."""


@dataclass(frozen=True)
class EngineConfiguration:
    """What the engine recorded about itself: replay must load exactly this."""

    engine: str
    engine_version: str
    model: str
    model_fingerprint: str
    numerics: dict[str, Any]
    cache: dict[str, Any] = field(default_factory=dict)
    """The cache settings replay must load too (vLLM's block size, prefix caching, hash algorithm)."""

    def differences(self, other: "EngineConfiguration") -> list[str]:
        """What differs from ``other``, one phrase each (empty: the same engine, model and numerics)."""
        found = []
        if self.model_fingerprint != other.model_fingerprint:
            found.append(f"model fingerprint ({self.model_fingerprint} vs {other.model_fingerprint})")
        if self.engine_version != other.engine_version:
            found.append(f"engine version ({self.engine_version} vs {other.engine_version})")
        for settings, others in ((self.numerics, other.numerics), (self.cache, other.cache)):
            for key in sorted(set(settings) | set(others)):
                mine, theirs = settings.get(key), others.get(key)
                if mine != theirs:
                    found.append(f"{key} ({mine!r} vs {theirs!r})")
        return found


@dataclass(frozen=True)
class RecordedRequest:
    """One recorded request, in the order its run served it."""

    span_id: str
    run_id: str
    episode_id: str
    turn: int
    capture_mode: str
    configuration: EngineConfiguration
    sampling: dict[str, Any]
    cache_layer: str
    reused_tokens: int
    prompt: tuple[int, ...]
    output: tuple[int, ...]
    starts_from: Optional[str]
    """Span id of the request whose end state this one started from (None: it recomputed its prompt)."""
    slot: Optional[int] = None
    """The server slot that served it (llama-server; None in process)."""
    steps: Optional["RecordedSteps"] = None
    """The engine steps that computed it, where the engine recorded them (docs/batching.md)."""
    duration_ns: int = 0
    """How long the request took when it was recorded (its span's duration)."""

    def path(self) -> str:
        """The cache path in words: ``recompute``, ``in-context reuse of 40 tokens``, ``prompt-cache restore of
        40 tokens`` or (vLLM) ``prefix-block reuse of 64 tokens``."""
        if self.starts_from is None:
            return "recompute"
        if self.cache_layer == sc.LAYER_PROMPT_CACHE:
            return f"prompt-cache restore of {self.reused_tokens} tokens"
        if self.cache_layer == sc.LAYER_PREFIX_BLOCKS:
            return f"prefix-block reuse of {self.reused_tokens} tokens"
        return f"in-context reuse of {self.reused_tokens} tokens"

    def unrecorded_inputs(self) -> list[str]:
        """Sampling inputs this request used that the record does not hold (a replay runs without them)."""
        return [name for name in UNREPLAYABLE_SAMPLING if self.sampling.get(name)]


@dataclass(frozen=True)
class RecordedSteps:
    """How the engine batched one request: per generated token the rows and tokens of the step that computed
    its logits (the first token's step is the prompt's last prefill step), and the prompt's computed tokens
    per prefill step."""

    rows: tuple[int, ...]
    tokens: tuple[int, ...]
    prefill: tuple[int, ...]


@dataclass
class RecordedRun:
    run_id: str
    requests: list[RecordedRequest]
    """Every request of the run, in served order."""
    by_span: dict[str, RecordedRequest] = field(init=False)

    def __post_init__(self) -> None:
        self.by_span = {r.span_id: r for r in self.requests}

    def episode(self, episode_id: str) -> list[RecordedRequest]:
        found = [r for r in self.requests if r.episode_id == episode_id]
        if not found:
            episodes = sorted({r.episode_id for r in self.requests if r.episode_id})
            shown = ", ".join(episodes[:10]) + (" ..." if len(episodes) > 10 else "")
            raise ReplayRefused(f"run {self.run_id!r} has no episode {episode_id!r} (it has: {shown or 'none'})")
        return found

    def needed_for(self, targets: Iterable[RecordedRequest]) -> list[RecordedRequest]:
        """``targets`` and every request whose end state they (transitively) start from, in served order."""
        needed: set[str] = set()
        stack = [t.span_id for t in targets]
        while stack:
            span = stack.pop()
            if span in needed:
                continue
            needed.add(span)
            source = self.by_span[span].starts_from
            if source is not None:
                stack.append(source)
        return [r for r in self.requests if r.span_id in needed]


def read_run(client, run_id: str) -> RecordedRun:
    """The run as recorded, refused (``ReplayRefused``) when it cannot be re-executed."""
    columns, rows = queries.run(client, "replay_requests", {"run": run_id})
    if not rows:
        raise ReplayRefused(f"no run {run_id!r} in the database; `kvtrace runs` lists them")
    rows = [dict(zip(columns, row)) for row in rows]
    _refuse_unreplayable(run_id, rows)
    requests: list[RecordedRequest] = []
    slots = {row["span_id"]: row["slot_id"] for row in rows}
    for row in rows:
        requests.append(_request(row, requests[-1] if requests else None, slots))
    return RecordedRun(run_id, requests)


def _refuse_unreplayable(run_id: str, rows: list[dict[str, Any]]) -> None:
    modes = sorted({row["capture_mode"] for row in rows if row["capture_mode"] != sc.CAPTURE_IDS})
    if modes:
        raise ReplayRefused(
            f"run {run_id!r} was recorded with {'/'.join(modes) or 'no'} capture: its token ids never left the "
            f"engine (that keeps production traffic private), so there is nothing to re-execute; record with "
            f"KVTRACE_CAPTURE=ids to make a run replayable")
    engines = sorted({row["engine"] for row in rows if row["engine"] not in REPLAYABLE_ENGINES})
    if engines:
        raise ReplayRefused(f"run {run_id!r} was recorded by {', '.join(engines)}; replay re-executes "
                            f"llama-cpp-python runs, vLLM runs and llama-server runs recorded through kvtrace "
                            f"proxy only")
    for row in rows:
        sampling = json.loads(row["sampling_settings"] or "{}")
        if row["engine"] == LLAMA_SERVER and sampling.get("temperature") is None:
            raise ReplayRefused(f"run {run_id!r}: the request of episode {row['episode_id']} turn {row['turn']} "
                                f"sampled at the server's default temperature; replay re-executes greedy requests "
                                f"(temperature 0) only")
        changed = [f"{name} {sampling[name]}" for name, neutral in GREEDY.items()
                   if sampling.get(name) is not None and float(sampling[name]) != neutral]
        if changed:
            raise ReplayRefused(f"run {run_id!r} sampled with {', '.join(changed)} (episode {row['episode_id']} "
                                f"turn {row['turn']}); replay re-executes greedy requests (temperature 0, no "
                                f"repetition penalties) only")
        if len(row["prompt_token_ids"]) != row["prompt_tokens"]:
            where = ("record it through `kvtrace proxy --llama-server-log LOG`, which keeps the ids the server "
                     "tokenized" if row["engine"] == LLAMA_SERVER else "replay needs a run recorded inside the engine")
            raise ReplayRefused(f"run {run_id!r}: the request of episode {row['episode_id']} turn {row['turn']} "
                                f"has no recorded prompt token ids; {where}")


def _request(row: dict[str, Any], previous: Optional[RecordedRequest], slots: dict[str, Any]) -> RecordedRequest:
    starts_from = None
    spans = slots.keys()
    if row["reused_tokens"] > 0 and row["engine"] == LLAMA_SERVER:
        starts_from = _served_source(row, slots)
    elif row["reused_tokens"] > 0 and row["engine"] == VLLM:
        starts_from = row["source_span_id"]
        if starts_from not in spans:
            raise ReplayRefused(
                f"episode {row['episode_id']} turn {row['turn']} of run {row['run_id']!r} reused "
                f"{row['reused_tokens']} tokens of prefix blocks stored by "
                f"{'span ' + starts_from if starts_from else 'a request the hooks could not name'}, which is not "
                f"in the run; they cannot be rebuilt")
    elif row["reused_tokens"] > 0:
        if row["cache_layer"] == sc.LAYER_PROMPT_CACHE:
            starts_from = row["source_span_id"]
            if starts_from not in spans:
                raise ReplayRefused(
                    f"episode {row['episode_id']} turn {row['turn']} of run {row['run_id']!r} restored a state "
                    f"stored by span {starts_from or '(unknown)'}, which is not in the run; it cannot be rebuilt")
        elif previous is not None:
            starts_from = previous.span_id
        else:
            raise ReplayRefused(f"the first request of run {row['run_id']!r} reused {row['reused_tokens']} tokens "
                                f"left by something outside the run; it cannot be rebuilt")
    cache = {}
    if row["engine"] == VLLM:
        cache = {k: v for k, v in json.loads(row["cache_settings"] or "{}").items()
                 if k not in VLLM_RUNTIME_CACHE_SETTINGS}
    configuration = EngineConfiguration(row["engine"], row["engine_version"], row["model"],
                                        row["model_fingerprint"], json.loads(row["numerics_settings"] or "{}"), cache)
    return RecordedRequest(
        span_id=row["span_id"], run_id=row["run_id"], episode_id=row["episode_id"], turn=int(row["turn"]),
        capture_mode=row["capture_mode"], configuration=configuration,
        sampling=json.loads(row["sampling_settings"] or "{}"), cache_layer=row["cache_layer"],
        reused_tokens=int(row["reused_tokens"]), prompt=tuple(int(t) for t in row["prompt_token_ids"]),
        output=tuple(int(t) for t in row["token_ids"]), starts_from=starts_from,
        slot=None if row["slot_id"] is None else int(row["slot_id"]),
        steps=RecordedSteps(tuple(int(n) for n in row["step_rows"]), tuple(int(n) for n in row["step_tokens"]),
                            tuple(int(n) for n in row["prefill_steps"]))
        if row.get("batch_composition") == sc.BATCH_RECORDED else None,
        duration_ns=int(row.get("duration_ns") or 0))


def _served_source(row: dict[str, Any], slots: dict[str, Any]) -> str:
    """The request whose end state a llama-server request reused: its slot's previous request, or the request
    that stored the state restored from the prompt cache (the proxy read both from the server's log)."""
    where = f"episode {row['episode_id']} turn {row['turn']} of run {row['run_id']!r}"
    source = row["source_span_id"]
    if source not in slots:
        raise ReplayRefused(f"{where} reused {row['reused_tokens']} tokens of a state left by "
                            f"{'span ' + source if source else 'a request the proxy could not name'}, which is not "
                            f"in the run; it cannot be rebuilt")
    if row["cache_layer"] == sc.LAYER_PROMPT_CACHE and slots[source] != row["slot_id"]:
        raise ReplayRefused(f"{where} restored from the prompt cache a state saved by slot {slots[source]} (it ran "
                            f"on slot {row['slot_id']}); a state computed on another slot cannot be reproduced on a "
                            f"server replaying one slot")
    return source


@dataclass(frozen=True)
class Step:
    """One request to execute: a recorded request's prompt and sampling, started from a state (or none)."""

    key: str
    span_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    sampling: dict[str, Any]
    starts_from: Optional[str]
    """Span id whose end state is loaded first (None: recompute from an empty context)."""
    keep_state: bool
    """Keep this step's end state under ``span_id`` for later steps."""
    companions: tuple[tuple[int, int], ...] = ()
    """Requests sent alongside in one batch, as (prompt length, generated tokens) each (vLLM; none: alone)."""


def step(request: RecordedRequest, key: str, starts_from: Optional[str], needed_sources: set[str]) -> Step:
    return Step(key, request.span_id, request.prompt, len(request.output), request.sampling, starts_from,
                keep_state=request.span_id in needed_sources)


def as_factual_steps(requests: list[RecordedRequest]) -> list[Step]:
    """Each request on its own recorded path, in served order."""
    sources = {r.starts_from for r in requests if r.starts_from}
    return [step(r, r.span_id, r.starts_from, sources) for r in requests]


def plan_json(model: str, configuration: EngineConfiguration, steps: list[Step]) -> str:
    return json.dumps({"model": model, "configuration": asdict(configuration), "steps": [asdict(s) for s in steps]})


def one_configuration(requests: Iterable[RecordedRequest]) -> EngineConfiguration:
    """The engine configuration the requests share (refused when they recorded several)."""
    configurations = []
    for request in requests:
        if request.configuration not in configurations:
            configurations.append(request.configuration)
    if len(configurations) > 1:
        differences = "; ".join(configurations[0].differences(configurations[1]))
        raise ReplayRefused(f"the requests to re-execute were served with different engine settings ({differences}); "
                            f"switching the cache path alone cannot be isolated")
    return configurations[0]
