"""How long the fork queries take on an experiment-sized database (not a test).

Generates two runs of 800 episodes x 8 turns x 100 generated tokens (12,800 request spans,
1.28 M token rows) through the real path — Recorder -> spool -> ingest into an embedded chDB —
with a cache-reuse run that forks from a cache-off run on about a third of the episodes, then
times the saved queries ``forks`` and ``fork_attribution`` (and the rate queries) and prints
the figures.

    python benchmarks/query_latency.py [--episodes 800] [--turns 8] [--tokens 100] [--repeat 5]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path


def generate(spool: Path, episodes: int, turns: int, tokens: int, seed: int = 7) -> int:
    os.environ.update({"KVTRACE_CAPTURE": "ids", "KVTRACE_HASH_KEY": "benchmark", "KVTRACE_SPOOL_DIR": str(spool)})
    import kvtrace
    from kvtrace import semconv as sc
    from kvtrace.config import Settings
    from kvtrace.recording.recorder import Recorder
    from kvtrace.recording.records import CacheEvent
    from kvtrace.recording.exporters.spool import SpoolExporter

    recorder = Recorder(Settings.from_env(), exporter=SpoolExporter(spool))
    rng = random.Random(seed)
    spans = 0
    for episode in range(episodes):
        fork_turn = rng.randrange(turns) if rng.random() < 0.35 else None
        fork_at = rng.randrange(tokens)
        base = [rng.randrange(32000) for _ in range(turns * tokens)]
        margins = [rng.expovariate(1.5) for _ in range(turns * tokens)]
        prompt = [rng.randrange(32000) for _ in range(200)]
        observations = [[rng.randrange(32000) for _ in range(8)] for _ in range(turns)]
        for arm in ("reuse", "off"):
            history = list(prompt)
            forked = False
            for turn in range(turns):
                with kvtrace.correlate(run_id=f"bench-{arm}", episode_id=f"ep{episode:04d}", turn=turn):
                    record = recorder.start_request("llama.cpp", model="bench")
                record.config = {sc.ARM: arm, sc.MODEL_WEIGHT_FORMAT: "Q4_K_M"}
                record.prompt_token_ids = history
                record.prompt_tokens = len(history)
                if arm == "reuse" and turn > 0:
                    reused = len(history) - 8
                    record.cache_layer, record.reused_tokens = sc.LAYER_KV_REUSE, reused
                    record.events.append(CacheEvent(sc.EVENT_CACHE_REUSE, sc.LAYER_KV_REUSE, tokens=reused))
                record.recomputed_tokens = len(history) - record.reused_tokens
                out = base[turn * tokens:(turn + 1) * tokens]
                if arm == "reuse" and (turn == fork_turn or forked):
                    out = out[:fork_at] + [t + 1 for t in out[fork_at:]] if turn == fork_turn else [t + 2 for t in out]
                    forked = True
                for i, token in enumerate(out):
                    record.add_token(token, token, token + 1, margins[turn * tokens + i], -0.5)
                recorder.finish(record)
                spans += 1
                history = history + out + observations[turn]
        if episode % 100 == 99:
            recorder.pipeline.force_flush()
    recorder.pipeline.force_flush()
    recorder.shutdown()
    return spans


def timed(client, name: str, params: dict, repeat: int) -> tuple[float, float, int]:
    from kvtrace import queries

    times, rows = [], 0
    for _ in range(repeat):
        start = time.perf_counter()
        _, result = queries.run(client, name, params)
        times.append(time.perf_counter() - start)
        rows = len(result)
    return statistics.median(times), max(times), rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=800)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)

    root = Path(tempfile.mkdtemp(prefix="kvtrace-bench-"))
    start = time.perf_counter()
    spans = generate(root / "spool", args.episodes, args.turns, args.tokens)
    generated = time.perf_counter() - start

    from kvtrace.collectors.ingest import ingest_paths
    from kvtrace.collectors.schema import init_schema
    from kvtrace.db import connect

    client = connect(f"chdb://{root / 'db'}")
    init_schema(client)
    start = time.perf_counter()
    ingest_paths(client, [root / "spool"], quarantine_dir=root / "quarantine")
    client.command("OPTIMIZE TABLE kvtrace_requests FINAL")
    ingested = time.perf_counter() - start
    tokens = client.query("SELECT count() FROM kvtrace_tokens").result_rows[0][0]
    print(f"data: {spans:,} request spans, {tokens:,} token rows "
          f"(recorded in {generated:.1f} s, ingested in {ingested:.1f} s)")
    pair = {"run_a": "bench-reuse", "run_b": "bench-off"}
    for name, params in (("forks", pair), ("fork_attribution", pair), ("divergence_rates", {"baseline_arm": "off"}),
                         ("margin_shift", {}), ("flip_rate_by_margin", {})):
        median, worst, rows = timed(client, name, params, args.repeat)
        print(f"{name:<20} median {median * 1000:7.0f} ms   max {worst * 1000:7.0f} ms   ({rows} rows)")
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
