"""How long the fork queries take on an experiment-sized database (not a test).

Generates two runs of 800 episodes x 8 turns x 100 generated tokens (12,800 request spans,
1.28 M token rows) through the real path — Recorder -> spool -> ingest into an embedded chDB —
with a cache-reuse run that forks from a cache-off run on about a third of the episodes (every request
with its batch composition, as a batching engine records it), then
times every saved query and prints, per query, the best and the median of the rounds, wall time
next to CPU time (chDB runs in this process, so the process's CPU time is the query's, summed
over its threads; on a shared machine it is steadier than wall time).

    python benchmarks/query_latency.py [--episodes 800] [--turns 8] [--tokens 100] [--repeat 5]
        [--db DIR] [--only forks,fork_attribution]

--db keeps the generated database in DIR and reuses it on the next run (same sizes), so that
queries can be timed again without recording and ingesting again.

--crowd N also builds, beside it, the database ``crowd<N>``: the same pair of runs and N more copies of
it under other run ids (made by the database from the pair's rows; N=9 gives ten times the rows), then
times the pair's queries there and alone in interleaved rounds and prints, per query, the ratio of the
medians (inside / alone), wall and CPU: what a query of two runs costs for the rest of the database.

    python benchmarks/query_latency.py --db DIR --crowd 9 [--only fork_attribution,divergence_rates]

--scale times the pair's run-scoped queries (forks, fork_attribution, divergence_rates of the pair) in
two such databases, the pair and 9 copies (12.8M token rows with the default sizes) and the pair and 99
copies (128M), in interleaved rounds, and prints per query both times and the ratio large / small (the
target: at most 1.2x); then divergence_rates over every run of the small one (the target: under 0.5 s).
The copies are made by the database (INSERT ... SELECT, a copy per statement); building the large one
takes minutes, so --build-only builds the databases into --db and stops, and a later run times them.

    python benchmarks/query_latency.py --db DIR --scale --build-only
    python benchmarks/query_latency.py --db DIR --scale --only forks --repeat 7
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import kvtrace
from kvtrace import queries
from kvtrace import semconv as sc
from kvtrace.collectors.ingest import ingest_paths
from kvtrace.collectors.schema import init_schema
from kvtrace.config import Settings
from kvtrace.db import connect
from kvtrace.recording.exporters.spool import SpoolExporter
from kvtrace.recording.recorder import Recorder
from kvtrace.recording.records import CacheEvent


def generate(spool: Path, episodes: int, turns: int, tokens: int, seed: int = 7) -> int:
    os.environ.update({"KVTRACE_CAPTURE": "ids", "KVTRACE_HASH_KEY": "kvtrace-benchmark-key",
                       "KVTRACE_SPOOL_DIR": str(spool)})
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
                # Batch composition as a batching engine records it: a step's rows and tokens per token.
                record.batch_composition = sc.BATCH_RECORDED
                record.step_rows = [rng.randrange(1, 33) for _ in out]
                record.step_tokens = [rows + rng.randrange(0, 64) for rows in record.step_rows]
                record.prefill_steps = [record.recomputed_tokens]
                recorder.finish(record)
                spans += 1
                history = history + out + observations[turn]
        if episode % 100 == 99:
            recorder.pipeline.force_flush()
    recorder.pipeline.force_flush()
    recorder.shutdown()
    return spans


@dataclass(frozen=True)
class Timing:
    wall: list[float]
    cpu: list[float]
    rows: int

    def line(self, name: str) -> str:
        return (f"{name:<26} wall best {_ms(min(self.wall))} median {_ms(statistics.median(self.wall))} ms   "
                f"cpu best {_ms(min(self.cpu))} median {_ms(statistics.median(self.cpu))} ms   ({self.rows} rows)")


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:6.0f}"


def timed(client, name: str, params: dict, rounds: int) -> Timing:
    wall, cpu, rows = [], [], 0
    for _ in range(rounds):
        start, start_cpu = time.perf_counter(), time.process_time()
        _, result = queries.run(client, name, params)
        cpu.append(time.process_time() - start_cpu)
        wall.append(time.perf_counter() - start)
        rows = len(result)
    return Timing(wall, cpu, rows)


PAIR = {"run_a": "bench-reuse", "run_b": "bench-off"}


def saved_queries() -> list[tuple[str, dict]]:
    """Every saved query with the parameters an analyst would pass on this data."""
    pair = PAIR
    return [
        ("runs", {}),
        ("forks", pair),
        ("fork_attribution", pair),
        ("episode_timeline", {**pair, "episode": "ep0000"}),
        ("divergence_rates", {"baseline_arm": "off"}),
        ("margin_shift", {}),
        ("flip_rate_by_margin", {}),
        ("near_tie_share", {}),
    ]


PAIR_PREFIX = "bench-"
"""The pair's run ids start with it; the crowd's copies start with ``other``."""
SCALES = (9, 99)
"""--scale's databases, by the copies of the pair beside it: 10x and 100x the pair's token rows."""


def crowd_database(copies: int) -> str:
    return f"crowd{copies}"


def pair_queries() -> list[tuple[str, dict]]:
    """The queries of the pair of runs alone: each selects the pair by run id, whatever else is stored."""
    return [("forks", PAIR), ("fork_attribution", PAIR),
            ("divergence_rates", {"run_prefix": PAIR_PREFIX, "baseline_arm": "off"})]


def crowd(client, copies: int) -> str:
    """Database ``crowd<copies>``: the pair's rows (of ``default``) and ``copies`` copies under other run ids,
    one copy per INSERT ... SELECT (a statement of every copy at once holds them all in memory)."""
    database = crowd_database(copies)
    init_schema(client, database=database)
    runs = client.query(f"SELECT uniqExact(run_id) FROM {database}.kvtrace_requests").result_rows[0][0]
    if runs != 2 * (copies + 1):
        if runs:
            raise SystemExit(f"database {database} holds another crowd; pass an empty or new --db directory")
        start = time.perf_counter()
        for copy in range(copies + 1):
            run_id = "run_id" if copy == 0 else f"concat('other{copy}/', run_id)"
            for table in ("kvtrace_requests", "kvtrace_cache_events"):  # kvtrace_tokens follows through its view
                client.command(f"INSERT INTO {database}.{table} "
                               f"SELECT * REPLACE ({run_id} AS run_id) FROM default.{table}")
        # as the pair's own database is: one part per partition, whatever the inserts left
        for table in ("kvtrace_requests", "kvtrace_cache_events"):
            client.command(f"OPTIMIZE TABLE {database}.{table} FINAL")
        print(f"{database}: made in {time.perf_counter() - start:.1f} s", flush=True)
    token_rows = client.query(f"SELECT count() FROM {database}.kvtrace_tokens").result_rows[0][0]
    print(f"{database}: the pair and {copies} copies, {token_rows:,} token rows", flush=True)
    return database


def compare_crowded(client, rounds: int, only: set[str], databases: list[str], target: str = "") -> None:
    """The pair's queries in each database, in interleaved rounds after one untimed round (the first
    reads the parts from disk); per query the ratio of the medians of each database to the first's (wall
    and CPU), ``target`` after each ratio."""
    timings: dict[tuple[str, str], list[Timing]] = {}
    chosen = [(name, params) for name, params in pair_queries() if not only or name in only]
    for round_ in range(rounds + 1):
        for name, params in chosen:
            for database in databases:
                client.database = database
                timing = timed(client, name, params, 1)
                if round_:
                    timings.setdefault((name, database), []).append(timing)
    client.database = "default"
    merged_timings = {key: merged(per_round) for key, per_round in timings.items()}
    for name, _ in chosen:
        first = merged_timings[(name, databases[0])]
        for database in databases:
            print(merged_timings[(name, database)].line(f"{name} {database}"))
        for database in databases[1:]:
            inside = merged_timings[(name, database)]
            print(f"{name:<26} {database} / {databases[0]}: "
                  f"wall {statistics.median(inside.wall) / statistics.median(first.wall):.2f}x"
                  f" (rounds {ratio_range(inside.wall, first.wall)})   "
                  f"cpu {statistics.median(inside.cpu) / statistics.median(first.cpu):.2f}x"
                  f" (rounds {ratio_range(inside.cpu, first.cpu)}){target}", flush=True)


def ratio_range(inside: list[float], first: list[float]) -> str:
    """The lowest and highest ratio of one round's time to the same round's time in the first database."""
    ratios = [a / b for a, b in zip(inside, first)]
    return f"{min(ratios):.2f}-{max(ratios):.2f}x"


def every_run(client, database: str, rounds: int) -> None:
    """divergence_rates over every run of ``database`` (each copy's arms against its baseline arm)."""
    client.database = database
    timed(client, "divergence_rates", {"baseline_arm": "off"}, 1)  # untimed: reads the parts from disk
    timing = timed(client, "divergence_rates", {"baseline_arm": "off"}, rounds)
    print(f"{timing.line(f'every run {database}')}   (target: median wall under 500 ms)", flush=True)
    client.database = "default"


def merged(rounds: list[Timing]) -> Timing:
    return Timing([w for t in rounds for w in t.wall], [c for t in rounds for c in t.cpu], rounds[-1].rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=800)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=5, help="rounds per query (at least 3)")
    parser.add_argument("--db", type=Path, help="keep the database here and reuse it when it exists")
    parser.add_argument("--only", default="", help="comma-separated saved queries to time (default: all)")
    parser.add_argument("--crowd", type=int, default=0, metavar="N",
                        help="also time the pair's queries inside a database holding N more copies of the pair")
    parser.add_argument("--scale", action="store_true",
                        help=f"time the pair's queries with {SCALES[0]} and with {SCALES[1]} copies beside it")
    parser.add_argument("--build-only", action="store_true", help="build the databases, time nothing")
    args = parser.parse_args(argv)
    if args.repeat < 3:
        parser.error("--repeat must be at least 3 (best and median of the rounds are reported)")

    root = args.db.resolve() if args.db else Path(tempfile.mkdtemp(prefix="kvtrace-bench-"))
    try:
        client = open_dataset(root, args.episodes, args.turns, args.tokens)
        only = {name for name in args.only.split(",") if name}
        crowds = [crowd(client, copies) for copies in ([args.crowd] if args.crowd else []) + list(
            SCALES if args.scale else ())]
        if args.build_only:
            client.close()
            return 0
        print(f"{args.repeat} rounds per query; {load()}")
        if args.scale:
            small, large = (crowd_database(copies) for copies in SCALES)
            compare_crowded(client, args.repeat, only, [small, large], target="   (target: at most 1.20x)")
            every_run(client, small, args.repeat)
        else:
            for name, params in saved_queries():
                if not only or name in only:
                    print(timed(client, name, params, args.repeat).line(name), flush=True)
            if crowds:
                compare_crowded(client, args.repeat, only, ["default", crowds[0]])
        print(f"after: {load()}")
        client.close()
    finally:
        if not args.db:
            shutil.rmtree(root, ignore_errors=True)
    return 0


def load() -> str:
    """The machine's load next to its CPU count: wall times stretch with it, CPU times much less."""
    one, five, _ = os.getloadavg()
    return f"load average {one:.1f} (1 min) / {five:.1f} (5 min) on {os.cpu_count()} CPUs"


def open_dataset(root: Path, episodes: int, turns: int, tokens: int):
    """The benchmark database in ``root``: reused when it already holds the data, else generated."""
    marker = root / "sizes"
    sizes = f"{episodes} {turns} {tokens}"
    reuse = marker.exists() and marker.read_text() == sizes
    if not reuse:
        if root.exists() and any(root.iterdir()) and not marker.exists():
            raise SystemExit(f"{root} is not empty and holds no benchmark database; pass an empty or new directory")
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        start = time.perf_counter()
        generate(root / "spool", episodes, turns, tokens)
        generated = time.perf_counter() - start
    client = connect(f"chdb://{root / 'db'}")
    init_schema(client)
    if not reuse:
        start = time.perf_counter()
        ingest_paths(client, [root / "spool"], quarantine_dir=root / "quarantine")
        client.command("OPTIMIZE TABLE kvtrace_requests FINAL")
        ingested = time.perf_counter() - start
        shutil.rmtree(root / "spool", ignore_errors=True)
        marker.write_text(sizes)
    spans = client.query("SELECT count() FROM kvtrace_requests").result_rows[0][0]
    token_rows = client.query("SELECT count() FROM kvtrace_tokens").result_rows[0][0]
    how = "reused" if reuse else f"recorded in {generated:.1f} s, ingested in {ingested:.1f} s"
    print(f"data: {spans:,} request spans, {token_rows:,} token rows ({how})")
    return client


if __name__ == "__main__":
    sys.exit(main())
