"""What `kvtrace proxy` adds to a request and to each streamed token, against the direct path.

    python benchmarks/proxy_overhead.py [--requests 300] [--streams 40] [--tokens 64] [--model M.gguf]
                                        [--llama-server-log] [--baseline-python PYTHON] [--floor]

Starts llama-server (the build `python -m kvtrace.llama_server.build` caches) on the
tiny generated model and kvtrace's proxy in front of it, recording to a spool in a temporary
directory (the default exporter and capture), in this process; the client runs in a process of its
own and alternates direct and proxied calls (the order rotated, and reversed every other cycle), so
drift on a shared machine hits every arm alike. Every request recomputes its prompt
(``cache_prompt: false``), so every call does the same work. The arms ``direct+top2`` ask the server
for the top two themselves, with the very fields the proxy adds (``margin_request.plan_request``
on the server's own ``/props``; with ``--llama-server-log`` also the marker field, at the server's
default value: no proxy's marker, the same inert setting). Side by side:

* **per request**: a non-streamed chat completion of one token (the server's own time is small,
  so the proxy's share shows), a prompt of its own per round of the arms (so the proxy's integrity
  calls are not answered from what it kept of a repeated prompt): latency p50 / p99, direct,
  direct+top2 and proxied, and the differences: proxied − direct+top2 is what the proxy itself adds,
  beyond the server's own cost of the top two;
* **per streamed token**: streamed chat completions of --tokens tokens.
  - *time in the proxy*: from a chunk's arrival from the server to its last byte handed to the
    client's socket (cutting the added logprobs included), p50 / p99 — the delay the proxy adds
    to each token;
  - *gap between chunks* at the client, p50 / p99, direct, proxied and ``direct+top2`` (the client
    asks the server for the top two itself): the proxy asks the server for them, so the server's
    own cost of computing them is in the proxied gaps; the third column tells it apart;
* **proxy CPU**: this process's CPU time (every thread: relaying, recording, export) per proxied
  request and per streamed token, the per-request share included. Per request twice: among the
  arms, and over a phase of proxied requests alone (the direct arms paused, so the proxy's log holds
  its own requests' lines only, as in front of a server only it calls).

With ``--llama-server-log`` llama-server writes its log at ``-lv 4`` and the proxy reads it
(``--llama-server-log``): each request's task matched by its marker, the kept state's integrity
checked (the server's ``/apply-template`` and ``/tokenize``), the cache decisions on the span, all
in the proxy's CPU per request.

With ``--baseline-python`` (the interpreter of an environment where another kvtrace is installed,
e.g. a venv with an older commit's tree installed in it: ``pip install --no-deps -e TREE``), a
change is measured against that kvtrace, paired: both proxies run as ``kvtrace proxy`` processes
of their own in front of the same server, the client alternates between them (and the direct
arms) stream by stream, and each process's CPU time (from /proc, every thread) is divided by the
tokens it relayed; the table ends with the ratio. Time in the proxy per chunk is then not shown
(it is measured inside this process only).

With ``--floor`` the same pairing puts the proxy beside ``proxy_throughput.py``'s bare relay in Python
(a thread per connection, httptools, an answer passed on read by read; it adds and cuts nothing, so
the server computes no top two for it): the least CPU a relay of this shape spends a streamed token
at one client on this machine, and proxied / floor.

Prints a table, and whether this run meets the proxy's targets at one client (p50 and p99 added beyond the
top two, CPU a request, CPU a streamed token); asserts nothing (the timings belong to this machine, not to
the code).
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
from typing import Callable, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from llama_server_process import running_llama_server  # noqa: E402  (the tests' launcher)
from targets import verdict  # noqa: E402  (benchmarks/, beside this script)

from kvtrace.http_client import get_json
from kvtrace.llama_server.tasks import MARKER_FIELD
from kvtrace.proxy import http1, upstream
from kvtrace.proxy.app import proxy_in_thread
from kvtrace.proxy.margin_request import CHAT, plan_request
from kvtrace.proxy.upstream_profile import profile_of_props
from kvtrace.testmodels.llama_gguf import make_model

CLIENT = r'''
import json, sys, time
import httpx

server, proxies, requests, streams, tokens = (sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]),
                                              int(sys.argv[4]), int(sys.argv[5]))
top_two = json.loads(sys.argv[6])  # the fields the proxy adds to ask for the top two
prompt = "Describe the kitchen in detail"
chat = {"messages": [{"role": "user", "content": prompt}], "temperature": 0, "cache_prompt": False}
short = {**chat, "max_tokens": 1}
streamed = {**chat, "max_tokens": tokens, "stream": True}
calls = {"direct": (server, short), "direct+top2": (server, {**short, **top_two}),
         **{name: (base, short) for name, base in proxies.items()}}
arms = {"direct": (server, streamed), "direct+top2": (server, {**streamed, **top_two}),
        **{name: (base, streamed) for name, base in proxies.items()}}
resent = {}


def in_turn(names, i):
    """Round i's order: rotated by i, reversed every other cycle, so each arm takes each place and
    follows each other arm alike."""
    names = list(names)
    order = names[i % len(names):] + names[:i % len(names)]
    return order[::-1] if (i // len(names)) % 2 else order


def own_prompt(body, i):
    """The body with round i's prompt: each round's is new to the proxy, the same for every arm."""
    return {**body, "messages": [{"role": "user", "content": f"{prompt}, room {i:06d}"}]}


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


latency = {name: [] for name in calls}
gaps = {name: [] for name in arms}
with httpx.Client(timeout=300) as client:
    for base, body in calls.values():
        send(client, base, body, False)
    print("phase requests", flush=True); sys.stdin.readline()
    for i in range(requests):
        for name in in_turn(calls, i):
            base, body = calls[name]
            latency[name].append(send(client, base, own_prompt(body, i), False))
    print("phase alone", flush=True); sys.stdin.readline()
    for i in range(requests):
        for name in in_turn(proxies, i):
            send(client, proxies[name], own_prompt(short, requests + i), False)
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
    parser.add_argument("--llama-server-log", action="store_true",
                        help="llama-server logs at -lv 4 and the proxy reads the log (task match, integrity calls)")
    parser.add_argument("--baseline-python", type=Path, default=None, metavar="PYTHON",
                        help="measure this tree's proxy against the kvtrace installed for PYTHON, paired")
    parser.add_argument("--floor", action="store_true",
                        help="measure the proxy against a bare relay in Python (proxy_throughput.py's), paired")
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
        chunks, send = upstream.UpstreamResponse.chunks, http1.Responder.send
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

        upstream.UpstreamResponse.chunks, http1.Responder.send = timed_chunks, timed_send


class ProxyProcess:
    """``kvtrace proxy`` run by ``python`` (this tree's or a baseline's) on a free port, or with ``floor`` the
    bare relay of proxy_throughput.py, and its CPU time."""

    def __init__(self, python: Path, server: str, log_path: Path, server_log: Optional[Path], floor: bool = False):
        self._log = open(log_path, "wb")
        reading = ["--llama-server-log", str(server_log)] if server_log is not None else []
        # Absolute: the proxy runs elsewhere, not in a source tree (`-m` would import from it).
        command = ([str(HERE / "proxy_throughput.py"), "--role", "floor", "--upstream", server] if floor else
                   ["-m", "kvtrace.cli", "proxy", "--upstream", server, "--listen", "127.0.0.1:0", *reading])
        self.process = subprocess.Popen([str(python.absolute()), *command], stdout=self._log,
                                        stderr=subprocess.STDOUT, cwd=log_path.parent)
        self.url = ""
        deadline = time.monotonic() + 120
        while not self.url:
            for line in log_path.read_text(errors="replace").splitlines():
                if line.startswith("kvtrace: proxy on "):
                    self.url = line.split()[3]
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"{python}: the proxy did not start:\n{log_path.read_text(errors='replace')}")
            time.sleep(0.1)

    def cpu_s(self) -> float:
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(30)
        self._log.close()


def top_two_fields(server: str, reads_log: bool) -> dict:
    """What the proxy adds to a chat request for the top two, as it plans it for this server; with the
    log read, its marker field too, at the server's default (inert while DRY is off, as the proxy's is)."""
    profile = profile_of_props(get_json(server + "/props"))
    if profile is None:
        raise SystemExit(f"{server} does not answer /props as llama-server does")
    asked = plan_request(CHAT, {}, profile).upstream_request or {}
    if reads_log and profile.default_dry_penalty_last_n is not None:
        asked[MARKER_FIELD] = profile.default_dry_penalty_last_n
    return asked


def run_client(server: str, proxies: dict[str, str], args: argparse.Namespace,
               cpu_now: Callable[[], dict[str, float]]) -> tuple[dict, dict[str, dict[str, float]]]:
    """The client process through its phases; each phase's CPU seconds per proxy (``cpu_now``)."""
    top_two = top_two_fields(server, args.llama_server_log)
    client = subprocess.Popen([sys.executable, "-c", CLIENT, server, json.dumps(proxies), str(args.requests),
                               str(args.streams), str(args.tokens), json.dumps(top_two)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    cpu: dict[str, dict[str, float]] = {}
    started: dict[str, float] = {}
    previous = None
    for phase in ("requests", "alone", "streams"):
        assert client.stdout.readline().strip() == f"phase {phase}"
        if previous is not None:
            cpu[previous] = {k: v - started[k] for k, v in cpu_now().items()}
        previous = phase
        started = cpu_now()
        client.stdin.write("\n")
        client.stdin.flush()
    results = json.loads(client.stdout.readline())
    cpu["streams"] = {k: v - started[k] for k, v in cpu_now().items()}
    client.wait()
    return results, cpu


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory(prefix="kvtrace-proxy-bench-") as scratch:
        workdir = Path(scratch)
        os.environ.update(KVTRACE_SPOOL_DIR=str(workdir / "spool"), XDG_DATA_HOME=str(workdir / "data"),
                          KVTRACE_RUN_ID="proxy-benchmark")
        model = args.model
        if model is None:
            model = make_model(workdir / "tiny-F32.gguf", "F32", "tiny")
        server_log = workdir / "server.log"
        reading = server_log if args.llama_server_log else None
        verbose = ("-lv", "4") if args.llama_server_log else ()
        with running_llama_server(model, *verbose, log_path=server_log) as server:
            if args.baseline_python is None and not args.floor:
                clock = ChunkClock()
                with proxy_in_thread(server, llama_server_log=reading) as proxy:
                    results, cpu = run_client(server, {"proxied": proxy}, args,
                                              lambda: {"proxied": time.process_time()})
                report(args, results, cpu, clock.delays)
                return
            proxies = {"proxied": ProxyProcess(Path(sys.executable), server, workdir / "proxied.log", reading)}
            if args.baseline_python is not None:
                proxies["baseline"] = ProxyProcess(args.baseline_python, server, workdir / "baseline.log", reading)
            if args.floor:
                proxies["floor"] = ProxyProcess(Path(sys.executable), server, workdir / "floor.log", None, floor=True)
            try:
                results, cpu = run_client(server, {k: p.url for k, p in proxies.items()}, args,
                                          lambda: {k: p.cpu_s() for k, p in proxies.items()})
            finally:
                for process in proxies.values():
                    process.stop()
            report(args, results, cpu, None)


def report(args: argparse.Namespace, results: dict, cpu: dict, delays: Optional[list[float]]) -> None:
    latency, gaps = results["latency"], results["gaps"]

    def row(label: str, values: list[float], unit: float, suffix: str) -> str:
        digits = 2 if suffix == "ms" else 1  # a target of 0.5 ms needs its hundredths
        return (f"  {label:<26} p50 {percentile(values, 0.5) / unit:8.{digits}f} {suffix}   "
                f"p99 {percentile(values, 0.99) / unit:8.{digits}f} {suffix}   n={len(values)}")

    def added(a: list[float], b: list[float], q: float) -> float:
        return percentile(a, q) - percentile(b, q)

    def difference(label: str, a: list[float], b: list[float], unit: float, suffix: str) -> str:
        digits = 2 if suffix == "ms" else 1
        return (f"  {label:<26} p50 {added(a, b, .5) / unit:8.{digits}f} {suffix}   "
                f"p99 {added(a, b, .99) / unit:8.{digits}f} {suffix}   "
                f"mean {(statistics.fmean(a) - statistics.fmean(b)) / unit:8.{digits}f} {suffix}")

    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    proxies = list(cpu["streams"])
    reading = "reading llama-server's log" if args.llama_server_log else "without llama-server's log"
    print(f"per request (non-streamed chat, 1 token, {args.requests} per arm, rotated; the proxy {reading}):")
    for name in latency:
        print(row(name, latency[name], 1e-3, "ms"))
    print(difference("direct+top2 - direct", latency["direct+top2"], latency["direct"], 1e-3, "ms"))
    for name in proxies:
        print(difference(f"{name} - direct", latency[name], latency["direct"], 1e-3, "ms"))
        print(difference(f"{name} - direct+top2", latency[name], latency["direct+top2"], 1e-3, "ms"))
        print(f"  {f'{name} CPU per request':<26} {cpu['requests'][name] / args.requests * 1e3:8.2f} ms (every thread)")
        print(f"  {f'{name} CPU per request':<26} {cpu['alone'][name] / args.requests * 1e3:8.2f} ms "
              f"(every thread, its requests alone)")
    print(f"per streamed token ({args.streams} streams of {args.tokens} tokens per arm):")
    if delays is not None:
        print(row("time in the proxy", delays, 1e-6, "µs"))
    for name in gaps:
        print(row(f"gap between chunks, {name}", gaps[name], 1e-6, "µs"))
    for name in proxies:
        print(difference(f"gaps {name} - direct+top2", gaps[name], gaps["direct+top2"], 1e-6, "µs"))
    per_token = {name: cpu["streams"][name] / (args.streams * args.tokens) for name in proxies}
    for name in proxies:
        print(f"  {f'{name} CPU per token':<26} {per_token[name] * 1e6:8.1f} µs "
              f"(every thread, the per-request share included)")
    for name in ("baseline", "floor"):
        if per_token.get(name, 0) > 0:
            print(f"  {f'CPU per token, proxied / {name}':<26} {per_token['proxied'] / per_token[name]:8.2f}")
    p50, p99 = (added(latency["proxied"], latency["direct+top2"], q) for q in (0.5, 0.99))
    print("targets (this run): " + "; ".join((
        verdict("p50 added beyond the top two", p50 * 1e3, 0.5, "ms"),
        verdict("p99 added", p99 * 1e3, 2, "ms"),
        verdict("CPU a request, its requests alone", cpu["alone"]["proxied"] / args.requests * 1e3, 1, "ms"),
        verdict("CPU a streamed token", per_token["proxied"] * 1e6, 30, "µs"))))
    if results["resent"]:
        print(f"(requests sent again after the server closed a kept-alive connection: {results['resent']})")


if __name__ == "__main__":
    main()
