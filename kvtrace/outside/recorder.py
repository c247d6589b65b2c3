"""A recorder for requests kvtrace observes from outside an engine (probe, import).

Those commands are not engine processes: they make their own recorder from the
environment (exporter, capture policy, hash key), tag every record explicitly,
and flush before they exit.  The process-wide recorder is left alone.
"""

from __future__ import annotations

from typing import Optional

import kvtrace
from kvtrace.config import Settings
from kvtrace.errors import ConfigError
from kvtrace.outside.openai_exchange import Exchange, TextHasher, fill_record
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

    def record(self, exchange: Exchange, *, engine: str, run_id: str, episode_id: str, turn: int, arm: str,
               reused_tokens: int, reused_source: str, cache_layer: str, start_ns: int, end_ns: int,
               config: Optional[dict] = None) -> RequestRecord:
        with kvtrace.correlate(run_id=run_id, episode_id=episode_id, turn=turn, arm=arm or None):
            record = self.recorder.start_request(engine, exchange.operation, exchange.model)
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
        counters = dict(self.recorder.pipeline.counters)
        self.recorder.shutdown()
        return counters
