"""What `kvtrace proxy` adds to a request and to each streamed token, against the direct path.

    python benchmarks/proxy_overhead.py [--requests 300] [--streams 40] [--tokens 64] [--model M.gguf]

Starts llama-server (the build `python -m kvtrace.outside.llama_server_build` caches) on the
tiny generated model and kvtrace's proxy in front of it, recording to a spool in a temporary
directory (the default exporter and capture), in this process; the client runs in a process of its
own and alternates direct and proxied calls in ABBA order, so drift on a shared machine hits both
alike. Every request recomputes its prompt (``cache_prompt: false``), so every call does the same
work. Side by side:

* **per request**: a non-streamed chat completion of one token (the server's own time is small,
  so the proxy's share shows): latency p50 / p99, direct and proxied, and the difference;
* **per streamed token**: streamed chat completions of --tokens tokens.
  - *time in the proxy*: from a chunk's arrival from the server to its last byte handed to the
    client's socket (cutting the added logprobs included), p50 / p99 — the delay the proxy adds
    to each token;
  - *gap between chunks* at the client, p50 / p99, direct, proxied and ``direct+top2`` (the client
    asks the server for the top two itself): the proxy asks the server for them, so the server's
    own cost of computing them is in the proxied gaps; the third column tells it apart;
* **proxy CPU**: this process's CPU time (every thread: relaying, recording, export) per proxied
  request and per streamed token, the per-request share included.

Prints a table; asserts nothing (the timings belong to this machine, not to the code).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from llama_server_process import running_llama_server  # noqa: E402  (the tests' launcher)

from kvtrace.outside import http1
from kvtrace.outside.proxy import proxy_in_thread
from kvtrace.testmodels.llama_gguf import make_model

CLIENT = r'''
import json, sys, time
import httpx

server, proxy, requests, streams, tokens = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
chat = {"messages": [{"role": "user", "content": "Describe the kitchen in detail"}], "temperature": 0,
        "cache_prompt": False}
short = {**chat, "max_tokens": 1}
streamed = {**chat, "max_tokens": tokens, "stream": True}
arms = {"direct": (server, streamed), "direct+top2": (server, {**streamed, "logprobs": True, "top_logprobs": 2}),
        "proxied": (proxy, streamed)}
resent = {}


def send(client, base, body, stream):
    for _ in range(3):  # llama-server closes a kept-alive connection now and then: send again
        try:
            if not stream:
                start = time.perf_counter()
                client.post(base + "/v1/chat/completions", json=body).raise_for_status()
                return time.perf_counter() - start
            arrivals = []
            with client.stream("POST", base + "/v1/chat/completions", json=body) as answer:
                answer.raise_for_status()
                for line in answer.iter_lines():
                    if line.startswith("data: "):
                        arrivals.append(time.perf_counter())
            return [b - a for a, b in zip(arrivals[1:], arrivals[2:])]
        except httpx.RemoteProtocolError:
            resent[base] = resent.get(base, 0) + 1
    raise SystemExit(base + " keeps closing connections")


latency = {"direct": [], "proxied": []}
gaps = {name: [] for name in arms}
with httpx.Client(timeout=300) as client:
    for base in (server, proxy):
        send(client, base, short, False)
    print("phase requests", flush=True); sys.stdin.readline()
    for i in range(requests):
        for name in (("direct", "proxied") if i % 4 in (0, 3) else ("proxied", "direct")):
            latency[name].append(send(client, server if name == "direct" else proxy, short, False))
    print("phase streams", flush=True); sys.stdin.readline()
    for i in range(streams):
        for name in (list(arms) if i % 2 == 0 else list(reversed(arms))):
            base, body = arms[name]
            gaps[name].extend(send(client, base, body, True))
print(json.dumps({"latency": latency, "gaps": gaps, "resent": resent}), flush=True)
'''


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=300, help="non-streamed requests per arm")
    parser.add_argument("--streams", type=int, default=40, help="streamed requests per arm")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per streamed request")
    parser.add_argument("--model", type=Path, default=None, help="GGUF model (default: the tiny generated one)")
    return parser.parse_args()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


class ChunkClock:
    """Time each streamed chunk spends in the proxy: from the server's chunk handed over by the
    upstream reader to the client's write returning, measured on the thread relaying it."""

    def __init__(self):
        self.delays: list[float] = []
        self._arrived = threading.local()
        chunks, send = http1.UpstreamResponse.chunks, http1.Responder.send
        clock = self

        def timed_chunks(response):
            for piece in chunks(response):
                clock._arrived.at = time.perf_counter()
                yield piece

        def timed_send(responder, data):
            send(responder, data)
            arrived = getattr(clock._arrived, "at", None)
            if arrived is not None:
                clock.delays.append(time.perf_counter() - arrived)
                clock._arrived.at = None

        http1.UpstreamResponse.chunks, http1.Responder.send = timed_chunks, timed_send


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory(prefix="kvtrace-proxy-bench-") as scratch:
        workdir = Path(scratch)
        os.environ.update(KVTRACE_SPOOL_DIR=str(workdir / "spool"), XDG_DATA_HOME=str(workdir / "data"),
                          KVTRACE_RUN_ID="proxy-benchmark")
        model = args.model
        if model is None:
            model = make_model(workdir / "tiny-F32.gguf", "F32", "tiny")
        clock = ChunkClock()
        with running_llama_server(model, log_path=workdir / "server.log") as server:
            with proxy_in_thread(server) as proxy:
                client = subprocess.Popen(
                    [sys.executable, "-c", CLIENT, server, proxy, str(args.requests), str(args.streams),
                     str(args.tokens)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                cpu = {}
                for phase in ("requests", "streams"):
                    assert client.stdout.readline().strip() == f"phase {phase}"
                    if phase == "streams":
                        cpu["requests"] = time.process_time() - started
                        clock.delays.clear()
                    started = time.process_time()
                    client.stdin.write("\n")
                    client.stdin.flush()
                results = json.loads(client.stdout.readline())
                cpu["streams"] = time.process_time() - started
                client.wait()
        report(args, results, cpu, clock.delays)


def report(args: argparse.Namespace, results: dict, cpu: dict, delays: list[float]) -> None:
    latency, gaps = results["latency"], results["gaps"]

    def row(label: str, values: list[float], unit: float, suffix: str) -> str:
        return (f"  {label:<26} p50 {percentile(values, 0.5) / unit:8.1f} {suffix}   "
                f"p99 {percentile(values, 0.99) / unit:8.1f} {suffix}   n={len(values)}")

    def difference(label: str, a: list[float], b: list[float], unit: float, suffix: str) -> str:
        return (f"  {label:<26} p50 {(percentile(a, .5) - percentile(b, .5)) / unit:8.1f} {suffix}   "
                f"p99 {(percentile(a, .99) - percentile(b, .99)) / unit:8.1f} {suffix}   "
                f"mean {(statistics.fmean(a) - statistics.fmean(b)) / unit:8.1f} {suffix}")

    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"per request (non-streamed chat, 1 token, {args.requests} per arm, ABBA):")
    for name in ("direct", "proxied"):
        print(row(name, latency[name], 1e-3, "ms"))
    print(difference("proxied - direct", latency["proxied"], latency["direct"], 1e-3, "ms"))
    print(f"  {'proxy CPU per request':<26} {cpu['requests'] / args.requests * 1e3:8.2f} ms (every thread)")
    print(f"per streamed token ({args.streams} streams of {args.tokens} tokens per arm):")
    print(row("time in the proxy", delays, 1e-6, "µs"))
    for name in gaps:
        print(row(f"gap between chunks, {name}", gaps[name], 1e-6, "µs"))
    print(difference("gaps proxied - direct+top2", gaps["proxied"], gaps["direct+top2"], 1e-6, "µs"))
    print(f"  {'proxy CPU per token':<26} {cpu['streams'] / (args.streams * args.tokens) * 1e6:8.1f} µs "
          f"(every thread, the per-request share included)")
    if results["resent"]:
        print(f"(requests sent again after the server closed a kept-alive connection: {results['resent']})")


if __name__ == "__main__":
    main()
