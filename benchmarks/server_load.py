"""What kvtrace costs a server under concurrent load: throughput, latency, CPU, spans kept, RSS over a soak.

    .venv/bin/python -P benchmarks/server_load.py [--servers vllm,llama-cpp,llama-server]
        [--concurrency 1,8,32] [--requests 96] [--tokens 16] [--size tiny|small|base] [--minutes 0]
        [--vllm-python .venv-vllm/bin/python] [--shadow RATE] [--cache-ram MIB] [--proxy-workers N]

Three servers, each on a model kvtrace generates (nothing is downloaded), each as a traced and an
untraced arm that the client alternates block by block, ABBA (a block is twice the concurrency's
requests, sent through that many client threads), so drift on a shared machine hits both alike:

* ``vllm``: vLLM's OpenAI server (the module ``vllm serve`` runs) under ``kvtrace run`` with
  ``KVTRACE_ENABLED=1`` (the plugin), against a second one with ``KVTRACE_DISABLED=1``; both stay
  up side by side (on a machine with few cores the idle one's threads take CPU from the busy one,
  so read its ratios over many blocks);
* ``llama-cpp``: ``kvtrace run -- python -m llama_cpp.server`` against the same server with
  ``KVTRACE_DISABLED=1``;
* ``llama-server``: llama.cpp's server (``-np 4``, the build
  ``python -m kvtrace.llama_server.build`` caches) behind ``kvtrace proxy`` (``--workers N`` with
  ``--proxy-workers N``; how each request span was tied to its server task is tallied), against the
  same llama-server called directly. A third arm, the same server called directly with the top two
  the proxy asks for (``n_probs``), gives the server's own share of the proxy's cost: its ratios
  to the plain direct server are printed under each cell, as a floor no proxy can go below.

For each concurrency, non-streamed and streamed ``/v1/completions`` (a shared 120-word prefix, a
distinct tail and W3C baggage per request), it prints traced/untraced ratios of throughput
(requests per second of wall time), of p50 and p99 latency, and of CPU time per request (every
process of the arm, from /proc: the server and what it started, and the proxy; the proxy's own
beside it, user and system apart), wall time beside it; and the request spans in the traced arm's
spool against the requests it completed (lost = completed - spans, after the spool has had time to
catch up).  RSS of the traced server and of the
proxy is sampled before and after the load and, with ``--minutes M``, over an M-minute soak of
traced load at the highest concurrency, with its growth in %, and the soak's spans are counted
against its requests.

With ``--shadow RATE`` it measures what shadow twins cost clients instead: vLLM's server and
llama-server, untraced, each behind two ``kvtrace proxy`` processes, one plain and one with
``--shadow RATE``, alternated the same way; the ratios are shadowed/plain, and the twins the
shadowed proxy sent are counted beside its client spans. After each block the client waits a
second (inside the block's CPU window, outside its latencies) so that a block's trailing twins are
charged to it, not to the next block of the other arm.

Beside the pooled p50 ratio it prints the median of the ratios of adjacent block pairs with a 95 %
bootstrap interval over the pairs (the independent samples), which says whether a 2 % effect is resolved.
Prints a table; asserts nothing (the timings belong to the machine they were taken on).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import itertools
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterator, Optional

import httpx

from kvtrace.proxy.margin_request import COMPLETIONS, UpstreamProfile, plan_request
from kvtrace.recording.stats import SHADOW_TWINS_DROPPED, read_stats
from kvtrace.semconv import ARM, ARM_SHADOW, SERVER_TASK_MATCH, SPAN_REQUEST
from kvtrace.testmodels.llama_gguf import SIZES as GGUF_SIZES, make_model as make_gguf_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from arguments import positive_integers  # noqa: E402  (what the benchmark scripts share)

SERVERS = ("vllm", "llama-cpp", "llama-server")
MODEL_NAME = "tiny"
PREFIX = " ".join(["the agent opens the configuration file and reads each of its lines"] * 11)[:700]
STARTUP_S = 300
SPANS_WAIT_S = 30
TARGET_P50_PCT = 2.0
SHADOW_SERVERS = ("vllm", "llama-server")
SHADOW_TARGET_CONCURRENCY = 8
SETTLE_S = 1.0
TARGET_RSS_PCT = 5.0
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


def server_list(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    unknown = [n for n in names if n not in SERVERS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"servers are {', '.join(SERVERS)}; got {text!r}")
    return names


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", type=server_list, default=list(SERVERS), help=",".join(SERVERS))
    parser.add_argument("--concurrency", type=positive_integers, default=[1, 8, 32])
    parser.add_argument("--requests", type=int, default=96, help="requests per arm, concurrency and streaming mode")
    parser.add_argument("--tokens", type=int, default=16, help="max_tokens per request")
    parser.add_argument("--size", choices=tuple(GGUF_SIZES), default="tiny",
                        help="the generated GGUF model of the llama.cpp servers: tiny (~1M parameters: the server's "
                             "own work is a few ms, so fixed costs show at their largest), small (~20M) or base "
                             "(~100M, a few hundred ms per request: closer to what a served model costs)")
    parser.add_argument("--minutes", type=float, default=0.0, help="soak of traced load for RSS growth (0: none)")
    parser.add_argument("--vllm-python", type=Path, default=Path(sys.executable),
                        help="the interpreter of the environment with vLLM (default: this one)")
    parser.add_argument("--llama-python", type=Path, default=Path(sys.executable),
                        help="the interpreter of the environment with llama-cpp-python[server] (default: this one)")
    parser.add_argument("--cache-ram", type=int, default=None, metavar="MIB",
                        help="llama-server's --cache-ram (default: its own, 8192 MiB). The proxy mirrors that "
                             "cache's listing, so a soak reads the proxy's own growth once the cache is full: "
                             "64 MiB holds about 200 of the tiny model's states, as many as 8 GiB holds of a "
                             "7B model's")
    parser.add_argument("--proxy-workers", type=int, default=1, metavar="N",
                        help="llama-server's traced arm: `kvtrace proxy --workers N` (default 1)")
    parser.add_argument("--shadow", type=float, default=None, metavar="RATE",
                        help=f"compare a proxy with --shadow RATE against a plain one ({', '.join(SHADOW_SERVERS)})")
    args = parser.parse_args()
    if args.requests < 1 or args.tokens < 1 or args.minutes < 0 or args.proxy_workers < 1:
        parser.error("--requests, --tokens and --proxy-workers must be at least 1, --minutes at least 0")
    if args.shadow is not None:
        if not 0 < args.shadow <= 1:
            parser.error("--shadow is a share: above 0 and at most 1")
        if set(args.servers) - set(SHADOW_SERVERS):
            args.servers = [name for name in args.servers if name in SHADOW_SERVERS]
            print(f"--shadow: only {', '.join(SHADOW_SERVERS)} have a cache bypass; measuring {', '.join(args.servers)}")
    return args


# ----------------------------------------------------------------------------------------- processes

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_tree(pid: int) -> list[int]:
    """``pid`` and every process below it (vLLM's API server starts its engine core)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parent = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry))
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        todo.extend(children.get(current, []))
    return tree


def cpu_times(pids: list[int]) -> tuple[float, float]:
    """User and system CPU of these processes and everything below them, from /proc."""
    user = system = 0
    for root in pids:
        for pid in process_tree(root):
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            user, system = user + int(fields[11]), system + int(fields[12])  # utime, stime
    return user / CLOCK_TICKS, system / CLOCK_TICKS


def rss_mb(pid: int) -> float:
    """Resident memory of ``pid`` and the processes below it, in MB."""
    total = 0
    for each in process_tree(pid):
        try:
            total += int(Path(f"/proc/{each}/statm").read_text().split()[1]) * PAGE
        except OSError:
            continue
    return total / 1e6


@contextlib.contextmanager
def started(name: str, argv: list[str], env: dict, log: Path, health: str) -> Iterator[subprocess.Popen]:
    """A process started in its own session; waits for ``health`` to answer 200, stops its whole group after."""
    with open(log, "wb") as out:
        process = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + STARTUP_S
        while True:
            try:
                if httpx.get(health, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                tail = log.read_text(errors="replace").strip().splitlines()[-5:]
                raise SystemExit(f"{name} did not start; the end of {log}:\n" + "\n".join(tail))
            time.sleep(0.5)
        yield process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)  # graceful: the recorder flushes at exit
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(OSError):
            os.killpg(process.pid, signal.SIGKILL)  # an engine core it started, too
        if process.poll() is None:
            process.wait(timeout=30)


@dataclass
class Arm:
    """One side of a comparison: where requests go, the processes whose CPU counts, the spool its spans land in."""

    base: str
    pids: list[int]
    spool: Optional[Path] = None
    rss: dict[str, int] = field(default_factory=dict)
    """RSS to sample over the soak: a label -> the process."""
    completed: int = 0
    """Requests this arm has completed so far: the spans its spool should come to hold."""
    body: dict = field(default_factory=dict)
    """Fields every request to this arm carries besides the client's own."""


def base_env(root: Path, traced: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTRACE_")}
    env.update(KVTRACE_SPOOL_DIR=str(root / "spool"), XDG_DATA_HOME=str(root / "data"), KVTRACE_CAPTURE="ids",
               HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    env.update({"KVTRACE_ENABLED": "1"} if traced else {"KVTRACE_DISABLED": "1"})
    return env


def hf_model(python: Path, tmp: Path) -> Path:
    model = tmp / "hf-tiny"
    # Written by vLLM's interpreter: safetensors comes with vLLM, not necessarily with this one.
    subprocess.run([str(python), "-P", "-c", "import sys; from kvtrace.testmodels.hf_llama import make_model; "
                    "make_model(__import__('pathlib').Path(sys.argv[1]))", str(model)], check=True)
    return model


def vllm_argv(python: Path, model: Path, port: int, *extra: str) -> list[str]:
    return [str(python), "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", str(model),
            "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
            "--max-model-len", "512", "--block-size", "32", "--enforce-eager", "--seed", "0",
            "--enable-prefix-caching", "--shutdown-timeout", "30", "--max-num-seqs", "32", *extra]


@contextlib.contextmanager
def vllm_arms(args: argparse.Namespace, tmp: Path) -> Iterator[tuple[Arm, Arm]]:
    python = args.vllm_python
    model = hf_model(python, tmp)

    def argv(port: int, traced: bool) -> list[str]:
        serve = vllm_argv(python, model, port)
        return [str(python.parent / "kvtrace"), "run", "--", *serve] if traced else serve

    with contextlib.ExitStack() as stack:
        arms = []
        for traced in (False, True):
            root, port = tmp / f"vllm-{'traced' if traced else 'untraced'}", free_port()
            root.mkdir()
            base = f"http://127.0.0.1:{port}"
            process = stack.enter_context(started("vLLM", argv(port, traced), base_env(root, traced),
                                                  root / "server.log", base + "/health"))
            arms.append(Arm(base, [process.pid], root / "spool" if traced else None, {"server": process.pid}))
        yield arms[0], arms[1]


def gguf_model(tmp: Path, size: str) -> Path:
    return make_gguf_model(tmp / f"{size}.gguf", size=size)


@contextlib.contextmanager
def llama_cpp_arms(args: argparse.Namespace, tmp: Path) -> Iterator[tuple[Arm, Arm]]:
    model = gguf_model(tmp, args.size)
    python = args.llama_python
    with contextlib.ExitStack() as stack:
        arms = []
        for traced in (False, True):
            root, port = tmp / f"llama-cpp-{'traced' if traced else 'untraced'}", free_port()
            root.mkdir()
            serve = [str(python), "-m", "llama_cpp.server", "--model", str(model), "--model_alias", MODEL_NAME,
                     "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "1024", "--n_batch", "64",
                     "--n_ubatch", "64", "--n_threads", "1", "--n_threads_batch", "1", "--verbose", "false",
                     # By default a new request cuts off the stream being served: under load every stream would end early.
                     "--interrupt_requests", "false"]
            argv = [str(python.parent / "kvtrace"), "run", "--", *serve] if traced else serve
            base = f"http://127.0.0.1:{port}"
            process = stack.enter_context(started("llama_cpp.server", argv, base_env(root, traced),
                                                  root / "server.log", base + "/v1/models"))
            arms.append(Arm(base, [process.pid], root / "spool" if traced else None, {"server": process.pid}))
        yield arms[0], arms[1]


def llama_server_argv(model: Path, port: int, log: Path, cache_ram_mib: Optional[int]) -> list[str]:
    from kvtrace.llama_server.build import cached_llama_server

    binary = cached_llama_server()
    if binary is None:
        raise SystemExit("llama-server is not built; run `python -m kvtrace.llama_server.build` first")
    return [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-np", "4",
            "-c", "4096", "-t", "1", "-tb", "1", "-b", "64", "-ub", "64", "--no-warmup", "--no-repack",
            "-lv", "4", "--log-file", str(log),
            *(("--cache-ram", str(cache_ram_mib)) if cache_ram_mib is not None else ())]


def proxy_argv(upstream: str, port: int, *extra: str) -> list[str]:
    return [str(Path(sys.executable).parent / "kvtrace"), "proxy", "--upstream", upstream,
            "--listen", f"127.0.0.1:{port}", *extra]


@contextlib.contextmanager
def llama_server_arms(args: argparse.Namespace, tmp: Path) -> Iterator[tuple[Arm, Arm]]:
    model = gguf_model(tmp, args.size)
    root = tmp / "llama-server"
    root.mkdir()
    port, proxy_port = free_port(), free_port()
    base, proxy_base = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{proxy_port}"
    log = root / "llama-server.log"
    with started("llama-server", llama_server_argv(model, port, log, args.cache_ram), base_env(root, False),
                 root / "llama-server.out", base + "/health") as server, \
            started("kvtrace proxy", proxy_argv(base, proxy_port, "--llama-server-log", str(log),
                                                "--workers", str(args.proxy_workers)),
                    base_env(root, True), root / "proxy.out", proxy_base + "/health") as proxy:
        yield (Arm(base, [server.pid]),
               Arm(proxy_base, [server.pid, proxy.pid], root / "spool", {"server": server.pid, "proxy": proxy.pid}))


@contextlib.contextmanager
def shadow_arms(name: str, args: argparse.Namespace, tmp: Path) -> Iterator[tuple[Arm, Arm]]:
    """The server, untraced, behind a plain proxy and behind one with ``--shadow RATE``."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = tmp / "server.log"
    if name == "vllm":
        # The answers say which requests hit the cache: only those are shadowed.
        argv, health = vllm_argv(args.vllm_python, hf_model(args.vllm_python, tmp), port,
                                 "--enable-prompt-tokens-details"), base + "/health"
        log_args: tuple[str, ...] = ()
    else:
        argv, health = llama_server_argv(gguf_model(tmp, args.size), port, log, args.cache_ram), base + "/health"
        log_args = ("--llama-server-log", str(log))
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(started(name, argv, base_env(tmp, False), tmp / "server.out", health))
        arms = []
        for shadowed in (False, True):
            root, proxy_port = tmp / ("proxy-shadow" if shadowed else "proxy-plain"), free_port()
            root.mkdir()
            extra = (*log_args, *(("--shadow", str(args.shadow)) if shadowed else ()))
            proxy_base = f"http://127.0.0.1:{proxy_port}"
            proxy = stack.enter_context(started("kvtrace proxy", proxy_argv(base, proxy_port, *extra),
                                                base_env(root, True), root / "proxy.out", proxy_base + "/health"))
            arms.append(Arm(proxy_base, [server.pid, proxy.pid], root / "spool", {"proxy": proxy.pid}))
        yield arms[0], arms[1]


ARMS = {"vllm": vllm_arms, "llama-cpp": llama_cpp_arms, "llama-server": llama_server_arms}


# ------------------------------------------------------------------------------------------- load

def spooled_request_spans(spool: Path) -> Iterator[dict]:
    """The request spans in a spool's complete lines, every worker's file."""
    for path in sorted(spool.glob("*.jsonl")) if spool.is_dir() else []:
        text = path.read_text(errors="replace")
        for line in text[:text.rfind("\n") + 1].splitlines():
            with contextlib.suppress(ValueError):
                for resource in json.loads(line).get("resourceSpans", []):
                    for scope in resource.get("scopeSpans", []):
                        yield from (span for span in scope.get("spans", []) if span.get("name") == SPAN_REQUEST)


def request_spans(spool: Path) -> tuple[int, int]:
    """The request spans in a spool: the clients', and the shadow twins'."""
    twins = [is_twin(span) for span in spooled_request_spans(spool)]
    return len(twins) - sum(twins), sum(twins)


def task_matches(spool: Path) -> collections.Counter:
    """How the proxy tied each client request span to its llama-server task (``marker`` when by its own)."""
    return collections.Counter(next((a.get("value", {}).get("stringValue") for a in span.get("attributes", [])
                                     if a.get("key") == SERVER_TASK_MATCH), "absent")
                               for span in spooled_request_spans(spool) if not is_twin(span))


def twins_dropped(spool: Path) -> int:
    """Shadow twins the budget dropped, as the proxy last published its counters."""
    return sum(int(stats.get(SHADOW_TWINS_DROPPED, 0)) for stats in read_stats(spool)) if spool.is_dir() else 0


def is_twin(span: dict) -> bool:
    return any(a.get("key") == ARM and a.get("value", {}).get("stringValue") == ARM_SHADOW
               for a in span.get("attributes", []))


class Client:
    """Sends completions through a pool of threads; counts each request's latency."""

    def __init__(self, tokens: int):
        self.http = httpx.Client(timeout=300, limits=httpx.Limits(max_connections=128, max_keepalive_connections=128))
        self.tokens = tokens
        self.numbers = itertools.count(1)  # next() is atomic under the GIL: every request its own tail
        self.resends = itertools.count()
        self.resent = 0

    def one(self, arm: Arm, stream: bool) -> float:
        n = next(self.numbers)
        body = {"model": MODEL_NAME, "prompt": f"{PREFIX} request {n}:", "max_tokens": self.tokens,
                "temperature": 0.0, "stream": stream, **arm.body}
        url = arm.base + "/v1/completions"
        headers = {"baggage": f"kvtrace.run_id=server-load,kvtrace.episode_id=e{n},kvtrace.turn=0"}
        start = time.perf_counter()
        for attempt in range(3):  # llama-server closes a kept-alive connection now and then: send again
            try:
                if stream:
                    with self.http.stream("POST", url, json=body, headers=headers) as answer:
                        answer.raise_for_status()
                        for _ in answer.iter_lines():
                            pass
                else:
                    self.http.post(url, json=body, headers=headers).raise_for_status()
                return time.perf_counter() - start
            except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError):
                # a kept-alive connection the server closed, seen as a protocol error or, when the pool
                # had already closed its socket, as a read or write error (EBADF)
                if attempt == 2:
                    raise
                # Resent: its latency includes the lost try, and the proxy may record the cut-off one too.
                self.resent = next(self.resends) + 1
        raise AssertionError("unreachable")

    def block(self, arm: Arm, concurrency: int, count: int, stream: bool, settle_s: float = 0.0) -> "Block":
        """``settle_s``: a wait after the requests, inside the CPU window (work they left behind counts)."""
        before, wall = {pid: cpu_times([pid]) for pid in arm.pids}, time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            latencies = list(pool.map(lambda _: self.one(arm, stream), range(count)))
        wall_s = time.perf_counter() - wall
        time.sleep(settle_s)
        arm.completed += len(latencies)
        used = {pid: tuple(now - then for now, then in zip(cpu_times([pid]), before[pid])) for pid in arm.pids}
        return Block(wall_s, sum(map(sum, used.values())), latencies, used.get(arm.rss.get("proxy"), (0.0, 0.0)))


@dataclass
class Block:
    wall_s: float
    cpu_s: float
    latencies: list[float]
    proxy_cpu_s: tuple[float, float]
    """The proxy's share of ``cpu_s`` (its workers included), user and system; zero where the arm has none."""


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def wait_for_spans(spool: Path, expected: int) -> tuple[int, int]:
    """The clients' and the twins' request spans, once the clients' reach ``expected`` (or time is up)."""
    deadline = time.monotonic() + SPANS_WAIT_S
    while (counts := request_spans(spool))[0] < expected and time.monotonic() < deadline:
        time.sleep(0.5)
    return counts


def measure(client: Client, untraced: Arm, traced: Arm, concurrency: int, requests: int, stream: bool,
            settle_s: float = 0.0) -> dict:
    """Both arms, ABBA block by block; the traced arm's spans (where it has a spool) counted against its
    completed requests."""
    size = 2 * concurrency
    blocks = max(1, -(-requests // size))

    def counts() -> tuple[int, int, int]:
        # Counted against every request so far, so a span of an earlier cell arriving late is not one of this cell's.
        if traced.spool is None:
            return 0, 0, 0
        return (*wait_for_spans(traced.spool, traced.completed), twins_dropped(traced.spool))

    before = counts()
    arms: dict[bool, list[Block]] = {False: [], True: []}
    resent_before = client.resent
    for index in range(blocks):
        count = min(size, requests - index * size)
        order = (True, False) if index % 4 in (0, 3) else (False, True)
        for is_traced in order:
            arms[is_traced].append(client.block(traced if is_traced else untraced, concurrency, count, stream,
                                                settle_s))
    completed = sum(len(b.latencies) for b in arms[True])
    spans, twins, dropped = (after - first for after, first in zip(counts(), before))
    out = {"completed": completed, "spans": spans, "resent": client.resent - resent_before, "twins": twins,
           "dropped": dropped}
    out["p50_pairs"] = [statistics.median(t.latencies) / statistics.median(u.latencies)
                        for t, u in zip(arms[True], arms[False])]
    for is_traced, name in ((False, "untraced"), (True, "traced")):
        latencies = [x for b in arms[is_traced] for x in b.latencies]
        wall = sum(b.wall_s for b in arms[is_traced])
        out[name] = {"rps": len(latencies) / wall, "p50": percentile(latencies, 0.5), "p99": percentile(latencies, 0.99),
                     "cpu_per_request": sum(b.cpu_s for b in arms[is_traced]) / len(latencies),
                     "proxy_cpu_per_request": [sum(b.proxy_cpu_s[kind] for b in arms[is_traced]) / len(latencies)
                                               for kind in (0, 1)],
                     "wall_per_request": wall / len(latencies)}
    return out


def soak(client: Client, traced: Arm, concurrency: int, minutes: float) -> dict[str, list[float]]:
    """Traced load for ``minutes``; RSS of each sampled process every few seconds."""
    samples: dict[str, list[float]] = {label: [] for label in traced.rss}
    stop = time.monotonic() + minutes * 60
    done = threading.Event()

    def sample() -> None:
        while not done.wait(5):
            for label, pid in traced.rss.items():
                samples[label].append(rss_mb(pid))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    while time.monotonic() < stop:
        client.block(traced, concurrency, 2 * concurrency, stream=False)
    done.set()
    sampler.join()
    return samples


# ------------------------------------------------------------------------------------------- report

def ratio(out: dict, key: str) -> float:
    return out["traced"][key] / out["untraced"][key]


def pair_interval(ratios: list[float], resamples: int = 2000) -> tuple[float, float, float]:
    """The median of per-block-pair ratios with a 95 % percentile-bootstrap interval over the pairs: a pair
    of adjacent blocks is the independent sample (its requests share the same moment of the machine)."""
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples))
    return statistics.median(ratios), medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def report_cell(server: str, concurrency: int, stream: bool, out: dict, shadow: bool = False,
                floor: bool = False) -> None:
    """``floor``: the server asked directly for the top two the proxy asks for, against the plain direct server."""
    t, u = out["traced"], out["untraced"]
    lost = out["completed"] - out["spans"]
    resent = f"  resent after a dropped connection: {out['resent']}" if out["resent"] else ""
    spans = "" if floor else f"  spans {out['spans']}/{out['completed']} (lost {lost}; target 0)"
    p50_pct = 100 * (ratio(out, "p50") - 1)
    user, system = t["proxy_cpu_per_request"]
    proxy_cpu = f", the proxy's {(user + system) * 1e3:.1f}: user {user * 1e3:.1f}, system {system * 1e3:.1f}" \
        if user + system else ""
    target = ""
    if shadow:
        target = f"  twins {out['twins']} (dropped {out['dropped']})"
        if concurrency == SHADOW_TARGET_CONCURRENCY:
            target += f"  target: twins add <= {TARGET_P50_PCT:g} % to p50"
    elif floor:
        target = "  (no proxy: the server's own share of the proxy's cost)"
    elif server == "llama-server" and concurrency == 32:
        target = f"  target: proxy adds <= {TARGET_P50_PCT:g} % to p50"
    pairs = out["p50_pairs"]
    by_pair = (" [by block pair %.3f, 95 %% interval %.3f-%.3f, n=%d]" % (*pair_interval(pairs), len(pairs))
               if len(pairs) >= 5 else "")  # fewer pairs bound nothing
    print(f"  c={concurrency:<3} {'stream' if stream else 'whole ':6}  throughput {ratio(out, 'rps'):6.3f}  "
          f"p50 {ratio(out, 'p50'):6.3f}{by_pair} ({u['p50'] * 1e3:.1f} / {t['p50'] * 1e3:.1f} ms, {p50_pct:+.1f} %)  "
          f"p99 {ratio(out, 'p99'):6.3f}  "
          f"CPU/request {ratio(out, 'cpu_per_request'):6.3f} ({u['cpu_per_request'] * 1e3:.1f} / "
          f"{t['cpu_per_request'] * 1e3:.1f} ms{proxy_cpu})  wall/request {u['wall_per_request'] * 1e3:.1f} / "
          f"{t['wall_per_request'] * 1e3:.1f} ms{spans}{resent}{target}")


def growth(label: str, values: list[float], what: str) -> None:
    if len(values) < 2:
        print(f"  RSS {label}: {values[0] if values else 0:.0f} MB ({what}: too few samples for a growth)")
        return
    # The first tenth of a soak is warm-up (llama-server's KV cache and prompt cache page in): growth from there.
    # RSS is a sawtooth (the proxy gives free pages back once a minute), so a long soak compares the medians of
    # its second, middle and last tenths, not single samples, which read the saw's phase as much as growth.
    tenth = len(values) // 10
    if tenth >= 3:
        middle_start = (len(values) - tenth) // 2
        first, middle, last = (statistics.median(values[tenth:2 * tenth]),
                               statistics.median(values[middle_start:middle_start + tenth]),
                               statistics.median(values[-tenth:]))
        kind = f"; medians of tenths ({tenth} samples each)"
    else:
        first, middle, last = values[tenth], values[(tenth + len(values)) // 2], values[-1]
        kind = ""
    halves = (f"; {middle:.0f} MB half-way: {100 * (middle / first - 1):+.1f} % then {100 * (last / middle - 1):+.1f} %"
              if len(values) > 2 else "")  # a plateau (bounded caches filled) reads apart from a steady climb
    print(f"  RSS {label}: {first:.0f} -> {last:.0f} MB over {what}, growth {100 * (last / first - 1):+.1f} % "
          f"(target < {TARGET_RSS_PCT:g} % over a 20-minute soak){halves}{kind}")


def top_two_fields() -> dict:
    """What the proxy adds to a llama-server completion to be sent the top two (its marker aside)."""
    request = {"prompt": "", "max_tokens": 1}
    plan = plan_request(COMPLETIONS, request, UpstreamProfile(engine="llama-server", llama_server=True))
    return {key: value for key, value in plan.upstream_request.items() if key not in request}


def run_server(name: str, args: argparse.Namespace, tmp: Path) -> None:
    if args.shadow is not None:
        print(f"\n{name}: shadowed/plain proxy ratios at --shadow {args.shadow:g} (plain / shadowed absolute "
              "figures beside them)")
        arms, settle_s = shadow_arms(name, args, tmp), SETTLE_S
    else:
        print(f"\n{name}: traced/untraced ratios (untraced / traced absolute figures beside them)")
        arms, settle_s = ARMS[name](args, tmp), 0.0
    with arms as (untraced, traced):
        client = Client(args.tokens)
        for arm in (untraced, traced):  # first calls: the model's first batch, the exporter thread
            client.block(arm, 2, 4, stream=False, settle_s=settle_s)
        before = {label: rss_mb(pid) for label, pid in traced.rss.items()}
        # llama-server's top two cost the server itself: the direct server asked for them shows that share.
        floor = (replace(untraced, body=top_two_fields(), completed=0)
                 if name == "llama-server" and args.shadow is None else None)
        for concurrency in args.concurrency:
            for stream in (False, True):
                report_cell(name, concurrency, stream, measure(client, untraced, traced, concurrency,
                                                               args.requests, stream, settle_s),
                            shadow=args.shadow is not None)
                if floor is not None:
                    report_cell(name, concurrency, stream,
                                measure(client, untraced, floor, concurrency, args.requests, stream), floor=True)
        for label, pid in traced.rss.items():
            growth(label, [before[label], rss_mb(pid)], "the load above")
        if args.minutes:
            soaked = traced.completed
            for label, values in soak(client, traced, max(args.concurrency), args.minutes).items():
                growth(label, values, f"a {args.minutes:g}-minute soak at c={max(args.concurrency)}")
            if traced.spool is not None:
                spans = wait_for_spans(traced.spool, traced.completed)[0]
                print(f"  spans over the soak: {spans - soaked}/{traced.completed - soaked} "
                      f"(lost {traced.completed - spans}; target 0)")
        if name == "llama-server" and args.shadow is None:
            matches = task_matches(traced.spool)
            print(f"  tied to a server task: {dict(matches.most_common())} (target: every one by its marker)")
        client.http.close()


def main() -> int:
    args = parse_args()
    print(f"servers {','.join(args.servers)}; concurrency {','.join(map(str, args.concurrency))}; "
          f"{args.requests} requests per arm and cell, {args.tokens} tokens each; ABBA by block of 2 x concurrency"
          + (f"; llama-server --cache-ram {args.cache_ram}" if args.cache_ram is not None else ""))
    print("load average: %.2f %.2f %.2f on %d CPUs" % (*os.getloadavg(), os.cpu_count() or 0))
    with tempfile.TemporaryDirectory(prefix="kvtrace-bench-server-") as tmp:
        for name in args.servers:
            root = Path(tmp) / name
            root.mkdir()
            try:
                run_server(name, args, root)
            except httpx.HTTPError as exc:
                raise SystemExit(f"{name}: a request failed ({exc}); is the server overloaded?") from None
    return 0


if __name__ == "__main__":
    sys.exit(main())
