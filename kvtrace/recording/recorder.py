"""The recorder: plain records in, OpenTelemetry spans out.

Patches call :meth:`Recorder.start_request` when the engine starts a
generation call and :meth:`Recorder.finish` when it ends.  The recorder takes
correlation from W3C baggage (``kvtrace.run_id``, ``kvtrace.episode_id``,
``kvtrace.turn``) or configuration, applies the capture policy, and hands one
span per request to kvtrace's own pipeline on a kvtrace-owned
``TracerProvider`` (never the global one: vLLM and host applications install
their own).

Spans are built as ``ReadableSpan`` objects directly from the typed record
rather than through ``Span.set_attribute``: the SDK validates and copies every
element of every array attribute, which for per-token arrays costs more than
the rest of the recorder together.  The record's types are already checked
here, so nothing is lost.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import random
import threading
import time
from array import array
from typing import Any, Callable, Mapping, Optional

from opentelemetry import baggage, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, TracerProvider
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, TraceFlags
from opentelemetry.trace.status import Status, StatusCode

from kvtrace import __version__
from kvtrace import semconv as sc
from kvtrace.config import Settings, default_spool_dir, recording_disabled
from kvtrace.errors import KvtraceError
from kvtrace.recording.capture import CapturePolicy, pack_tokens
from kvtrace.recording.exporters import build_exporter
from kvtrace.recording.pipeline import Deferred, SpanPipeline
from kvtrace.recording.records import CacheEvent, Correlation, RequestRecord, StateOrigin
from kvtrace.recording.settings_texts import SettingsTexts, settings_text  # noqa: F401 - imported from here by patches
from kvtrace.recording.stats import StatsFile

log = logging.getLogger("kvtrace")

_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_UNSET = Status(StatusCode.UNSET)  # read-only: one for every span without an error


class Recorder:
    """Turns :class:`RequestRecord` objects into spans.  One per process."""

    def __init__(self, settings: Settings, exporter=None, service_name: Optional[str] = None):
        self.settings = settings
        self.capture = CapturePolicy(settings.capture_mode, settings.hash_key)
        self._settings_texts = SettingsTexts()  # settings dicts that repeat on every span, written once
        self.default_run_id = settings.run_id or f"run-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
        attrs: dict[str, Any] = {"telemetry.sdk.name": "kvtrace"}
        if service_name and not os.environ.get("OTEL_SERVICE_NAME"):
            attrs["service.name"] = service_name
        self.resource = Resource.create(attrs)
        self.scope = InstrumentationScope(sc.INSTRUMENTATION_SCOPE, __version__)
        if exporter is None:
            exporter = build_exporter(settings)
        # Counters go beside the spool this recorder writes (none for an exporter without one).
        spool_directory = getattr(exporter, "spool_directory", None)
        self.pipeline = SpanPipeline(
            exporter,
            max_queue_size=settings.queue_size,
            max_batch_size=settings.batch_size,
            schedule_delay_ms=settings.schedule_delay_ms,
            shutdown_timeout_s=settings.shutdown_timeout_s,
            stats=StatsFile.create(spool_directory) if spool_directory is not None else None,
        )
        self.provider = TracerProvider(resource=self.resource)
        self.provider.add_span_processor(self.pipeline)
        self._before_shutdown: list[Callable[[], None]] = []
        self._rng = random.Random()
        self._lock = threading.Lock()

    # --- ids and correlation --------------------------------------------------------

    def _new_ids(self, parent: Optional[SpanContext]) -> tuple[int, int]:
        with self._lock:
            span_id = self._rng.getrandbits(64) or 1
            trace_id = parent.trace_id if parent is not None else (self._rng.getrandbits(128) or 1)
        return trace_id, span_id

    def current_correlation(self, request_id: str = "", entries: Optional[Mapping[str, object]] = None) -> Correlation:
        """From ``entries`` (baggage a patch carried itself) or else the current context's baggage."""
        bag = baggage.get_all() if entries is None else entries
        run_id = str(bag.get(sc.RUN_ID) or self.settings.run_id or self.default_run_id)
        episode_id = str(bag.get(sc.EPISODE_ID) or self.settings.episode_id or "")
        turn_raw = bag.get(sc.TURN)
        turn = self.settings.turn
        if turn_raw not in (None, ""):
            try:
                parsed = int(turn_raw)
            except (TypeError, ValueError):
                parsed = None
            if parsed is not None and sc.TURN_MIN <= parsed <= sc.TURN_MAX:
                turn = parsed
            else:  # a caller's turn that is no Int32 is left out (the configured one stands), and counted
                self.pipeline.count_repairs(1)
        return Correlation(run_id=run_id, episode_id=episode_id, turn=turn, request_id=request_id)

    # --- the API patches use ----------------------------------------------------------

    def start_request(self, engine: str, operation: str = sc.OPERATION_TEXT_COMPLETION, model: str = "",
                      request_id: str = "", baggage_entries: Optional[Mapping[str, object]] = None) -> RequestRecord:
        """``baggage_entries``: the caller's baggage as a patch carried it across processes (else the
        current context's is read)."""
        parent_span = trace.get_current_span().get_span_context()
        parent = parent_span if parent_span.is_valid else None
        trace_id, span_id = self._new_ids(parent)
        span_hex = "%016x" % span_id
        bag = baggage.get_all() if baggage_entries is None else baggage_entries  # read once, for both uses
        record = RequestRecord(
            correlation=self.current_correlation(request_id or span_hex, bag),
            engine=engine,
            operation=operation,
            model=model,
            start_time_unix_nano=time.time_ns(),
            span_id=span_hex,
            trace_id="%032x" % trace_id,
            parent=parent,
        )
        # The arm is a label of the harness, not of the engine: baggage (per request) or KVTRACE_ARM.
        arm = str(bag.get(sc.ARM) or self.settings.arm or "")
        if arm:
            record.config[sc.ARM] = arm
        return record

    def hash_tokens(self, tokens) -> str:
        return self.capture.hash_tokens(tokens)

    def finish(self, record: RequestRecord) -> None:
        """Emit the record as a span, built on the pipeline's thread: the record is the span's from here on,
        and nothing changes it.  Never raises: errors are logged and counted."""
        try:
            if not record.end_time_unix_nano:
                record.end_time_unix_nano = time.time_ns()
            self.pipeline.on_end(Deferred(functools.partial(self._to_span, record)))
        except Exception:
            self.pipeline.counters.add("instrumentation_errors")
            log.exception("kvtrace: could not record request span")

    # --- record → span ------------------------------------------------------------------

    def request_attributes(self, r: RequestRecord) -> dict[str, Any]:
        c = r.correlation
        capture = self.capture
        a: dict[str, Any] = {
            sc.RUN_ID: c.run_id,
            sc.EPISODE_ID: c.episode_id,
            sc.TURN: c.turn,
            sc.REQUEST_ID: c.request_id,
            sc.GEN_AI_OPERATION: r.operation,
            sc.GEN_AI_PROVIDER: r.engine,
            sc.ENGINE_NAME: r.engine,
            sc.CAPTURE_MODE: capture.mode,
        }
        if r.model:
            a[sc.GEN_AI_REQUEST_MODEL] = r.model
        prompt = r.prompt_token_ids
        packed = pack_tokens(prompt) if prompt is not None else b""  # once, for the prompt hash and its blocks
        # The prompt hash (from the prompt's ids, or a text hash an importer set) places every
        # generated token and every piece of the client's text: they compare equal only under it.
        prompt_hash = capture.hash_packed(packed) if prompt is not None else r.config.get(sc.PROMPT_HASH)
        for key, value in r.config.items():
            if value is None:
                continue
            if key == sc.SAMPLING_SETTINGS and isinstance(value, dict):
                value = capture.sampling_settings(prompt_hash, value)
            a[key] = self._settings_texts.text(value) if isinstance(value, dict) else value
        if prompt is not None:
            a[sc.PROMPT_HASH] = prompt_hash
            # An engine that hashes its own blocks (vLLM) reports its block size in the config.
            a.setdefault(sc.PROMPT_BLOCK_SIZE, self.settings.block_size)
            a[sc.PROMPT_BLOCK_HASHES] = (r.vendor_block_hashes
                                         or capture.block_hashes_packed(packed, self.settings.block_size))
            ids = capture.prompt_token_ids(prompt)
            if ids is not None:
                a[sc.PROMPT_TOKEN_IDS] = ids
        a[sc.GEN_AI_USAGE_INPUT_TOKENS] = r.prompt_tokens
        a[sc.GEN_AI_USAGE_OUTPUT_TOKENS] = len(r.output_token_ids) or len(r.margins)
        a[sc.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS] = r.reused_tokens
        a[sc.CACHE_LAYER] = r.cache_layer
        a[sc.CACHE_REUSED_TOKENS] = r.reused_tokens
        a[sc.CACHE_RECOMPUTED_TOKENS] = r.recomputed_tokens
        a[sc.CACHE_REPLAYED_TOKENS] = r.replayed_tokens
        if r.state_key:
            a[sc.CACHE_STATE_KEY] = r.state_key
        if r.state_origin is not None:
            a.update(_origin_attributes(r.state_origin))
        if r.cache_integrity:
            a[sc.CACHE_INTEGRITY] = r.cache_integrity
        if r.hit_block_hashes:
            a[sc.CACHE_HIT_BLOCK_HASHES] = r.hit_block_hashes
        if r.block_layers:
            a[sc.PROMPT_BLOCK_LAYERS] = r.block_layers
        a[sc.OUTPUT_HASH] = capture.output_hash(prompt_hash, r.output_token_ids)
        ids = capture.output_token_ids(prompt_hash, r.output_token_ids, r.top1_ids, r.runner_up_ids)
        if ids is not None:
            a[sc.OUTPUT_TOKEN_IDS] = ids.chosen
            a[sc.OUTPUT_TOP1_IDS] = ids.top1
            a[sc.OUTPUT_RUNNER_UP_IDS] = ids.runner_up
        # float64 arrays: what the spool packs without touching an element (see add_token).
        a[sc.OUTPUT_MARGINS] = array("d", r.margins)
        a[sc.OUTPUT_LOGPROBS] = array("d", r.logprobs)
        if r.batch_composition:
            a[sc.BATCH_COMPOSITION] = r.batch_composition
        if r.batch_composition == sc.BATCH_RECORDED:
            a[sc.OUTPUT_STEP_ROWS] = array("q", r.step_rows)
            a[sc.OUTPUT_STEP_TOKENS] = array("q", r.step_tokens)
            a[sc.PROMPT_PREFILL_STEPS] = array("q", r.prefill_steps)
        if r.finish_reason:
            a[sc.OUTPUT_FINISH_REASON] = r.finish_reason
        if r.rows_cut_at is not None:
            a[sc.OUTPUT_ROWS_CUT_AT] = r.rows_cut_at
            a[sc.OUTPUT_ROWS_CUT_REASON] = r.rows_cut_reason or ""
        return a

    def _to_span(self, r: RequestRecord) -> ReadableSpan:
        context = SpanContext(int(r.trace_id, 16), int(r.span_id, 16), is_remote=False, trace_flags=_SAMPLED)
        attributes = self.request_attributes(r)
        status = _UNSET
        if r.error:
            status = Status(StatusCode.ERROR,
                            self.capture.error_text(attributes.get(sc.PROMPT_HASH), r.error, r.error_detail))
        return ReadableSpan(
            name=sc.SPAN_REQUEST,
            context=context,
            parent=r.parent,
            resource=self.resource,
            attributes=attributes,
            events=[_to_event(e) for e in r.events],
            kind=SpanKind.INTERNAL,
            status=status,
            start_time=r.start_time_unix_nano,
            end_time=r.end_time_unix_nano,
            instrumentation_scope=self.scope,
        )

    def before_shutdown(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` first when this recorder shuts down: a patch that holds records back (vLLM's
        requests waiting for rows still on the device) hands them over while spans can still go out."""
        self._before_shutdown.append(callback)

    def shutdown(self) -> None:
        for callback in self._before_shutdown:
            try:
                callback()
            except Exception:
                log.exception("kvtrace: could not finish held records at shutdown")
        self._before_shutdown.clear()
        self.provider.shutdown()


def _origin_attributes(o: StateOrigin) -> dict[str, Any]:
    return {
        sc.CACHE_SOURCE_SPAN_ID: o.span_id,
        sc.CACHE_SOURCE_TRACE_ID: o.trace_id,
        sc.CACHE_SOURCE_REQUEST_ID: o.request_id,
        sc.CACHE_SOURCE_RUN_ID: o.run_id,
        sc.CACHE_SOURCE_EPISODE_ID: o.episode_id,
        sc.CACHE_SOURCE_TURN: o.turn,
        sc.CACHE_SOURCE_TIME: o.time_unix_nano,
    }


def _to_event(e: CacheEvent) -> Event:
    a: dict[str, Any] = {sc.EVENT_LAYER: e.layer}
    for key, value in (
        (sc.EVENT_OUTCOME, e.outcome),
        (sc.EVENT_KEY_HASH, e.key_hash),
        (sc.EVENT_TOKENS, e.tokens),
        (sc.EVENT_PREFIX_TOKENS, e.prefix_tokens),
        (sc.EVENT_ENTRIES_SCANNED, e.entries_scanned),
        (sc.EVENT_SIZE_BYTES, e.size_bytes),
        (sc.EVENT_REASON, e.reason),
        (sc.EVENT_BLOCK_HASHES, e.block_hashes),
        (sc.EVENT_BLOCK_IDS, e.block_ids),
        (sc.EVENT_PARENT_HASH, e.parent_hash),
    ):
        if value is not None:
            a[key] = value
    if e.source is not None:
        a.update(_origin_attributes(e.source))
    return Event(e.name, a, timestamp=e.time_unix_nano)


# --- the process-wide recorder ---------------------------------------------------------

_recorder: Optional[Recorder] = None
_recorder_pid = -1
_failed_pid = -1  # the process whose recorder could not be created (it runs untraced)
_recorder_lock = threading.Lock()
_pid = os.getpid()
"""This process's id, kept current across forks: ``os.getpid()`` is a system call, and hooks ask for the
recorder several times per request."""


def _after_fork() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_after_fork)


def get_recorder() -> Optional[Recorder]:
    """This process's recorder (created on first use), or ``None`` when disabled or not creatable.

    Never raises: engine hooks call it on the engine's thread. A recorder that
    cannot be created (a bad setting, an unwritable directory) is logged once,
    counted in ``recorder_failures`` where ``kvtrace db status`` reads it, and
    the process goes on untraced; it is not retried on every request.
    """
    global _recorder, _recorder_pid, _failed_pid
    if _recorder is not None and _recorder_pid == _pid:
        return _recorder
    if _failed_pid == _pid:
        return None
    if recording_disabled(os.environ):
        return None  # asked of the environment each time, as before, without reading every setting (~90 µs)
    with _recorder_lock:
        if (_recorder is None or _recorder_pid != _pid) and _failed_pid != _pid:
            try:
                settings = Settings.from_env()
                if settings.disabled:
                    return None
                recorder = Recorder(settings)
            except Exception as exc:
                _failed_pid = _pid
                _report_creation_failure(exc)
                return None
            _recorder = recorder
            _recorder_pid = _pid
            atexit.register(recorder.shutdown)
    return _recorder if _recorder_pid == _pid else None


def _report_creation_failure(exc: Exception) -> None:
    """Log (once: the caller remembers the failure) and count it beside the spool, if there is one."""
    try:
        reason = str(exc) if isinstance(exc, KvtraceError) else f"{type(exc).__name__}: {exc}"
        log.warning("kvtrace: tracing is off in this process (pid %d): %s", os.getpid(), reason)
        stats = StatsFile.create(default_spool_dir())
        if stats is not None:
            stats.publish({"recorder_failures": 1}, error=reason[:500])
            stats.close()
    except Exception:
        log.debug("kvtrace: could not count the recorder failure", exc_info=True)


def set_recorder(recorder: Optional[Recorder]) -> Optional[Recorder]:
    """Install a specific recorder (tests, embedding); returns the previous one."""
    global _recorder, _recorder_pid, _failed_pid
    with _recorder_lock:
        _failed_pid = -1
        previous = _recorder
        _recorder = recorder
        _recorder_pid = _pid
    return previous
