"""How many streamed tokens a second one `kvtrace proxy` relays, and what a request costs it, with no model.

    python benchmarks/proxy_throughput.py [--seconds 4] [--rounds 3] [--concurrency 32] [--tokens 256]
                                          [--events-per-write 0] [--profile FILE] [--floor]

A fake llama-server (a process of its own: ``/props``, ``/apply-template``, ``/tokenize``, and the
completion endpoints answered from pre-built documents carrying the top two logprobs the proxy asks
for, so that the proxy cuts them) stands upstream, and a client process drives real ``kvtrace proxy``
processes at ``--concurrency`` kept-alive connections. Arms, run in turns (ABBA within each round, so
drift on a shared machine hits them alike), each for ``--seconds``:

* **streams**: streamed chat completions of ``--tokens`` events each, through ``--workers 1`` and
  ``--workers 2``, each also with ``--pin-workers`` (a worker kept to a CPU of its own); the fake
  writes a stream ``--events-per-write`` events at a time (0: the whole answer in one write, as fast
  as the socket takes it). Streamed tokens a second, and the proxy's
  CPU (every process and thread, from /proc) per streamed token, with the CPU the client and the
  fake took meanwhile (they share the machine's cores with the workers);
* **requests**: non-streamed one-token chat completions through four one-worker proxies:
  ``relay`` (recording disabled: HTTP alone, nothing added to the request, nothing cut from the
  answer), ``traced`` (the top two added and cut, the record and its span), and
  ``traced+log`` (``--llama-server-log``: the fake writes each request's task to a log as llama-server
  writes it at ``-lv 4``, 25 lines a request, in a log of that proxy's own (a port of the fake's of its
  own), so the proxy matches it and makes the integrity check's
  ``/apply-template`` + ``/tokenize`` calls; each request's prompt is its own unless ``--repeat-prompts``,
  so the proxy's cache of the server's tokens does not answer for it), and ``traced+log+known`` (the
  same, every request with one prompt: the cache answers, no call is made). CPU per request, and each
  part's share as the difference between arms: the record and its span, the log's reading and the
  task's matching, the integrity check's calls.

With ``--floor``, the requests have one more arm, ``floor``: a bare relay in Python (a thread per
connection, httptools on both sides as the proxy has, a request framed again by its length, an answer
passed on as it arrives, one write a read; no limit, time-out or record), the least such a relay costs
on this machine; the table gives relay / floor. ``proxy_overhead.py --floor`` runs it in front of
llama-server.

Beside each arm's CPU, the part of it the kernel spent (system time: the sockets' system calls, the
threads' wake-ups), which the proxy's Python does not show.

Every answer is checked: the client counts the events of each stream and refuses one in which the
added logprobs were not cut; an arm's CPU is read once the proxy is idle again, its records made.
With ``--baseline TREE`` (a directory holding another kvtrace source
tree, e.g. ``git archive REV kvtrace | tar -x -C TREE``, compiled modules copied in), every arm has a
twin whose proxy imports kvtrace from TREE, run in turn with it, and the table gives both. With
``--profile FILE``, one more ``--workers 1`` proxy runs under cProfile (its main thread only: use
py-spy for the relay's threads) and its statistics go to FILE. Prints a table with the range over the
rounds, and on the rounds' medians whether the proxy's targets are met (a streamed token's CPU, one
worker's tokens a second, two workers against one, free and pinned, a traced+log request's CPU);
asserts nothing (the figures belong to this machine).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

import httptools

from targets import verdict  # benchmarks/, beside this script

# --- the fake llama-server ------------------------------------------------------------------------

PROPS = {"build_info": "b0-fake", "model_path": "fake.gguf", "total_slots": 4, "model_ftype": "all F32",
         "default_generation_settings": {"n_ctx": 4096, "params": {
             "n_probs": 0, "post_sampling_probs": False, "dry_multiplier": 0.0, "dry_penalty_last_n": -1,
             "cache_prompt": True}}}
PROMPT_TOKENS = 24


def _top_two(token_id: int, text: str) -> dict:
    def entry(i: int, t: str, logprob: float) -> dict:
        return {"id": i, "token": t, "bytes": list(t.encode()), "logprob": logprob}

    return {**entry(token_id, text, -0.25), "top_logprobs": [entry(token_id, text, -0.25), entry(7, " a", -1.5)]}


def stream_events(tokens: int, top_two: bool) -> list[bytes]:
    """llama-server's chat stream (with ``n_probs: 2``: ``top_two``): one event per token, then the last
    with its counts."""
    base = {"created": 1765000000, "id": "chatcmpl-fake", "model": "fake", "system_fingerprint": "b0-fake",
            "object": "chat.completion.chunk"}
    events = []
    for n in range(tokens):
        word = f" w{n % 97}"
        choice = {"finish_reason": None, "index": 0, "delta": {"content": word}}
        if top_two:
            choice["logprobs"] = {"content": [_top_two(100 + n % 97, word)]}
        events.append({"choices": [choice], **base})
    events.append({"choices": [{"finish_reason": "length", "index": 0, "delta": {}}], **base,
                   "usage": {"completion_tokens": tokens, "prompt_tokens": PROMPT_TOKENS,
                             "total_tokens": PROMPT_TOKENS + tokens},
                   "timings": {"cache_n": 0, "prompt_n": PROMPT_TOKENS, "predicted_n": tokens}})
    return [b"data: " + json.dumps(e, separators=(",", ":")).encode() + b"\n\n" for e in events] + [
        b"data: [DONE]\n\n"]


def whole_answer(top_two: bool) -> bytes:
    choice = {"finish_reason": "length", "index": 0, "message": {"role": "assistant", "content": " w"}}
    if top_two:
        choice["logprobs"] = {"content": [_top_two(100, " w")]}
    return json.dumps({
        "choices": [choice],
        "created": 1765000000, "id": "chatcmpl-fake", "model": "fake", "object": "chat.completion",
        "usage": {"completion_tokens": 1, "prompt_tokens": PROMPT_TOKENS, "total_tokens": PROMPT_TOKENS + 1},
        "timings": {"cache_n": 0, "prompt_n": PROMPT_TOKENS, "predicted_n": 1}}, separators=(",", ":")).encode()


def _json_head(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body)


def _chunked(events: list[bytes], events_per_write: int) -> list[bytes]:
    """A streamed answer as the pieces written: one chunk per event, ``events_per_write`` (0: all) at once."""
    group = events_per_write or len(events)
    pieces = [b"".join(b"%x\r\n%b\r\n" % (len(e), e) for e in events[i:i + group])
              for i in range(0, len(events), group)]
    pieces[-1] += b"0\r\n\r\n"
    pieces[0] = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n" + pieces[0]
    return pieces


class FakeLlamaServer:
    """Answers from pre-built bytes on one port per log (one port and no log without ``logs``); writes each
    marked request's task to its port's log as llama-server -lv 4 does: a proxy reading a log of its own is
    one in front of a server only it calls."""

    def __init__(self, tokens: int, events_per_write: int, logs: list[Path]):
        self.stream = {top_two: _chunked(stream_events(tokens, top_two), events_per_write) for top_two in (False, True)}
        self.whole = {top_two: _json_head(whole_answer(top_two)) + whole_answer(top_two) for top_two in (False, True)}
        props = json.dumps(PROPS).encode()
        self.props = _json_head(props) + props
        self.tokens = tokens
        self.calls: dict[str, int] = {}
        self._task = 0
        self._lock = threading.Lock()
        for log in logs:
            log.write_text("llama_context: n_ctx         = 4096\nllama_context: n_batch       = 2048\n")
        self.listeners = {socket.create_server(("127.0.0.1", 0), backlog=512): log for log in logs or [None]}

    def serve(self) -> None:
        for listener, log in self.listeners.items():
            threading.Thread(target=self._accept, args=(listener, log), daemon=True).start()

    def _accept(self, listener: socket.socket, log: Optional[Path]) -> None:
        while True:
            sock, _ = listener.accept()
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._connection, args=(sock, log), daemon=True).start()

    def _connection(self, sock: socket.socket, log: Optional[Path]) -> None:
        buffer = b""
        with sock:
            while True:
                while b"\r\n\r\n" not in buffer:
                    data = sock.recv(65536)
                    if not data:
                        return
                    buffer += data
                head, _, buffer = buffer.partition(b"\r\n\r\n")
                lines = head.split(b"\r\n")
                target = lines[0].split(b" ")[1].decode()
                length = 0
                for line in lines[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                while len(buffer) < length:
                    buffer += sock.recv(65536)
                body, buffer = buffer[:length], buffer[length:]
                with self._lock:
                    self.calls[target] = self.calls.get(target, 0) + 1
                for piece in self._answer(target, body, log):
                    sock.sendall(piece)

    def _answer(self, target: str, body: bytes, log: Optional[Path]) -> list[bytes]:
        if target == "/props":
            return [self.props]
        if target == "/apply-template":
            rendered = json.dumps({"prompt": "".join(m.get("content", "") for m in json.loads(body)["messages"])})
            return [_json_head(rendered.encode()) + rendered.encode()]
        if target == "/tokenize":
            tokens = json.dumps({"tokens": list(range(1, PROMPT_TOKENS + 1))}).encode()
            return [_json_head(tokens) + tokens]
        streamed = b'"stream": true' in body or b'"stream":true' in body
        top_two = b'"n_probs"' in body
        if log is not None and b'"dry_penalty_last_n"' in body:  # marked: a proxy reading the log sent it
            self._log_task(json.loads(body), streamed, log)
        return self.stream[top_two] if streamed else [self.whole[top_two]]

    def _log_task(self, request: dict, streamed: bool, log: Path) -> None:
        """The 25 lines the llama-server kvtrace builds writes at ``-lv 4`` for a request, its prompt cache on
        (the other slots passed over and saved idle, the sampler, the timings), this task's in them."""
        marker = request.get("dry_penalty_last_n", -1)
        generated = self.tokens if streamed else 1
        with self._lock:
            task, self._task = self._task, self._task + 1
            slot = task % 4
            others = [other for other in range(4) if other != slot]
            ours, idle = f"id  {slot} | task {task} |", f"id  {slot} | task -1 |"
            lines = ["I srv  server_strea: conv_id= (empty=1)",
                     *(f"I slot get_availabl: id  {other} | task -1 |  - skipping, slot is empty"
                       for other in others),
                     f"I slot get_availabl: {idle}  - checking sim = 0.000 (0/{PROMPT_TOKENS}) > 0.100",
                     f"I slot get_availabl: {idle} selected slot by LRU, t_last = {task}",
                     f"I slot launch_slot_: {idle} sampler chain: logits -> ?penalties -> ?dry -> ?top-n-sigma -> "
                     "top-k -> ?typical -> top-p -> min-p -> ?xtc -> temp-ext -> dist ",
                     f"I slot launch_slot_: {idle} sampler params: ",
                     "\trepeat_last_n = 64, repeat_penalty = 1.000, frequency_penalty = 0.000, "
                     "presence_penalty = 0.000",
                     "\tdry_multiplier = 0.000, dry_base = 1.750, dry_allowed_length = 2, "
                     f"dry_penalty_last_n = {marker}",
                     "\ttop_k = 40, top_p = 0.950, min_p = 0.050, xtc_probability = 0.000, xtc_threshold = 0.100, "
                     "typical_p = 1.000, top_n_sigma = -1.000, temp = 0.800",
                     "\tmirostat = 0, mirostat_lr = 0.100, mirostat_ent = 5.000, adaptive_target = -1.000, "
                     "adaptive_decay = 0.900",
                     f"I slot launch_slot_: {ours} processing task, is_child = 0",
                     *(f"I slot process_sing: id  {other} | task -1 | saving idle slot to prompt cache"
                       for other in others),
                     f"I slot   operator(): {ours} new prompt, n_ctx_slot = 4096, n_keep = 0, task.n_tokens = "
                     f"{PROMPT_TOKENS}",
                     f"I slot   operator(): {ours} cached n_tokens = 0, memory_seq_rm [0, end)",
                     f"I slot init_sampler: {ours} init sampler, took 0.01 ms, tokens: text = {PROMPT_TOKENS}, "
                     f"total = {PROMPT_TOKENS}",
                     f"I slot print_timing: {ours} prompt eval time =       1.00 ms /    {PROMPT_TOKENS} tokens "
                     f"(    0.04 ms per token, 24000.00 tokens per second)",
                     f"I slot print_timing: {ours}        eval time =       1.00 ms /    {generated} tokens "
                     "(    1.00 ms per token,  1000.00 tokens per second)",
                     f"I slot print_timing: {ours}       total time =       2.00 ms /    "
                     f"{PROMPT_TOKENS + generated} tokens",
                     f"I slot print_timing: {ours}    graphs reused =          0",
                     f"I slot      release: {ours} stop processing: n_tokens = {PROMPT_TOKENS + generated}, "
                     "truncated = 0",
                     "I srv  update_slots: all slots are idle"]
            stamp = f"0.00.{task // 1000 % 1000:03d}.{task % 1000:03d} "
            with open(log, "a") as out:
                out.write("".join(stamp + line + "\n" if line[0] == "I" else line + "\n" for line in lines))


def run_fake(args: argparse.Namespace) -> None:
    fake = FakeLlamaServer(args.tokens, args.events_per_write, args.log)
    fake.serve()
    print(*(listener.getsockname()[1] for listener in fake.listeners), flush=True)
    for line in sys.stdin:  # "calls": how often each path was asked, as JSON
        print(json.dumps(fake.calls), flush=True)


# --- the floor: a bare relay --------------------------------------------------------------------------

def _headers(headers: list[tuple[bytes, bytes]], dropped: tuple[bytes, ...]) -> bytes:
    return b"".join(name + b": " + value + b"\r\n" for name, value in headers if name.lower() not in dropped)


class _Request:
    """One request as httptools hands it over."""

    def __init__(self) -> None:
        self.url, self.headers, self.body, self.done = b"", [], [], False

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.done = True


def _read_request(sock: socket.socket) -> Optional[bytes]:
    """The next request on ``sock``, framed again by its length; ``None`` once the client closed."""
    request = _Request()
    parser = httptools.HttpRequestParser(request)
    while not request.done:
        data = sock.recv(1 << 16)
        if not data:
            return None
        parser.feed_data(data)
    body = b"".join(request.body)
    return (b"%s %s HTTP/1.1\r\n" % (parser.get_method(), request.url)
            + _headers(request.headers, (b"content-length", b"transfer-encoding", b"connection"))
            + b"content-length: %d\r\n\r\n" % len(body) + body)


class _Relayed:
    """An answer passed on as it arrives: its head once whole, then what each read brought of its body
    (chunk-framed where the upstream chunks it), one write a read, as the proxy relays a stream."""

    def __init__(self) -> None:
        self.headers: list[tuple[bytes, bytes]] = []
        self.out: list[bytes] = []
        self.chunked = self.done = False
        self.parser = None

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.chunked = any(name.lower() == b"transfer-encoding" for name, _ in self.headers)
        self.out.append(b"HTTP/1.1 %d OK\r\n%b\r\n" % (self.parser.get_status_code(),
                                                        _headers(self.headers, (b"connection",))))

    def on_body(self, body: bytes) -> None:
        self.out.append(b"%x\r\n%b\r\n" % (len(body), body) if self.chunked else body)

    def on_message_complete(self) -> None:
        if self.chunked:
            self.out.append(b"0\r\n\r\n")
        self.done = True


def _relay_answer(server: socket.socket, client: socket.socket) -> Optional[bool]:
    """One answer from ``server`` to ``client`` as it arrives: ``None`` if it broke off, else whether
    ``server`` may carry the next request."""
    answer = _Relayed()
    parser = answer.parser = httptools.HttpResponseParser(answer)
    while not answer.done:
        data = server.recv(1 << 16)
        if not data:
            return None
        parser.feed_data(data)
        if answer.out:
            client.sendall(b"".join(answer.out))
            answer.out.clear()
    return parser.should_keep_alive()


def _upstream_socket(upstream: tuple[str, int]) -> socket.socket:
    server = socket.create_connection(upstream)
    server.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return server


def _floor_connection(client: socket.socket, upstream: tuple[str, int]) -> None:
    client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    server = _upstream_socket(upstream)
    try:
        while (request := _read_request(client)) is not None:
            server.sendall(request)
            reusable = _relay_answer(server, client)
            if reusable is None:
                return
            if not reusable:  # llama-server closes a kept-alive connection now and then: a new one
                server.close()
                server = _upstream_socket(upstream)
    finally:
        server.close()
        client.close()


def run_floor(args: argparse.Namespace) -> None:
    """The least a relay in Python does: a thread per connection, httptools on both sides (the proxy's
    parser), a request framed again by its length, an answer passed on as it arrives; no limits, no
    time-outs, no record."""
    host, port = args.upstream.removeprefix("http://").split(":")
    listener = socket.create_server(("127.0.0.1", 0), backlog=512)
    print(f"kvtrace: proxy on http://127.0.0.1:{listener.getsockname()[1]}", flush=True)  # as the proxy says it
    while True:
        client, _ = listener.accept()
        threading.Thread(target=_floor_connection, args=(client, (host, int(port))), daemon=True).start()


# --- the client ---------------------------------------------------------------------------------------

def _request(streamed: bool, tokens: int, number: Optional[int]) -> bytes:
    """The client's request; ``number`` makes its prompt its own (``None``: every prompt the same)."""
    prompt = "Describe the kitchen in detail" + (f", room {number}" if number is not None else "")
    body = json.dumps({"messages": [{"role": "user", "content": prompt}],
                       "max_tokens": tokens if streamed else 1, "stream": streamed}).encode()
    return (b"POST /v1/chat/completions HTTP/1.1\r\nhost: proxy\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%b" % (len(body), body))


_PROMPT_NUMBERS = itertools.count()
"""Numbers for the client's prompts, never one twice in a run (each proxy remembers the prompts it tokenized)."""


def _drive(url: str, streamed: bool, tokens: int, seconds: float, concurrency: int, repeat: bool) -> dict:
    """``concurrency`` connections asking in a loop for ``seconds``; answers counted and checked."""
    host, port = url.removeprefix("http://").split(":")
    totals = {"requests": 0, "tokens": 0, "bad": 0}
    lock = threading.Lock()
    stop = time.monotonic() + seconds

    def one_connection() -> None:
        requests = events = bad = 0
        with socket.create_connection((host, int(port))) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while time.monotonic() < stop:
                sock.sendall(_request(streamed, tokens, None if repeat else next(_PROMPT_NUMBERS)))
                answer = bytearray()
                # A streamed answer ends with the last chunk; a whole one is small and framed by its length.
                while not (answer.endswith(b"0\r\n\r\n") if streamed else _whole_done(answer)):
                    data = sock.recv(1 << 18)
                    if not data:
                        raise SystemExit(f"{url} closed the connection")
                    answer += data
                requests += 1
                if streamed:
                    events += answer.count(b"data: {") - 1  # the last event carries the counts, not a token
                if b"logprobs" in answer or not answer.startswith(b"HTTP/1.1 200"):
                    bad += 1
        with lock:
            totals["requests"] += requests
            totals["tokens"] += events
            totals["bad"] += bad

    threads = [threading.Thread(target=one_connection) for _ in range(concurrency)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    totals["wall_s"] = time.monotonic() - started
    return totals


def _whole_done(answer: bytearray) -> bool:
    head_end = answer.find(b"\r\n\r\n")
    if head_end == -1:
        return False
    at = answer.find(b"content-length: ", 0, head_end)
    return at != -1 and len(answer) >= head_end + 4 + int(answer[at + 16:answer.find(b"\r\n", at)])


def run_client(args: argparse.Namespace) -> None:
    for line in sys.stdin:  # "URL streams|requests [known]": one arm's turn (known: one prompt for all)
        url, mode, *known = line.split()
        print(json.dumps(_drive(url, mode == "streams", args.tokens, args.seconds, args.concurrency,
                                args.repeat_prompts or bool(known))), flush=True)


# --- the proxies and the table -----------------------------------------------------------------------

class Proxy:
    """``kvtrace proxy`` as a process of its own (a supervisor and its workers), and its CPU time."""

    def __init__(self, name: str, upstream: str, workdir: Path, extra: list[str], env: dict[str, str],
                 profile: Optional[Path] = None):
        self.name = name
        self._log_path = workdir / f"{name}.log"
        self._log = open(self._log_path, "wb")
        if name == "floor":
            command = [__file__, "--role", "floor", "--upstream", upstream]
        else:
            profiled = ["-m", "cProfile", "-o", str(profile)] if profile is not None else []
            command = [*profiled, "-m", "kvtrace.cli", "proxy", "--upstream", upstream, "--listen", "127.0.0.1:0",
                       *extra]
        self.process = subprocess.Popen(
            [sys.executable, *command],
            stdout=self._log, stderr=subprocess.STDOUT, cwd=workdir, env={**os.environ, **env})
        self.url = ""
        deadline = time.monotonic() + 120
        while not self.url:
            for line in self._log_path.read_text(errors="replace").splitlines():
                if line.startswith("kvtrace: proxy on "):
                    self.url = line.split()[3]
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"{name}: the proxy did not start:\n{self._log_path.read_text(errors='replace')}")
            time.sleep(0.1)

    def cpu_times(self) -> tuple[float, float]:
        """(user, system) CPU seconds of the proxy's processes (every thread), its workers included."""
        user = system = 0.0
        pending = [self.process.pid]
        while pending:
            pid = pending.pop()
            try:
                own_user, own_system = _cpu_times(pid)
                children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
            except OSError:
                continue
            user, system = user + own_user, system + own_system
            pending += [int(child) for child in children]
        return user, system

    def stop(self) -> None:
        self.process.send_signal(signal.SIGINT)  # a normal stop: spans flushed (and a profile written)
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self._log.close()


def _helper(role: str, args: argparse.Namespace, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, "--role", role, "--tokens", str(args.tokens), "--seconds",
                             str(args.seconds), "--concurrency", str(args.concurrency), "--events-per-write",
                             str(args.events_per_write), *(["--repeat-prompts"] if args.repeat_prompts else []),
                             *extra], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _ask(process: subprocess.Popen, line: str) -> str:
    process.stdin.write(line + "\n")
    process.stdin.flush()
    return process.stdout.readline()


def measure(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="kvtrace-proxy-throughput-") as scratch:
        workdir = Path(scratch)
        env = {"KVTRACE_SPOOL_DIR": str(workdir / "spool"), "XDG_DATA_HOME": str(workdir / "data"),
               "KVTRACE_RUN_ID": "proxy-throughput"}
        reading = ["--llama-server-log"]  # the arm's own log follows
        pinned = ["--pin-workers"]
        arms = {"streams": {"workers 1": [], "workers 2": ["--workers", "2"], "workers 1 pinned": pinned,
                            "workers 2 pinned": ["--workers", "2", *pinned]},
                "requests": {"relay": [], "traced": [], "traced+log": reading, "traced+log+known": reading}}
        if args.floor:
            arms["requests"] = {"floor": [], **arms["requests"]}
        arms = {mode: named for mode, named in arms.items() if args.only in (None, mode)}
        if args.baseline is not None:
            arms = {mode: {**named, **{f"{name} (baseline)": extra for name, extra in named.items()
                                       if name != "floor" and pinned[0] not in extra}}  # an older tree may lack it
                    for mode, named in arms.items()}
        labels = {name: name.replace(" (baseline)", "-baseline").replace(" ", "-").replace("+", "-")
                  for named in arms.values() for name in named}
        # Each proxy that reads a log has a port and a log of its own: another proxy's tasks in its log would
        # be parsed on its CPU, which no proxy in front of a server only it calls does.
        logs = {name: workdir / f"server-{labels[name]}.log" for named in arms.values()
                for name, extra in named.items() if extra == reading}
        fake = _helper("upstream", args, *(f"--log={log}" for log in logs.values()))
        ports = fake.stdout.readline().split()
        upstreams = [f"http://127.0.0.1:{port}" for port in ports]  # the first also serves the arms without a log
        own_upstream = dict(zip(logs, upstreams))
        client = _helper("client", args)
        proxies: dict[str, Proxy] = {}
        try:
            for mode, named in arms.items():
                for name, extra in named.items():
                    own = {**env, "KVTRACE_DISABLED": "1"} if name.startswith("relay") else dict(env)
                    if name.endswith("(baseline)"):
                        own["PYTHONPATH"] = str(args.baseline.resolve())
                    extra = [*extra, str(logs[name])] if name in logs else extra
                    proxies[name] = Proxy(labels[name], own_upstream.get(name, upstreams[0]), workdir, extra, own)
            if args.profile:
                proxies["profiled"] = Proxy("profiled", upstreams[0], workdir, [], env, profile=args.profile)
            results: dict[str, list[dict]] = {name: [] for name in proxies}
            for round_number in range(args.rounds):
                for mode, named in arms.items():
                    order = list(named) if round_number % 2 == 0 else list(reversed(named))
                    for name in order:
                        results[name].append(_turn(client, proxies[name], mode, fake))
            if args.profile:
                results["profiled"].append(_turn(client, proxies["profiled"], "streams", fake))
            calls_before = calls = json.loads(_ask(fake, "calls"))
            if "traced+log" in proxies:
                _turn(client, proxies["traced+log"], "requests", fake)
                calls = json.loads(_ask(fake, "calls"))
        finally:
            for proxy in proxies.values():
                proxy.stop()
            for helper in (client, fake):
                helper.kill()
        report(args, results, {path: calls.get(path, 0) - calls_before.get(path, 0) for path in calls})


def _turn(client: subprocess.Popen, proxy: Proxy, mode: str, fake: subprocess.Popen) -> dict:
    user, system = proxy.cpu_times()
    apparatus = _process_cpu_s(client.pid) + _process_cpu_s(fake.pid)
    known = " known" if proxy.name.startswith("traced-log-known") else ""
    result = json.loads(_ask(client, f"{proxy.url} {mode}{known}"))
    result["apparatus_cpu_s"] = _process_cpu_s(client.pid) + _process_cpu_s(fake.pid) - apparatus
    user_after, system_after = _settled_cpu(proxy)
    result["cpu_s"] = user_after + system_after - user - system
    result["system_s"] = system_after - system
    if result["bad"]:
        raise SystemExit(f"{proxy.name}: {result['bad']} answers were not the server's (logprobs left, or an error)")
    return result


def _cpu_times(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of one process, every thread: system is the kernel's work for it."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / os.sysconf("SC_CLK_TCK"), int(fields[12]) / os.sysconf("SC_CLK_TCK")  # utime, stime


def _process_cpu_s(pid: int) -> float:
    """CPU seconds of one process (every thread): the client's or the fake's, which share the cores."""
    return sum(_cpu_times(pid))


def _settled_cpu(proxy: Proxy) -> tuple[float, float]:
    """The proxy's (user, system) CPU seconds once the records of the turn's requests are made (they are
    made after the answers, and would otherwise go uncounted, in another arm's turn)."""
    last = proxy.cpu_times()
    while True:
        time.sleep(0.5)
        now = proxy.cpu_times()
        if now == last:
            return now
        last = now


def _span(values: list[float], digits: int = 0) -> str:
    low, high = min(values), max(values)
    if round(low, digits) == round(high, digits):
        return f"{low:,.{digits}f}"
    return f"{low:,.{digits}f}–{high:,.{digits}f}"


def report(args: argparse.Namespace, results: dict[str, list[dict]], calls: dict[str, int]) -> None:
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; {args.rounds} rounds of "
          f"{args.seconds:g} s per arm, concurrency {args.concurrency}, ranges over the rounds")
    per_write = args.events_per_write or "all"
    print(f"streams ({args.tokens} tokens each, {per_write} events per upstream write):")
    rates, cost = {}, {}
    for name, runs in results.items():
        if not runs:
            continue
        if runs[0]["tokens"]:
            rates[name] = [r["tokens"] / r["wall_s"] for r in runs]
            print(f"  {name:<22} {_span(rates[name]):>16} tokens/s   CPU "
                  f"{_span([r['cpu_s'] / r['tokens'] * 1e6 for r in runs], 1):>12} µs/token (kernel "
                  f"{_span([r['system_s'] / r['tokens'] * 1e6 for r in runs], 1)})   "
                  f"{_span([r['cpu_s'] / r['wall_s'] for r in runs], 2):>10} CPU s/s   client and fake "
                  f"{_span([r['apparatus_cpu_s'] / r['wall_s'] for r in runs], 2)} CPU s/s")
    # Like with like (free against free, pinned against pinned), the pinned two against the default one, and
    # what pinning itself gives two workers.
    scaling = {(two, one): [b / a for a, b in zip(rates.get(one, []), rates.get(two, []))]
               for two, one in (("workers 2", "workers 1"), ("workers 2 pinned", "workers 1 pinned"),
                                ("workers 2 pinned", "workers 1"), ("workers 2 pinned", "workers 2"),
                                ("workers 2 (baseline)", "workers 1 (baseline)"))}
    for (two, one), ratios in scaling.items():
        if ratios:
            print(f"  {two} / {one} (paired by round): {_span(ratios, 2)}× (median {statistics.median(ratios):.2f})")
    targets = []
    if "workers 1" in rates:
        one = [r["cpu_s"] / r["tokens"] * 1e6 for r in results["workers 1"]]
        targets += [verdict("CPU a streamed token, one worker", statistics.median(one), 30, "µs"),
                    verdict("streamed tokens, one worker", statistics.median(rates["workers 1"]), 30_000, "a second",
                            at_least=True)]
    for two, one in (("workers 2", "workers 1"), ("workers 2 pinned", "workers 1 pinned")):
        if scaling[two, one]:
            targets.append(verdict(f"{two} / {one}", statistics.median(scaling[two, one]), 1.7, "×", at_least=True))
    print(f"requests (non-streamed chat, one token, {'one prompt' if args.repeat_prompts else 'a prompt each'}):")
    for name, runs in results.items():
        if runs and not runs[0]["tokens"]:
            cost[name] = [r["cpu_s"] / r["requests"] * 1e6 for r in runs]
            print(f"  {name:<22} {_span([r['requests'] / r['wall_s'] for r in runs]):>16} requests/s   CPU "
                  f"{_span(cost[name]):>12} µs/request, in the kernel "
                  f"{_span([r['system_s'] / r['requests'] * 1e6 for r in runs]):>9}")
    for suffix in ("", " (baseline)"):
        if f"relay{suffix}" not in cost:
            continue
        relay, traced, logged, known = (cost[f"{name}{suffix}"]
                                        for name in ("relay", "traced", "traced+log", "traced+log+known"))
        print(f"  each part's share of a traced request's CPU{suffix} (paired by round):")
        print(f"    relay (HTTP both ways)                   {_span(relay):>12} µs")
        print(f"    the cut, record and span                 {_span([b - a for a, b in zip(relay, traced)]):>12} µs")
        print(f"    llama-server log, the task's match       {_span([b - a for a, b in zip(traced, known)]):>12} µs")
        print(f"    integrity calls (/apply-template, /tokenize) {_span([b - a for a, b in zip(known, logged)]):>8} µs")
        print(f"    everything (traced+log)                  {_span(logged):>12} µs")
        if "floor" in cost and not suffix:
            print(f"  relay / floor (paired by round): CPU {_span([a / b for a, b in zip(relay, cost['floor'])], 2)}×")
    if "traced+log" in cost:
        targets.append(verdict("CPU a request, traced+log", statistics.median(cost["traced+log"]), 1000, "µs"))
    if targets:
        print("targets (medians over the rounds): " + "; ".join(targets))
    if "relay" not in cost:
        return
    completions = calls.get("/v1/chat/completions", 0) or 1
    print(f"    upstream calls per request: /apply-template {calls.get('/apply-template', 0) / completions:.2f}, "
          f"/tokenize {calls.get('/tokenize', 0) / completions:.2f}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=4.0, help="seconds per arm and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=32, help="client connections at once")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per streamed answer")
    parser.add_argument("--events-per-write", type=int, default=0, metavar="N",
                        help="events the fake server writes at once (default 0: a whole answer)")
    parser.add_argument("--only", choices=("streams", "requests"), default=None, help="run these arms alone")
    parser.add_argument("--repeat-prompts", action="store_true",
                        help="every request with the same prompt (default: each its own, as real traffic)")
    parser.add_argument("--baseline", type=Path, default=None, metavar="TREE",
                        help="pair every arm with a proxy that imports kvtrace from this source tree")
    parser.add_argument("--profile", type=Path, default=None, metavar="FILE",
                        help="also run a one-worker proxy under cProfile for the streams arm; its stats to FILE")
    parser.add_argument("--floor", action="store_true",
                        help="also run a bare relay (a thread per connection, httptools, nothing else) as the "
                             "requests' floor")
    parser.add_argument("--role", choices=("upstream", "client", "floor"), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--upstream", default="", help=argparse.SUPPRESS)
    parser.add_argument("--log", type=Path, action="append", default=[], help=argparse.SUPPRESS)
    return parser.parse_args()


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.role == "upstream":
        run_fake(arguments)
    elif arguments.role == "client":
        run_client(arguments)
    elif arguments.role == "floor":
        run_floor(arguments)
    else:
        measure(arguments)
