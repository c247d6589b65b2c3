"""``kvtrace selfcheck``: record → spool → ingest → query, end to end, on the configured database.

Records a handful of synthetic requests (no engine needed) under a fresh run
id through the real recorder and spool, ingests them, reads them back from
the typed tables and checks that every token and margin survived bit-exact.

It also says whether vLLM processes started from this environment would record (kvtrace's plugin
records only processes opted in), and warns when this machine is one where llama.cpp's AMX weight
repack can crash quantized models (the exit code does not change: kvtrace's own commands load with
the repack off).
"""

from __future__ import annotations

import os
import random
import sys
import tempfile
import time
from pathlib import Path

from kvtrace import correlate, semconv
from kvtrace.collectors.ingest import ingest_paths
from kvtrace.commands.arguments import count
from kvtrace.commands.common import open_database
from kvtrace.config import Settings, recording_opted_in
from kvtrace.patches.llama_cpp.repack import amx_hint
from kvtrace.preflight import check_settings
from kvtrace.recording.exporters.spool import SpoolExporter
from kvtrace.recording.recorder import Recorder
from kvtrace.recording.records import CacheEvent


def add_arguments(p) -> None:
    p.add_argument("--requests", type=count, default=20, help="synthetic requests to record (default 20)")
    p.set_defaults(func=run)


def run(args) -> int:
    check_settings()  # the configuration an engine would record with, before this check overrides capture
    opted_in = recording_opted_in()  # before this check's own recorder is made
    run_id = f"selfcheck-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
    rng = random.Random(0)
    with tempfile.TemporaryDirectory(prefix="kvtrace-selfcheck-") as spool:
        os.environ["KVTRACE_CAPTURE"] = semconv.CAPTURE_IDS
        settings = Settings.from_env()
        recorder = Recorder(settings, exporter=SpoolExporter(Path(spool)), service_name="kvtrace-selfcheck")
        expected = {}
        for i in range(args.requests):
            with correlate(run_id=run_id, episode_id=f"ep{i // 4}", turn=i % 4):
                rec = recorder.start_request("selfcheck", model="synthetic")
            rec.prompt_token_ids = [rng.randrange(32000) for _ in range(48 + 8 * (i % 4))]
            rec.prompt_tokens = len(rec.prompt_token_ids)
            reused = 32 if i % 4 else 0
            rec.reused_tokens, rec.recomputed_tokens = reused, rec.prompt_tokens - reused
            rec.cache_layer = semconv.LAYER_KV_REUSE if reused else semconv.LAYER_NONE
            if reused:
                rec.events.append(CacheEvent(semconv.EVENT_CACHE_REUSE, semconv.LAYER_KV_REUSE, tokens=reused))
            for _ in range(32):
                top1 = rng.randrange(32000)
                rec.add_token(top1, top1, rng.randrange(32000), rng.expovariate(1.5), -rng.random())
            expected[rec.span_id] = (list(rec.output_token_ids), list(rec.margins))
            recorder.finish(rec)
        recorder.shutdown()
        client = open_database(args, ingest=False)
        report = ingest_paths(client, [Path(spool)])
    rows = client.query(
        "SELECT SpanId, token_ids, margins FROM kvtrace_requests FINAL WHERE run_id = {run:String}",
        parameters={"run": run_id},
    ).result_rows
    got = {span: (list(tokens), list(margins)) for span, tokens, margins in rows}
    tokens = client.query("SELECT count() FROM kvtrace_tokens WHERE run_id = {run:String}",
                          parameters={"run": run_id}).result_rows[0][0]
    events = client.query("SELECT count() FROM kvtrace_cache_events FINAL WHERE run_id = {run:String}",
                          parameters={"run": run_id}).result_rows[0][0]
    ok = got == expected and tokens == 32 * args.requests
    print(f"run {run_id}: {report.spans} spans ingested, {len(got)} requests, {tokens} token rows, "
          f"{events} cache events read back")
    print(vllm_recording(opted_in))
    warn_about_amx()
    if ok:
        print("selfcheck passed: tokens and margins are bit-exact after record → spool → ClickHouse")
        return 0
    print("selfcheck FAILED: what was read back differs from what was recorded", file=sys.stderr)
    return 1


def vllm_recording(opted_in: bool) -> str:
    now = ("this environment is opted in (KVTRACE_ENABLED=1)" if opted_in
           else "this environment is not: installing kvtrace alone records nothing")
    return (f"vLLM: kvtrace's plugin records only processes started by `kvtrace run` or with KVTRACE_ENABLED=1 "
            f"(their workers inherit it); {now}")


def warn_about_amx() -> None:
    hint = amx_hint()
    if hint:
        print(f"kvtrace: warning: {hint} (docs/tracing.md: 'Intel AMX machines')", file=sys.stderr)
