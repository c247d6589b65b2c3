"""Benchmark: recorder + spool CPU per generated token and per request, and ingest throughput.

Everything is measured side by side in one run on this machine, as CPU time (the machine is
shared: wall time is printed next to it, never instead of it):

* recorder: the engine thread's CPU in start_request / add_token / finish, and the exporter
  thread's CPU (the whole thread: batching, encoding, writing the spool), each request with
  fresh token draws; requests of 1 and of N tokens, recorded by one recorder in alternating
  blocks (ABBA, each block flushed before its clocks stop, so drift hits both alike), and a
  two-point fit splits the cost into per request and per token;
* ingest: ``kvtrace db ingest`` of a spool of >= 1M token rows into a fresh embedded chDB, until
  ``kvtrace_tokens`` (a view of ``kvtrace_requests`` read FINAL) answers a count (end to end: spool
  file → rows a query sees), process CPU (chDB runs in this process) next to wall time, the part of that CPU
  spent inside the database's inserts (``kvtrace_requests`` and ``otel_traces``' span rows) and the share
  outside them (ingest's own Python);
* the ceiling: the database's own ``INSERT INTO … SELECT … FROM numbers(N)`` of as many token rows, as
  request rows with their per-token arrays, into a table with ``kvtrace_requests``' columns and engine,
  counted the same way — what chDB itself stores on this machine, with no client in between.

Rounds alternate; best and median of each figure are printed. ``--recorder-only`` measures the
recorder alone (no spool is ingested), ``--ingest-only`` ingest and its ceiling alone; with
``--settings`` each record carries what llama.cpp's patches put in one (settings dicts, sampling numbers,
engine and model), without it only correlation, prompt and tokens. Every request has a prompt of its own;
with ``--turn-growth N`` each episode's prompt is its last one and N tokens more, turn after turn, so the
prompt's block hashes remembered from the turn before count.

Usage: python benchmarks/recorder_and_ingest.py [--requests 2000] [--tokens 100] [--rounds 3] [--settings]
                                               [--turn-growth N]
                                               [--ingest-requests 10000] [--ingest-only | --recorder-only]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Optional

from kvtrace import correlate
from kvtrace import semconv as sc
from kvtrace.collectors.ingest import ingest_paths
from kvtrace.collectors.schema import init_schema
from kvtrace.config import Settings
from kvtrace.db import connect
from kvtrace.recording.exporters.spool import SpoolExporter
from kvtrace.recording.recorder import Recorder


def _thread_cpu(thread) -> float:
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


NUMERICS = {"n_ctx": 4096, "n_batch": 512, "n_ubatch": 512, "n_threads": 8, "n_threads_batch": 8,
            "flash_attn": "auto", "type_k": "f16", "type_v": "f16", "logits_all": False, "offload_kqv": True,
            "n_gpu_layers": 0, "weight_repack": False, "cpu_amx": False,
            "system_info": "CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | OPENMP = 1 |"}
SAMPLING = {"temp": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "typical_p": 1.0, "repeat_penalty": 1.0,
            "frequency_penalty": 0.0, "presence_penalty": 0.0, "tfs_z": 1.0, "mirostat_mode": 0,
            "mirostat_tau": 5.0, "mirostat_eta": 0.1, "seed": 1234, "penalty_last_n": 64, "grammar": False,
            "logits_processor": False}


def _llama_cpp_settings(config: dict) -> None:
    """The settings patches/llama_cpp puts in every record: the model's (one numerics dict for all its
    requests), and each request's own dicts of the same values."""
    config.update({sc.ENGINE_VERSION: "0.3.16", sc.MODEL_FINGERPRINT: "0f3c9e1a2b4d5c6e7f8091a2b3c4d5e6",
                   sc.MODEL_WEIGHT_FORMAT: "F32", sc.KV_CACHE_TYPE: "f16", sc.NUMERICS_SETTINGS: NUMERICS})
    config[sc.CACHE_SETTINGS] = {"kv_reuse": True, "prompt_cache": None}
    config[sc.GEN_AI_REQUEST_MAX_TOKENS] = 64
    sampling = dict(SAMPLING)
    config[sc.SAMPLING_SETTINGS] = sampling
    config[sc.GEN_AI_REQUEST_TEMPERATURE] = float(sampling["temp"])
    config[sc.GEN_AI_REQUEST_TOP_P] = float(sampling["top_p"])
    config[sc.GEN_AI_REQUEST_TOP_K] = int(sampling["top_k"])
    config[sc.GEN_AI_REQUEST_SEED] = sampling["seed"]


PROMPT_TOKENS = 300
TURNS = 8


def _prompt(rng: random.Random, i: int, growth: int, conversations: dict[int, list[int]]) -> list[int]:
    """Request ``i``'s prompt (episode ``i // TURNS``, turn ``i % TURNS``): its own ``PROMPT_TOKENS``, or with
    ``growth`` the episode's last prompt and ``growth`` tokens more, as an agent's turns grow."""
    episode, turn = divmod(i, TURNS)
    new = [rng.randrange(32000) for _ in range(PROMPT_TOKENS if not growth or not turn else growth)]
    if not growth:
        return new
    prompt = conversations.pop(episode, []) + new if turn else new
    if turn < TURNS - 1:
        conversations[episode] = prompt
    return prompt


def _record_block(recorder: Recorder, requests: int, tokens: int, rng: random.Random, first: int,
                  settings: bool = False, growth: int = 0, conversations: Optional[dict] = None) -> float:
    """Record ``requests`` requests of ``tokens`` tokens; the engine thread's CPU seconds in kvtrace."""
    conversations = {} if conversations is None else conversations
    engine_cpu = 0.0
    for i in range(first, first + requests):
        # Fresh draws per request, made outside the timed part: the engine computed them, not kvtrace.
        prompt = _prompt(rng, i, growth, conversations)
        draws = [(rng.randrange(32000), rng.randrange(32000), rng.random() * 8, -rng.random() * 3)
                 for _ in range(tokens)]
        with correlate(run_id="bench", episode_id=f"ep{i // TURNS}", turn=i % TURNS):
            t = time.thread_time()
            rec = recorder.start_request("bench", model="m")
            rec.prompt_token_ids = prompt
            rec.prompt_tokens = len(prompt)
            if settings:
                _llama_cpp_settings(rec.config)
            add = rec.add_token
            for chosen, runner, margin, logprob in draws:
                add(chosen, chosen, runner, margin, logprob)
            recorder.finish(rec)
            engine_cpu += time.thread_time() - t
        if len(recorder.pipeline._queue) > 1000:
            recorder.pipeline.force_flush()
    return engine_cpu


def record_paired(requests: int, tokens: int, spool: Path, seed: int, block: int = 250,
                  settings: bool = False, growth: int = 0) -> dict[int, tuple[float, float]]:
    """Engine- and exporter-thread CPU seconds per request, for requests of 1 token and of ``tokens``
    tokens (``requests`` of each, rounded to whole blocks), recorded by one recorder in alternating
    blocks (ABBA), each block flushed before its clocks stop: {tokens: (engine CPU, exporter CPU)}."""
    recorder = Recorder(Settings.from_env(), exporter=SpoolExporter(spool))
    worker = recorder.pipeline._worker
    rng = random.Random(seed)
    totals = {1: [0.0, 0.0], tokens: [0.0, 0.0]}
    conversations: dict[int, dict] = {1: {}, tokens: {}}  # each arm's episodes go on from block to block
    blocks = max(1, requests // block)
    for b in range(blocks):
        for n in ((1, tokens) if b % 2 == 0 else (tokens, 1)):
            exporter_start = _thread_cpu(worker)
            totals[n][0] += _record_block(recorder, block, n, rng, first=b * block, settings=settings,
                                          growth=growth, conversations=conversations[n])
            recorder.pipeline.force_flush()
            totals[n][1] += _thread_cpu(worker) - exporter_start
    recorder.shutdown()
    return {n: (engine / (blocks * block), exporter / (blocks * block)) for n, (engine, exporter) in totals.items()}


def write_spool(requests: int, tokens: int, spool: Path, seed: int) -> None:
    recorder = Recorder(Settings.from_env(), exporter=SpoolExporter(spool))
    _record_block(recorder, requests, tokens, random.Random(seed), first=0)
    recorder.pipeline.force_flush()
    recorder.shutdown()


def ingest_round(spool: Path, db: Path) -> tuple[float, float, Counter, float, float, int, int]:
    """Wall and process-CPU seconds to ingest ``spool`` into a fresh chDB until kvtrace_tokens counts it, the
    CPU seconds of that inside the database's Arrow insert of each table (handing over its Arrow included),
    inside ingest's other database calls (which lines are stored, their hashes, the checkpoints), and of
    ingest's own Python: its thread's CPU outside every database call (chDB's threads left out)."""
    client = connect(f"chdb://{db}")
    init_schema(client)
    insert_cpu: Counter = Counter()
    other_calls: Counter = Counter()

    def timed(call, counter: Counter, by_table: bool):
        def timed_call(*args, **kwargs):
            start, thread_start = time.process_time(), time.thread_time()
            try:
                return call(*args, **kwargs)
            finally:
                counter[args[0] if by_table else "calls"] += time.process_time() - start
                counter["thread"] += time.thread_time() - thread_start  # not a table's name
        return timed_call

    client.insert_arrow = timed(client.insert_arrow, insert_cpu, by_table=True)
    client.insert = timed(client.insert, other_calls, by_table=False)
    client.query = timed(client.query, other_calls, by_table=False)
    wall, cpu, thread = time.perf_counter(), time.process_time(), time.thread_time()
    report = ingest_paths(client, [spool], quarantine_dir=db.parent / "quarantine")
    rows = client.query("SELECT count() FROM kvtrace_tokens").result_rows[0][0]  # a view: kvtrace_requests FINAL
    wall, cpu, thread = time.perf_counter() - wall, time.process_time() - cpu, time.thread_time() - thread
    client.close()
    python = thread - insert_cpu.pop("thread") - other_calls["thread"]
    return wall, cpu, insert_cpu, other_calls["calls"], python, rows, report.spans


CEILING_SQL = """
INSERT INTO requests_ceiling (Timestamp, TraceId, SpanId, run_id, episode_id, turn, request_id, engine, prompt_hash,
                              prompt_tokens, output_tokens, output_hash, token_ids, top1_ids, runner_up_ids, margins,
                              logprobs)
SELECT now64(9) + toIntervalMicrosecond(number) AS Timestamp,
    lower(hex(cityHash64(number, 1))) || lower(hex(cityHash64(number, 2))) AS TraceId, lower(hex(cityHash64(number))) AS SpanId,
    'bench' AS run_id, concat('ep', toString(intDiv(number, 8))) AS episode_id, toInt32(number % 8) AS turn,
    SpanId AS request_id, 'bench' AS engine, lower(hex(cityHash64(number, 3))) AS prompt_hash, toUInt32(300) AS prompt_tokens,
    toUInt32({tokens:UInt64}) AS output_tokens, lower(hex(cityHash64(number, 4))) AS output_hash,
    arrayMap(i -> toInt64(bitShiftRight(cityHash64(number, i), 1)), range({tokens:UInt64})) AS token_ids,
    arrayMap(i -> toInt64(bitShiftRight(cityHash64(number, i, 1), 1)), range({tokens:UInt64})) AS top1_ids,
    arrayMap(i -> toInt64(bitShiftRight(cityHash64(number, i, 2), 1)), range({tokens:UInt64})) AS runner_up_ids,
    arrayMap(i -> (cityHash64(number, i, 3) % 997) / 125., range({tokens:UInt64})) AS margins,
    arrayMap(i -> -(cityHash64(number, i, 4) % 991) / 330., range({tokens:UInt64})) AS logprobs
FROM numbers({requests:UInt64})
"""


def ceiling_round(rows: int, per_request: int, db: Path) -> tuple[float, float]:
    """Wall and CPU seconds for the database's own INSERT … SELECT of the same token rows into the same table:
    ``rows / per_request`` requests of ``per_request`` tokens each into a table like kvtrace_requests (its
    columns and engine; kvtrace_tokens is a view of it), until kvtrace_tokens' count answers (FINAL); with
    the insert settings ingest's typed inserts use (no fold at insert time), so the ratio compares like with like."""
    client = connect(f"chdb://{db}")
    init_schema(client)
    client.command("CREATE TABLE requests_ceiling AS kvtrace_requests")
    wall, cpu = time.perf_counter(), time.process_time()
    client.command(CEILING_SQL, parameters={"requests": rows // per_request, "tokens": per_request},
                   settings={"optimize_on_insert": 0})
    assert client.query("SELECT sum(length(token_ids)) FROM requests_ceiling FINAL").result_rows[0][0] == rows
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    client.close()
    return wall, cpu


def _best_median(values: list[float], higher_is_better: bool = False) -> str:
    best = max(values) if higher_is_better else min(values)
    return f"best {best:,.2f}  median {statistics.median(values):,.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ingest-requests", type=int, default=10000,
                        help="requests of --tokens tokens in the spool ingested (default: 1M token rows)")
    parser.add_argument("--turn-growth", type=int, default=0, metavar="N",
                        help=f"each episode's prompt grows by N tokens a turn ({TURNS} turns, the first "
                             f"{PROMPT_TOKENS} tokens), as an agent's do; default: every request a "
                             f"{PROMPT_TOKENS}-token prompt of its own")
    parser.add_argument("--settings", action="store_true",
                        help="each record carries the settings llama.cpp's patches record (three settings dicts, "
                             "sampling numbers, engine and model)")
    only = parser.add_mutually_exclusive_group()
    only.add_argument("--ingest-only", action="store_true",
                      help="skip the recorder measurement: only ingest and its chDB ceiling")
    only.add_argument("--recorder-only", action="store_true",
                      help="skip ingest and its chDB ceiling: only the recorder measurement")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvtrace-bench-"))
    os.environ.setdefault("KVTRACE_CAPTURE", "hashed")
    os.environ.setdefault("XDG_DATA_HOME", str(work / "data"))
    try:
        per_token, engine_per_token, exporter_per_token, per_request = [], [], [], []
        spans: dict[tuple[str, int], list[float]] = {}  # (thread, tokens) → its CPU per request, µs
        for i in range(0 if args.ingest_only else args.rounds):
            measured = record_paired(args.requests, args.tokens, work / f"spool-{i}", seed=i, settings=args.settings,
                                     growth=args.turn_growth)
            small, big = measured[1], measured[args.tokens]
            for n, (engine, exporter) in measured.items():
                spans.setdefault(("engine", n), []).append(engine * 1e6)
                spans.setdefault(("exporter", n), []).append(exporter * 1e6)
            engine_per_token.append((big[0] - small[0]) / (args.tokens - 1) * 1e6)
            exporter_per_token.append((big[1] - small[1]) / (args.tokens - 1) * 1e6)
            per_token.append(engine_per_token[-1] + exporter_per_token[-1])
            per_request.append(sum(small) * 1e6 - per_token[-1])
            shutil.rmtree(work / f"spool-{i}", ignore_errors=True)
        if not args.ingest_only:
            print(f"recorder + spool, capture={os.environ['KVTRACE_CAPTURE']}, settings={args.settings}, CPU time per thread, "
                  f"{args.rounds} rounds of {args.requests} requests:")
            print(f"  per generated token (both threads) us : {_best_median(per_token)}")
            print(f"    engine thread                     us : {_best_median(engine_per_token)}")
            print(f"    exporter thread                   us : {_best_median(exporter_per_token)}")
            prompts = (f"prompts of {PROMPT_TOKENS} + {args.turn_growth} a turn" if args.turn_growth else
                       f"{PROMPT_TOKENS}-token prompts")
            print(f"  per request ({prompts})    us : {_best_median(per_request)}")
            for (thread, n), values in sorted(spans.items()):
                print(f"  {thread} thread, a {n}-token request   us : {_best_median(values)}")
        if args.recorder_only:
            return

        spool = work / "spool-ingest"
        write_spool(args.ingest_requests, args.tokens, spool, seed=999)
        size = sum(f.stat().st_size for f in spool.glob("*.jsonl"))
        rates, cpu_rates, ceiling, ceiling_cpu, inserts_per_ceiling, outside_share = [], [], [], [], [], []
        python_share: list[float] = []
        tables_per_ceiling: dict[str, list[float]] = {}
        for i in range(args.rounds):
            wall, cpu, insert_cpu, database_calls, python, rows, spans = ingest_round(spool, work / f"db-{i}")
            rates.append(rows / wall)
            cpu_rates.append(rows / cpu)
            shutil.rmtree(work / f"db-{i}", ignore_errors=True)
            c_wall, c_cpu = ceiling_round(rows, args.tokens, work / f"ceiling-{i}")
            ceiling.append(rows / c_wall)
            ceiling_cpu.append(rows / c_cpu)
            inserts = sum(insert_cpu.values())
            inserts_per_ceiling.append(inserts / c_cpu)
            outside_share.append((cpu - inserts) / cpu)
            python_share.append(python / cpu)
            for table, seconds in insert_cpu.items():
                tables_per_ceiling.setdefault(table, []).append(seconds / c_cpu)
            shutil.rmtree(work / f"ceiling-{i}", ignore_errors=True)
            print(f"  round {i + 1}: ingest {wall:.2f} s wall / {cpu:.2f} s CPU, of which its Arrow inserts "
                  f"{inserts:.2f} s, its other database calls {database_calls:.2f} s, its own Python {python:.2f} s; "
                  f"ceiling {c_wall:.2f} s / {c_cpu:.2f} s CPU")
        print(f"ingest into chDB, spool → kvtrace_tokens queryable: {spans} spans, {rows:,} token rows, "
              f"{size / 1e6:.1f} MB of spool ({size / rows:.0f} bytes/token)")
        print(f"  token rows/s by wall time  : {_best_median(rates, higher_is_better=True)}")
        print(f"  token rows/s by CPU time   : {_best_median(cpu_rates, higher_is_better=True)}")
        print("chDB's own INSERT … SELECT FROM numbers() of the same rows into a table like kvtrace_requests:")
        print(f"  token rows/s by wall time  : {_best_median(ceiling, higher_is_better=True)}")
        print(f"  token rows/s by CPU time   : {_best_median(ceiling_cpu, higher_is_better=True)}")
        print(f"  ingest / ceiling (medians) : wall {statistics.median(rates) / statistics.median(ceiling):.2f}, "
              f"CPU {statistics.median(cpu_rates) / statistics.median(ceiling_cpu):.2f}")
        # A ratio of 0.5 gives ingest twice the ceiling's CPU for everything: its inserts alone show what is left.
        print(f"  ingest's inserts alone / ceiling, CPU: {_best_median(inserts_per_ceiling)} "
              "(at 0.5 ingest has 2.00 for everything)")
        for table, ratios in sorted(tables_per_ceiling.items()):
            print(f"    {table:<28}: {_best_median(ratios)}")
        # Outside the inserts: decoding, each span's attributes as text, the Arrow columns, the line hashes.
        print(f"  ingest's CPU outside its inserts, share of its CPU: {_best_median(outside_share)} (target 0.33)")
        print(f"    its own Python (its thread outside every database call): {_best_median(python_share)}")
        rate, share = statistics.median(cpu_rates), statistics.median(python_share)
        print(f"targets (medians): >= 1,000,000 token rows per CPU-second: {rate:,.0f}, "
              f"{'met' if rate >= 1e6 else 'not met'}; ingest's own Python <= 0.33 of its CPU: {share:.2f}, "
              f"{'met' if share <= 1 / 3 else 'not met'}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
