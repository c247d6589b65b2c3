"""What `kvtrace proxy` adds to a request and to each streamed token, against the direct path.

    python benchmarks/proxy_overhead.py [--requests 200] [--streams 40] [--tokens 64] [--model M.gguf]

Starts llama-server (the build `python -m kvtrace.outside.llama_server_build` caches) on the
tiny generated model, and `kvtrace proxy` in front of it as its own process, recording to a
spool in a temporary directory (the default exporter and capture). Then, alternating direct and
proxied calls in ABBA order so drift on a shared machine hits both alike:

* **per request**: a non-streamed chat completion of one token (the server's own time is small,
  so the proxy's share shows): latency p50 / p99, direct vs proxied, and the difference;
* **proxy CPU**: the proxy process's CPU time (all threads, recording and export included) over
  each phase, per proxied request and per streamed token: what the proxy costs however the
  machine schedules it (the latencies above also show how a busy machine schedules one more hop);
* **per streamed token**: streamed chat completions of --tokens tokens, the gap between one
  chunk's arrival at the client and the next: p50 / p99, direct vs proxied, and the difference.
  The proxy asks the server for the top two alternatives of every token (the client asked for
  none), so the server's own per-token cost of computing them is part of the proxied column.
  A third column, ``direct+top2``, asks the server for them directly, so that cost can be told
  apart from the proxy's.

All requests recompute their prompt (``cache_prompt: false``), so every call does the same work.
Prints a table; asserts nothing (the timings belong to this machine, not to the code).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from llama_server_process import free_port, running_llama_server  # noqa: E402  (the tests' launcher)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=200, help="non-streamed requests per arm")
    parser.add_argument("--streams", type=int, default=40, help="streamed requests per arm")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per streamed request")
    parser.add_argument("--model", type=Path, default=None, help="GGUF model (default: the tiny generated one)")
    return parser.parse_args()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


STALE: dict[str, int] = {}
"""Requests sent again, per base URL, because the server had closed the kept-alive connection."""


def one_request(client: httpx.Client, base: str, body: dict) -> float:
    for _ in range(3):
        start = time.perf_counter()
        try:
            answer = client.post(f"{base}/v1/chat/completions", json=body)
        except httpx.RemoteProtocolError:
            STALE[base] = STALE.get(base, 0) + 1
            continue
        elapsed = time.perf_counter() - start
        answer.raise_for_status()
        return elapsed
    raise SystemExit(f"{base} keeps closing connections")


def one_stream(client: httpx.Client, base: str, body: dict) -> list[float]:
    """Gaps between consecutive chunks' arrival (seconds), the first chunk excluded."""
    for _ in range(3):
        arrivals = []
        try:
            with client.stream("POST", f"{base}/v1/chat/completions", json=body) as answer:
                answer.raise_for_status()
                for line in answer.iter_lines():
                    if line.startswith("data: "):
                        arrivals.append(time.perf_counter())
        except httpx.RemoteProtocolError:
            STALE[base] = STALE.get(base, 0) + 1
            continue
        return [b - a for a, b in zip(arrivals[1:], arrivals[2:])]
    raise SystemExit(f"{base} keeps closing connections")


def cpu_ns(pid: int) -> int:
    """CPU time a process has used so far, all threads (Linux schedstat, nanoseconds)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            pass
    return total


def start_proxy(upstream: str, workdir: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "KVTRACE_SPOOL_DIR": str(workdir / "spool"), "XDG_DATA_HOME": str(workdir / "data")}
    process = subprocess.Popen([sys.executable, "-m", "kvtrace.cli", "proxy", "--upstream", upstream,
                                "--listen", f"127.0.0.1:{port}", "--run-id", "proxy-benchmark"],
                               env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            httpx.get(f"{base}/health", timeout=2)
            return process, base
        except httpx.HTTPError:
            if process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("kvtrace proxy did not start")
            time.sleep(0.1)


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory(prefix="kvtrace-proxy-bench-") as scratch:
        workdir = Path(scratch)
        model = args.model
        if model is None:
            from kvtrace.testmodels.llama_gguf import make_model

            model = make_model(workdir / "tiny-F32.gguf", "F32", "tiny")
        with running_llama_server(model, log_path=workdir / "server.log") as server:
            proxy_process, proxy = start_proxy(server, workdir)
            print(f"llama-server {server}, kvtrace proxy {proxy}")
            try:
                measure(args, server, proxy, proxy_process.pid)
            finally:
                proxy_process.terminate()
                proxy_process.wait(timeout=30)
            spooled = sum(1 for f in (workdir / "spool").glob("*.jsonl") for _ in open(f))
            print(f"\n(the proxy spooled {spooled} export batch line(s); requests sent again after a closed "
                  f"kept-alive connection: {STALE or 'none'})")


def measure(args: argparse.Namespace, server: str, proxy: str, proxy_pid: int) -> None:
    chat = {"messages": [{"role": "user", "content": "Describe the kitchen in detail"}], "temperature": 0,
            "cache_prompt": False}
    short = {**chat, "max_tokens": 1}
    streamed = {**chat, "max_tokens": args.tokens, "stream": True}
    top2 = {**streamed, "logprobs": True, "top_logprobs": 2}
    arms = {"direct": (server, streamed), "direct+top2": (server, top2), "proxied": (proxy, streamed)}
    latency: dict[str, list[float]] = {"direct": [], "proxied": []}
    gaps: dict[str, list[float]] = {name: [] for name in arms}
    with httpx.Client(timeout=300) as client:
        for base in (server, proxy):  # warm both paths (connections, the proxy's upstream detection)
            one_request(client, base, short)
        cpu_before = cpu_ns(proxy_pid)
        for i in range(args.requests):
            order = ("direct", "proxied") if i % 4 in (0, 3) else ("proxied", "direct")
            for name in order:
                latency[name].append(one_request(client, server if name == "direct" else proxy, short))
        cpu_requests = cpu_ns(proxy_pid) - cpu_before
        cpu_before = cpu_ns(proxy_pid)
        for i in range(args.streams):
            order = list(arms) if i % 2 == 0 else list(reversed(arms))
            for name in order:
                base, body = arms[name]
                gaps[name].extend(one_stream(client, base, body))
        cpu_streams = cpu_ns(proxy_pid) - cpu_before

    def row(label: str, values: list[float], unit: float, suffix: str) -> str:
        return (f"{label:<28} p50 {percentile(values, 0.5) / unit:9.1f} {suffix}   "
                f"p99 {percentile(values, 0.99) / unit:9.1f} {suffix}   n={len(values)}")

    print(f"per request (non-streamed chat, 1 token, {args.requests} per arm, ABBA):")
    for name in ("direct", "proxied"):
        print("  " + row(name, latency[name], 1e-3, "ms"))
    print(f"  {'proxied − direct':<28} p50 {(percentile(latency['proxied'], .5) - percentile(latency['direct'], .5)) * 1e3:9.2f} ms"
          f"   p99 {(percentile(latency['proxied'], .99) - percentile(latency['direct'], .99)) * 1e3:9.2f} ms")
    print(f"  {'proxy CPU per request':<28} {cpu_requests / args.requests / 1e3:9.1f} µs (all threads, recording included)")
    print(f"per streamed token (gap between chunks, {args.streams} streams of {args.tokens} tokens per arm):")
    for name in arms:
        print("  " + row(name, gaps[name], 1e-6, "µs"))
    for label, base_arm in (("proxied − direct", "direct"), ("proxied − direct+top2", "direct+top2")):
        print(f"  {label:<28} p50 {(percentile(gaps['proxied'], .5) - percentile(gaps[base_arm], .5)) * 1e6:9.1f} µs"
              f"   p99 {(percentile(gaps['proxied'], .99) - percentile(gaps[base_arm], .99)) * 1e6:9.1f} µs"
              f"   mean {(statistics.fmean(gaps['proxied']) - statistics.fmean(gaps[base_arm])) * 1e6:9.1f} µs")
    tokens = args.streams * args.tokens
    print(f"  {'proxy CPU per token':<28} {cpu_streams / tokens / 1e3:9.1f} µs (per request's share included: "
          f"{args.streams} streams of {args.tokens})")


if __name__ == "__main__":
    main()
