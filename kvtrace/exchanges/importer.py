"""Import recorded OpenAI-compatible request/response logs (JSON lines) as kvtrace runs.

One line per request::

    {"run_id": "agent-a",          # optional: else --run-id, else the file name's stem
     "episode_id": "task-17", "request_index": 3,    # request_index becomes the turn
     "arm": "reuse",               # optional
     "timestamp": 1718000000.25,   # optional: epoch s / ms / us / ns (told apart by size) or ISO 8601
     "request": {...},             # the body sent to /v1/chat/completions or /v1/completions
     "response": {...}}            # the non-streamed answer, with logprobs

The response must carry logprobs (``top_logprobs`` >= 2 for margins).  How
token ids, margins, prompt hashes and reused tokens are derived is described
in ``exchange.py``; reused tokens the server did not report are
recorded as 0 with source ``unknown`` (the request then counts as a
recompute).  A malformed line is reported with its line number and skipped;
every other line is imported.  Only the first ``PROBLEMS_KEPT`` reports are
kept (a file of garbage has a million); every rejected line is counted.
"""

from __future__ import annotations

import json
import struct
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable, Optional

from kvtrace import semconv as sc
from kvtrace.exchanges.exchange import ExchangeError, parse_exchange
from kvtrace.exchanges.recorder import OutsideRecorder
from kvtrace.timestamps import ImplausibleTime, check_unix_nanos, epoch_number_to_nanos

EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
PROBLEMS_KEPT = 50


@dataclass(frozen=True)
class ImportOptions:
    run_id: str = ""
    engine: str = "openai-compatible"
    weight_format: str = ""
    arm: str = ""


@dataclass
class ImportReport:
    imported: int = 0
    runs: Counter = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    """``FILE:LINE: what is wrong`` for the first ``PROBLEMS_KEPT`` rejected lines."""
    rejected: int = 0
    """Every rejected line (and file that could not be opened)."""

    def reject(self, problem: str) -> None:
        self.rejected += 1
        if len(self.problems) < PROBLEMS_KEPT:
            self.problems.append(problem)


class LineError(ValueError):
    pass


def import_files(paths: Iterable[Path], options: ImportOptions,
                 recorder: Optional[OutsideRecorder] = None) -> ImportReport:
    own = recorder is None
    recorder = recorder or OutsideRecorder()
    report = ImportReport()
    # Lines without a timestamp keep their file order: the queries take the earliest request per turn.
    clock = time.time_ns()
    try:
        for path in paths:
            try:
                handle = open(path, encoding="utf-8", errors="surrogateescape")
            except OSError as exc:
                report.reject(f"{path}: {exc.strerror or exc}")
                continue
            with handle:
                for number, line in enumerate(handle, 1):
                    if not line.strip():
                        continue
                    clock += 1000
                    try:
                        run_id = import_line(recorder, line, path, number, options, clock)
                    except LineError as exc:
                        report.reject(f"{path}:{number}: {exc}")
                        continue
                    report.imported += 1
                    report.runs[run_id] += 1
    finally:
        if own:
            recorder.close()
    return report


def import_line(recorder: OutsideRecorder, line: str, path: Path, number: int, options: ImportOptions,
                default_start_ns: int) -> str:
    try:
        entry = json.loads(line)
    except ValueError as exc:
        raise LineError(f"not JSON ({exc})") from None
    if not isinstance(entry, dict):
        raise LineError("expected a JSON object per line")
    episode = entry.get("episode_id")
    index = entry.get("request_index")
    if episode is None or str(episode) == "":
        raise LineError("missing episode_id")
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index <= sc.TURN_MAX:
        raise LineError(f"request_index must be a whole number from 0 to {sc.TURN_MAX}, got {index!r:.40}")
    for key in ("request", "response"):
        if not isinstance(entry.get(key), dict):
            raise LineError(f"missing `{key}` object")
    try:
        exchange = parse_exchange(entry["request"], entry["response"], recorder.hasher, recorder.hash_prompt_ids)
    except ExchangeError as exc:
        raise LineError(str(exc)) from None
    except (TypeError, ValueError, AttributeError, KeyError, OverflowError, struct.error, RecursionError) as exc:
        # A shape parse_exchange's checks did not foresee: still this line's fault, never the file's.
        raise LineError(f"unexpected shape: {type(exc).__name__}: {exc}") from None
    start_ns = _start_ns(entry.get("timestamp"), default_start_ns)
    run_id = str(entry.get("run_id") or options.run_id or Path(path).stem)
    reused = exchange.cached_tokens if exchange.cached_tokens is not None else 0
    engine = str(entry.get("engine") or options.engine)
    layer = sc.LAYER_PREFIX_BLOCKS if engine == "vllm" else sc.LAYER_KV_REUSE
    config = {sc.MODEL_WEIGHT_FORMAT: options.weight_format or None, sc.IMPORT_SOURCE: f"{Path(path).name}:{number}"}
    recorder.record(exchange, engine=engine, run_id=run_id, episode_id=str(episode), turn=index,
                    arm=str(entry.get("arm") or options.arm), reused_tokens=reused,
                    reused_source=exchange.cached_tokens_source, cache_layer=layer, start_ns=start_ns,
                    end_ns=start_ns, config=config)
    return run_id


def _start_ns(raw: Any, default: int) -> int:
    """Epoch seconds, milliseconds, microseconds or nanoseconds (told apart by size), or ISO 8601."""
    if raw is None:
        return default
    try:
        if isinstance(raw, (int, float)) and not isinstance(raw, bool):
            return epoch_number_to_nanos(raw, "timestamp")
        if isinstance(raw, str):
            try:
                moment = datetime.fromisoformat(raw.replace("Z", "+00:00"))
            except ValueError:
                pass
            else:
                if moment.tzinfo is None:
                    moment = moment.astimezone()  # a time without a zone is this machine's local time
                delta = moment - EPOCH
                return check_unix_nanos((delta.days * 86400 + delta.seconds) * 10**9 + delta.microseconds * 1000,
                                        "timestamp")
    except ImplausibleTime as exc:
        raise LineError(str(exc)) from None
    raise LineError(f"timestamp {raw!r:.60} is neither epoch seconds (ms, us, ns) nor ISO 8601")
