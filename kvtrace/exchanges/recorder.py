"""A recorder for requests kvtrace observes from outside an engine (probe, import).

Those commands are not engine processes: they make their own recorder from the
environment (exporter, capture policy, hash key), tag every record explicitly,
and flush before they exit.  The process-wide recorder is left alone.

A request the probe sends carries the W3C ``traceparent`` and ``baggage`` of
its record (:func:`trace_headers`): a server kvtrace traces (``kvtrace run``,
vLLM's plugin) then records its own span of the request as a child of the
probe's, in the same trace, run, episode and turn.  The saved queries count
such a request once, by the engine's record (``queries/shared/requests_once.sql``).
"""

from __future__ import annotations

import functools
from typing import Optional

from opentelemetry import baggage
from opentelemetry.baggage.propagation import W3CBaggagePropagator

import kvtrace
from kvtrace import semconv as sc
from kvtrace.config import Settings
from kvtrace.errors import ConfigError
from kvtrace.exchanges.exchange import Exchange, TextHasher, fill_record
from kvtrace.recording.recorder import Recorder
from kvtrace.recording.records import RequestRecord

FLUSH_EVERY = 256
"""Records between flushes: the span queue is bounded and drops (counting) when full."""


class OutsideRecorder:
    def __init__(self, settings: Optional[Settings] = None):
        settings = settings or Settings.from_env()
        if settings.disabled:
            raise ConfigError("recording is disabled (KVTRACE_DISABLED / OTEL_SDK_DISABLED); unset it to record")
        self.recorder = Recorder(settings)
        self.hasher = TextHasher(settings.hash_key)
        self.recorded = 0

    def start(self, *, engine: str, run_id: str, episode_id: str, turn: int, arm: str) -> RequestRecord:
        """A record with its ids and correlation fixed, before the request is sent (see :func:`trace_headers`)."""
        with kvtrace.correlate(run_id=run_id, episode_id=episode_id, turn=turn, arm=arm or None):
            return self.recorder.start_request(engine)

    def record(self, exchange: Exchange, *, engine: str, run_id: str, episode_id: str, turn: int, arm: str,
               reused_tokens: int, reused_source: str, cache_layer: str, start_ns: int, end_ns: int,
               config: Optional[dict] = None) -> RequestRecord:
        """Record an exchange that was not sent through :meth:`start` (an imported log)."""
        record = self.start(engine=engine, run_id=run_id, episode_id=episode_id, turn=turn, arm=arm)
        return self.finish(record, exchange, reused_tokens=reused_tokens, reused_source=reused_source,
                           cache_layer=cache_layer, start_ns=start_ns, end_ns=end_ns, config=config)

    def finish(self, record: RequestRecord, exchange: Exchange, *, reused_tokens: int, reused_source: str,
               cache_layer: str, start_ns: int, end_ns: int, config: Optional[dict] = None) -> RequestRecord:
        """Fill ``record`` (from :meth:`start`) with what the exchange says and emit its span."""
        record.start_time_unix_nano, record.end_time_unix_nano = start_ns, max(end_ns, start_ns)
        record.config.update(config or {})
        fill_record(record, exchange, reused_tokens, reused_source, cache_layer)
        self.recorder.finish(record)
        self.recorded += 1
        if self.recorded % FLUSH_EVERY == 0:
            self.recorder.pipeline.force_flush()
        return record

    def hash_prompt_ids(self, ids) -> str:
        return self.recorder.hash_tokens(ids)

    def close(self) -> dict[str, int]:
        """Flush everything; returns the pipeline's counters (drops, export failures)."""
        self.recorder.pipeline.force_flush()
        counters = self.recorder.pipeline.counters.snapshot()
        self.recorder.shutdown()
        return counters


def trace_headers(record: RequestRecord, arm: Optional[str] = None) -> dict[str, str]:
    """W3C ``traceparent`` (the record's trace, the record's span as the parent) and ``baggage`` (its run,
    episode, turn and arm, or ``arm`` instead), as a client harness sends them to a server kvtrace traces.

    The ``traceparent`` is written here, the baggage encoded by OpenTelemetry's propagator once per
    correlation: the propagators' objects cost 13 µs a request on the proxy's path (50 in place), this a
    tenth. ``tests/unit/test_trace_headers.py`` holds both to the propagators' own output."""
    c = record.correlation
    headers = dict(_baggage(*_texts(c.run_id, c.episode_id, c.turn, arm or record.config.get(sc.ARM))))
    headers["traceparent"] = f"00-{record.trace_id}-{record.span_id}-01"  # version 00, sampled
    return headers


def correlation_headers(run_id: str, episode_id: str = "", turn: Optional[int] = None,
                        arm: Optional[str] = None) -> dict[str, str]:
    """The W3C ``baggage`` header alone: run, and episode / turn / arm where given."""
    return dict(_baggage(*_texts(run_id, episode_id, turn, arm)))


def _texts(*values: object) -> tuple[Optional[str], ...]:
    """The baggage's values as it carries them (text), a key of :func:`_baggage`'s cache whatever their type."""
    return tuple(None if value is None else str(value) for value in values)


@functools.lru_cache(maxsize=1024)
def _baggage(run_id: Optional[str], episode_id: Optional[str], turn: Optional[str],
             arm: Optional[str]) -> tuple[tuple[str, str], ...]:
    context = None
    for key, value in ((sc.RUN_ID, run_id), (sc.EPISODE_ID, episode_id), (sc.TURN, turn), (sc.ARM, arm)):
        if value is not None and value != "":
            context = baggage.set_baggage(key, value, context)
    return tuple(_inject(W3CBaggagePropagator(), context).items())


def _inject(propagator, context) -> dict[str, str]:
    carrier: dict[str, str] = {}
    propagator.inject(carrier, context=context)
    return carrier
