"""Plain records that engine patches fill in; the recorder turns them into spans.

Patches never touch OpenTelemetry: they create a :class:`RequestRecord` through
``Recorder.start_request()``, append :class:`CacheEvent` and token decisions to
it while the engine works, and hand it back with ``Recorder.finish()``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

from kvtrace import semconv

@dataclass
class CacheEvent:
    """One thing a cache did on behalf of a request.

    ``name`` is one of the ``semconv.EVENT_CACHE_*`` names.  Token-id content
    never goes in here: keys are identified by hashes computed by the patch
    through ``Recorder.hash_tokens()``.
    """

    name: str
    layer: str
    time_unix_nano: int = field(default_factory=time.time_ns)
    outcome: Optional[str] = None
    key_hash: Optional[str] = None
    tokens: Optional[int] = None
    prefix_tokens: Optional[int] = None
    entries_scanned: Optional[int] = None
    size_bytes: Optional[int] = None
    reason: Optional[str] = None
    block_hashes: Optional[list[str]] = None
    block_ids: Optional[list[int]] = None
    parent_hash: Optional[str] = None
    source: Optional["StateOrigin"] = None


@dataclass(frozen=True)
class StateOrigin:
    """Which request stored a piece of cached state (the provenance of a restore)."""

    span_id: str
    trace_id: str
    request_id: str
    run_id: str
    episode_id: str
    turn: int
    time_unix_nano: int


@dataclass
class Correlation:
    """Who a request belongs to: one run (server history), episode and turn."""

    run_id: str
    episode_id: str = ""
    turn: int = -1
    request_id: str = ""


@dataclass
class RequestRecord:
    """Everything kvtrace knows about one generation call.

    Invariants: ``output_token_ids``, ``top1_ids``, ``runner_up_ids``,
    ``margins`` and ``logprobs`` are parallel (position i is the i-th generated
    token); ``reused_tokens + recomputed_tokens == prompt_tokens`` once the
    engine has evaluated the prompt.
    """

    correlation: Correlation
    engine: str
    start_time_unix_nano: int
    span_id: str
    trace_id: str
    parent: Any = None  # opaque to patches: the recorder's parent context
    end_time_unix_nano: int = 0
    operation: str = semconv.OPERATION_TEXT_COMPLETION
    model: str = ""
    config: dict[str, Any] = field(default_factory=dict)
    """Extra configuration attributes keyed by ``semconv`` names."""
    prompt_token_ids: Optional[list[int]] = None
    prompt_tokens: int = 0
    cache_layer: str = semconv.LAYER_NONE
    reused_tokens: int = 0
    recomputed_tokens: int = 0
    replayed_tokens: int = 0
    state_key: Optional[str] = None
    state_origin: Optional[StateOrigin] = None
    hit_block_hashes: Optional[list[str]] = None
    block_layers: Optional[list[str]] = None
    vendor_block_hashes: Optional[list[str]] = None
    """Block hashes computed by the engine itself (vLLM), used instead of kvtrace's own."""
    output_token_ids: list[int] = field(default_factory=list)
    top1_ids: list[int] = field(default_factory=list)
    runner_up_ids: list[int] = field(default_factory=list)
    margins: list[float] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    step_rows: list[int] = field(default_factory=list)
    """Per generated token (parallel to ``margins``): sequences in the engine step that computed its logits."""
    step_tokens: list[int] = field(default_factory=list)
    """Per generated token: tokens that step computed over all its rows."""
    prefill_steps: list[int] = field(default_factory=list)
    """The prompt's computed tokens per engine step, in order."""
    batch_composition: Optional[str] = None
    """``semconv.BATCH_RECORDED`` once the arrays above are filled, ``BATCH_UNKNOWN`` where no hook sees
    the engine's steps; ``None``: not said."""
    finish_reason: Optional[str] = None
    rows_cut_at: Optional[int] = None
    """Output position where the per-token arrays stop short of the token ids, and why
    (``semconv.ROWS_MISALIGNED`` / ``ROWS_LATE`` / ``ROWS_UNREPORTED``); ``None``: they do not."""
    rows_cut_reason: Optional[str] = None
    events: list[CacheEvent] = field(default_factory=list)
    cache_integrity: Optional[str] = None
    """The verdict on the state the engine reused or restored (``semconv.INTEGRITY_*``); ``None``: nothing reused."""
    error: Optional[str] = None
    """What went wrong, in kvtrace's own words (an exception type, "upstream HTTP 400"): stored as it is."""
    error_detail: Optional[str] = None
    """The engine's or upstream's own message, which may repeat the client's input: stored as the
    capture policy lets the client's text leave (``CapturePolicy.error_text``)."""

    def add_token(self, chosen: int, top1: int, runner_up: int, margin: float, logprob: float) -> None:
        # Appended as given, on the engine's thread once per token: the recorder makes the span's
        # arrays homogeneous (int64, float64) in one C call per array when the request finishes,
        # and a numpy scalar or an int passed as a margin converts there like int()/float().
        self.output_token_ids.append(chosen)
        self.top1_ids.append(top1)
        self.runner_up_ids.append(runner_up)
        self.margins.append(margin)
        self.logprobs.append(logprob)

    def judge_integrity(self, layer: str, used: int, matched: Optional[int], reason: str,
                        source: Optional[StateOrigin] = None, key_hash: Optional[str] = None,
                        block_hashes: Optional[list[str]] = None) -> None:
        """The verdict on a state the engine continued from: its first ``used`` tokens came from the state,
        and the state's first ``matched`` are the prompt's own (``None``: nothing to compare them with).

        A violation is an ``EVENT_CACHE_INTEGRITY_VIOLATION`` naming the state's origin; once violated, a
        request stays violated (vLLM notes a preempted request's later lookups on the same record).
        """
        if matched is not None and matched >= used:
            verdict = semconv.INTEGRITY_VERIFIED
        elif matched is None:
            verdict = semconv.INTEGRITY_UNVERIFIABLE
        else:
            verdict = semconv.INTEGRITY_VIOLATED
            self.events.append(CacheEvent(
                name=semconv.EVENT_CACHE_INTEGRITY_VIOLATION, layer=layer,
                key_hash=key_hash, tokens=used, prefix_tokens=matched, reason=reason,
                block_hashes=block_hashes, source=source))
        if self.cache_integrity != semconv.INTEGRITY_VIOLATED:
            self.cache_integrity = verdict

    def origin(self) -> StateOrigin:
        """The provenance others should cite when they reuse state this request stores."""
        return StateOrigin(
            span_id=self.span_id,
            trace_id=self.trace_id,
            request_id=self.correlation.request_id,
            run_id=self.correlation.run_id,
            episode_id=self.correlation.episode_id,
            turn=self.correlation.turn,
            time_unix_nano=self.start_time_unix_nano,
        )
