"""``kvtrace proxy``: a reverse proxy that traces the requests of servers kvtrace cannot patch.

Clients point at the proxy instead of the server and change nothing else. The completion
endpoints (:data:`margin_request.ENDPOINTS`) become ``kvtrace.request`` spans in the vocabulary
of the in-process patches; every other path is forwarded untouched.

Per traced request:

* **Correlation** comes from the request's W3C ``traceparent`` / ``baggage`` (run, episode, turn,
  arm; the span's parent), which are forwarded to the upstream as received.
* **Margins**: :mod:`margin_request` asks the upstream for the top two alternatives when the
  client did not ask for logprobs and cuts them out of the answer; otherwise the client's own
  logprobs are used and its answer passes untouched.
* **The answer is read after the client has it** (:mod:`answers`): the proxy keeps the upstream's
  documents and parses them once the last byte went out, so the only work between a chunk's
  arrival and its forwarding is cutting the added members out of it (nothing at all when none
  were added).
* **Failures**: an upstream error status passes through unchanged (status, headers, body) and is
  recorded on the span; an unreachable upstream gets a 502 from the proxy, recorded too. Tracing
  never fails a request: if reading the request, planning or recording goes wrong, the request is
  forwarded as the client sent it and the failure is counted (``instrumentation_errors``).

The app is plain ASGI (served by uvicorn); the upstream is reached through one pooled
``httpx.AsyncClient``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
from collections import OrderedDict, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import httpx
from opentelemetry import context as otel_context
from opentelemetry import propagate

from kvtrace import semconv as sc
from kvtrace.outside import answers
from kvtrace.outside.llama_server_log import LogFollower, TaskDecision
from kvtrace.outside.margin_request import (ENDPOINTS, NATIVE, OPENAI_COMPATIBLE, MarginPlan, UpstreamProfile, cut,
                                            plan_request)
from kvtrace.outside.openai_exchange import TextHasher, fill_record, parse_exchange
from kvtrace.recording.recorder import Recorder, get_recorder
from kvtrace.recording.records import CacheEvent, RequestRecord, StateOrigin

log = logging.getLogger("kvtrace.proxy")

HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                        "transfer-encoding", "upgrade", "host", "content-length"})
"""Headers that belong to one connection, not to the request (RFC 9110 §7.6.1), plus the two the
proxy recomputes."""
RESPONSE_DROPPED = HOP_BY_HOP | {"content-encoding"}
"""The proxy asks the upstream for identity encoding, so a content-encoding never applies."""


def _last_event_end(buffer: bytes) -> int:
    """Where the last complete server-sent event in ``buffer`` ends (0: none yet); LF or CRLF lines."""
    lf, crlf = buffer.rfind(b"\n\n"), buffer.rfind(b"\r\n\r\n")
    return max(lf + 2 if lf != -1 else 0, crlf + 4 if crlf != -1 else 0)


@dataclass
class Traced:
    """One traced request on its way: the record, the client's request and the margin plan."""

    record: RequestRecord
    request: dict[str, Any]
    plan: MarginPlan
    profile: UpstreamProfile
    task: Optional[TaskDecision] = None
    """llama-server's task for this request, from its log (``--llama-server-log``)."""
    overlapped: bool = False
    """Another request was in flight with this one: its task cannot be told from the log alone."""


class UpstreamProfiles:
    """What kind of server the upstream is (asked once: ``/props`` answers only on llama-server)."""

    def __init__(self, client: httpx.AsyncClient):
        self._client = client
        self._known: Optional[UpstreamProfile] = None
        self._lock = asyncio.Lock()

    async def get(self) -> UpstreamProfile:
        if self._known is not None:
            return self._known
        async with self._lock:
            if self._known is None:
                self._known = await self._detect()
        return self._known or OPENAI_COMPATIBLE

    async def _detect(self) -> Optional[UpstreamProfile]:
        try:
            props = await self._client.get("/props", timeout=10.0)
            if props.status_code == 200:
                document = props.json()
                if isinstance(document, dict) and "default_generation_settings" in document:
                    return llama_server_profile(document)
            models = await self._client.get("/v1/models", timeout=10.0)
            if models.status_code == 200:
                data = (models.json().get("data") or [{}])[0]
                owner = str(data.get("owned_by", "")).lower()
                return UpstreamProfile(engine="vllm" if owner == "vllm" else OPENAI_COMPATIBLE.engine)
        except (httpx.HTTPError, ValueError, AttributeError, IndexError, TypeError):
            log.debug("kvtrace proxy: the upstream's kind could not be told yet", exc_info=True)
            return None  # asked again with the next request
        return OPENAI_COMPATIBLE


def llama_server_profile(props: dict[str, Any]) -> UpstreamProfile:
    """llama-server's ``GET /props``: its version, slot count and defaults."""
    defaults = props.get("default_generation_settings") or {}
    params = defaults.get("params") if isinstance(defaults.get("params"), dict) else {}
    slots = props.get("total_slots")
    settings = {"total_slots": slots, "n_ctx": defaults.get("n_ctx"), "model_path": props.get("model_path"),
                "cache_prompt_default": params.get("cache_prompt")}
    return UpstreamProfile(
        engine="llama-server",
        llama_server=True,
        default_n_probs=int(params.get("n_probs") or 0),
        default_post_sampling_probs=bool(params.get("post_sampling_probs")),
        version=str(props.get("build_info") or ""),
        weight_format=weight_format_name(str(props.get("model_ftype") or "")),
        total_slots=slots if isinstance(slots, int) else None,
        settings={k: v for k, v in settings.items() if v is not None},
    )


_SIZES = {"Small": "S", "Medium": "M", "Large": "L"}


def weight_format_name(ftype: str) -> str:
    """llama.cpp's file-type name (``all F32``, ``Q4_K - Medium``) as kvtrace names formats (F32, Q4_K_M)."""
    name = ftype.removesuffix(" (guessed)").removeprefix("all ").strip()
    name, _, detail = name.partition(" - ")
    return f"{name}_{_SIZES[detail]}" if detail in _SIZES else name


class ProxyApp:
    """The ASGI application."""

    def __init__(self, upstream: str, recorder: Callable[[], Optional[Recorder]] = get_recorder,
                 client: Optional[httpx.AsyncClient] = None, llama_server_log: Optional[Path] = None):
        self.upstream = upstream.rstrip("/")
        self.provenance = TaskProvenance(LogFollower(llama_server_log)) if llama_server_log else None
        self._recorder = recorder
        # No read time-out: a generation takes as long as it takes, as it would without the proxy.
        self.client = client or httpx.AsyncClient(
            base_url=self.upstream, timeout=httpx.Timeout(connect=30.0, read=None, write=None, pool=None),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        self.profiles = UpstreamProfiles(self.client)
        self._hasher: Optional[TextHasher] = None

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        body = await _read_body(receive)
        endpoint = ENDPOINTS.get(scope["path"]) if scope["method"] == "POST" else None
        traced = await self._begin(scope, endpoint, body) if endpoint else None
        upstream_body = body
        if traced is not None and traced.plan.injected:
            upstream_body = json.dumps(traced.plan.upstream_request, ensure_ascii=False).encode("utf-8")
        request = self.client.build_request(scope["method"], _target(scope), headers=_forwarded_headers(scope),
                                            content=upstream_body)
        if traced is not None and self.provenance is not None:
            self.provenance.sent(traced)
        try:
            response = await self.client.send(request, stream=True)
        except httpx.HTTPError as exc:
            message = f"kvtrace proxy: the upstream {self.upstream} could not be reached: {exc}"
            await _send_whole(send, 502, [(b"content-type", b"application/json")],
                              json.dumps({"error": {"code": 502, "message": message, "type": "upstream_unreachable"}})
                              .encode())
            if traced is not None:
                self._finish_error(traced, 502, message)
            return
        try:
            if traced is None or response.status_code >= 400:
                await self._pass_through(response, send, traced)
            elif response.headers.get("content-type", "").startswith("text/event-stream"):
                await self._stream(response, send, receive, traced)
            else:
                await self._whole(response, send, traced)
        finally:
            await response.aclose()

    # --- the three ways an answer goes back ----------------------------------------------

    async def _pass_through(self, response: httpx.Response, send: Callable, traced: Optional[Traced]) -> None:
        await send({"type": "http.response.start", "status": response.status_code,
                    "headers": _response_headers(response)})
        kept = bytearray()
        async for piece in response.aiter_bytes():
            await send({"type": "http.response.body", "body": piece, "more_body": True})
            if traced is not None and len(kept) < 4096:
                kept += piece
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        if traced is not None:
            self._finish_error(traced, response.status_code, _error_message(bytes(kept)))

    async def _whole(self, response: httpx.Response, send: Callable, traced: Traced) -> None:
        try:
            body = await response.aread()
        except httpx.HTTPError as exc:
            message = f"kvtrace proxy: the upstream {self.upstream} broke off its answer: {exc}"
            await _send_whole(send, 502, [(b"content-type", b"application/json")],
                              json.dumps({"error": {"code": 502, "message": message, "type": "upstream_broke_off"}})
                              .encode())
            self._finish_error(traced, 502, message)
            return
        out = body
        if traced.plan.injected:
            try:
                out = cut(traced.plan, body.decode("utf-8")).encode("utf-8")
            except Exception:
                # The answer could not be read as JSON: it goes back as the upstream sent it.
                self._count_failure("cutting the added logprobs from an answer")
        await _send_whole(send, response.status_code, _response_headers(response), out)
        await self._find_task(traced)
        self._finish(traced, response.status_code,
                     lambda: answers.whole_answer(traced.plan.endpoint, body.decode("utf-8")))

    async def _stream(self, response: httpx.Response, send: Callable, receive: Callable, traced: Traced) -> None:
        await send({"type": "http.response.start", "status": response.status_code,
                    "headers": _response_headers(response)})
        gone = asyncio.Event()
        watcher = asyncio.ensure_future(_wait_for_disconnect(receive, gone))
        kept = bytearray()
        try:
            broken = await self._relay(response, send, traced.plan, kept, gone)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            watcher.cancel()
        raw = bytes(kept)
        await self._find_task(traced)
        self._finish(traced, response.status_code, lambda: answers.streamed_answer(traced.plan.endpoint, raw),
                     cancelled=gone.is_set(), broken=broken)

    async def _relay(self, response: httpx.Response, send: Callable, plan: MarginPlan, kept: bytearray,
                     gone: asyncio.Event) -> Optional[str]:
        """Forward a stream chunk by chunk, keeping what the upstream sent; why it broke off, if it did.

        Without added logprobs every chunk goes on as it arrived. With them, an event must be whole
        before its added members can be cut, so a chunk waits only for the rest of its event.
        """
        pending = b""
        try:
            async for piece in response.aiter_bytes():
                if gone.is_set():
                    return None  # the client left; closing the upstream stream stops the generation
                kept += piece
                if not plan.injected:
                    await send({"type": "http.response.body", "body": piece, "more_body": True})
                    continue
                pending += piece
                end = _last_event_end(pending)
                if end:
                    events, pending = pending[:end], pending[end:]
                    await send({"type": "http.response.body", "body": self._cut_events(plan, events),
                                "more_body": True})
        except httpx.HTTPError as exc:
            # The client's stream ends where the upstream's did, as it would without the proxy.
            return f"the upstream broke off the stream: {exc}"
        finally:
            if pending and not gone.is_set():
                await send({"type": "http.response.body", "body": self._cut_events(plan, pending),
                            "more_body": True})
        return None

    def _cut_events(self, plan: MarginPlan, events: bytes) -> bytes:
        try:
            lines = events.decode("utf-8").split("\n")
            for i, line in enumerate(lines):
                if line.startswith("data:"):
                    start = line.find("{")
                    if start != -1:
                        lines[i] = line[:start] + cut(plan, line[start:])
            return "\n".join(lines).encode("utf-8")
        except Exception:
            self._count_failure("cutting the added logprobs from a stream event")
            return events

    # --- tracing: never fails the request ---------------------------------------------------

    async def _find_task(self, traced: Traced) -> None:
        if self.provenance is None:
            return
        try:
            await self.provenance.find(traced)
        except Exception:
            self._count_failure("reading llama-server's log")

    async def _begin(self, scope: dict, endpoint: str, body: bytes) -> Optional[Traced]:
        try:
            recorder = self._recorder()
            if recorder is None:
                return None
            request = json.loads(body)
            if not isinstance(request, dict):
                return None  # the upstream will say what is wrong with it
            profile = await self.profiles.get()
            plan = plan_request(endpoint, request, profile)
            token = otel_context.attach(propagate.extract(_header_carrier(scope)))
            try:
                record = recorder.start_request(profile.engine, model=str(request.get("model") or ""))
            finally:
                otel_context.detach(token)
            return Traced(record, request, plan, profile)
        except ValueError:
            return None  # not JSON: forwarded as it is, the upstream answers it
        except Exception:
            self._count_failure("starting a request record")
            return None

    def _finish(self, traced: Traced, status: int, read_answer: Callable[[], answers.UpstreamAnswer],
                cancelled: bool = False, broken: Optional[str] = None) -> None:
        try:
            recorder = self._recorder()
            if recorder is None:
                return
            try:
                answer = read_answer()
            except Exception as exc:
                # Still a span: the request happened; what kvtrace could not read is said on it.
                self._finish_error(traced, status, f"kvtrace could not read the answer ({type(exc).__name__}: "
                                                   f"{str(exc)[:200]})")
                return
            response = answer.response
            choice = response["choices"][0] if response.get("choices") else {}
            if not isinstance(choice.get("logprobs"), dict):
                choice["logprobs"] = {"content": []}  # no margins: tokens unknown, the rest still read
            if self._hasher is None:
                self._hasher = TextHasher(recorder.settings.hash_key)
            exchange = parse_exchange(traced.request, response, self._hasher, recorder.hash_tokens)
            record = traced.record
            reused = exchange.cached_tokens if exchange.cached_tokens is not None else 0
            fill_record(record, exchange, reused, exchange.cached_tokens_source, sc.LAYER_KV_REUSE)
            if traced.plan.endpoint == NATIVE:
                record.operation = sc.OPERATION_TEXT_COMPLETION
            self._configure(traced, status)
            record.config[sc.MARGIN_UNIT] = answer.margin_unit if record.margins else None
            slot = answer.slot if answer.slot is not None else (0 if traced.profile.total_slots == 1 else None)
            record.config[sc.SERVER_SLOT_ID] = slot
            if cancelled:
                record.finish_reason = sc.FINISH_CANCELLED
            if answer.error or broken:
                record.error = f"upstream error: {answer.error}" if answer.error else broken
            if self.provenance is not None:
                self.provenance.describe(traced, record)
            if record.reused_tokens > 0:
                # What the server reported reusing, as the engine patches record a reuse.
                record.events.append(CacheEvent(sc.EVENT_CACHE_REUSE, record.cache_layer, outcome=sc.OUTCOME_HIT,
                                                tokens=record.reused_tokens, source=record.state_origin))
            recorder.finish(record)
            if self.provenance is not None:
                self.provenance.finished(traced, record)
        except Exception:
            self._count_failure("recording a request")

    def _finish_error(self, traced: Traced, status: int, message: str) -> None:
        try:
            recorder = self._recorder()
            if recorder is None:
                return
            self._configure(traced, status)
            if self.provenance is not None:
                self.provenance.abandon(traced)
            traced.record.error = f"upstream HTTP {status}: {message}" if status >= 400 and status != 502 else message
            recorder.finish(traced.record)
        except Exception:
            self._count_failure("recording a failed request")

    def _configure(self, traced: Traced, status: int) -> None:
        record, profile, request = traced.record, traced.profile, traced.request
        record.config[sc.PROXY_UPSTREAM] = self.upstream
        record.config[sc.HTTP_RESPONSE_STATUS_CODE] = status
        record.config[sc.MARGIN_SOURCE] = traced.plan.source
        if profile.version:
            record.config[sc.ENGINE_VERSION] = profile.version
        if profile.weight_format:
            record.config[sc.MODEL_WEIGHT_FORMAT] = profile.weight_format
        cache = dict(profile.settings)
        if self.provenance is not None:
            cache.update(self.provenance.follower.parser.settings)
        if "cache_prompt" in request:
            cache["cache_prompt"] = request["cache_prompt"]
        for name in ("cache_salt", "id_slot"):
            if name in request:
                cache[name] = request[name] if name == "id_slot" else True  # a salt is a secret
        record.config[sc.CACHE_SETTINGS] = cache or None

    def _count_failure(self, what: str) -> None:
        try:
            recorder = self._recorder()
            if recorder is not None:
                recorder.pipeline.counters["instrumentation_errors"] += 1
            log.warning("kvtrace proxy: %s failed; the request went through untraced", what, exc_info=True)
        except Exception:
            pass

    async def _lifespan(self, receive: Callable, send: Callable) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.client.aclose()
                recorder = self._recorder()
                if recorder is not None:
                    recorder.pipeline.force_flush()
                await send({"type": "lifespan.shutdown.complete"})
                return


class TaskProvenance:
    """Requests ↔ llama-server tasks (from its log), and what the server's prompt cache did for each.

    llama-server starts tasks in the order requests reach it, so the tasks its log shows starting
    are given, in order, to the requests sent and not yet given one. That is certain only for a
    request that was alone in flight; one that overlapped another keeps the task it was given only
    as ``ambiguous`` (no cache event is attributed), and a task whose prompt length differs from the
    request's is not taken at all. A restore names the request whose task stored the state.
    """

    WAIT_S = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1)
    """Pauses to wait for the log to show a finished request's task (llama-server writes it from a thread)."""

    def __init__(self, follower: LogFollower):
        self.follower = follower
        self._waiting: deque[Traced] = deque()
        self._started: deque[TaskDecision] = deque()
        self._origins: OrderedDict[int, StateOrigin] = OrderedDict()

    def sent(self, traced: Traced) -> None:
        if self._waiting:
            traced.overlapped = True
            for other in self._waiting:
                other.overlapped = True
        self._waiting.append(traced)

    def abandon(self, traced: Traced) -> None:
        """A request that failed before a task started (the upstream refused it)."""
        if traced in self._waiting:
            self._waiting.remove(traced)

    async def find(self, traced: Traced) -> None:
        for pause in (0.0, *self.WAIT_S):
            if pause:
                await asyncio.sleep(pause)
            self._started.extend(self.follower.poll())
            while self._started and self._waiting:
                self._waiting.popleft().task = self._started.popleft()
            if traced not in self._waiting:
                return
        self.abandon(traced)  # its task never showed: it gets none

    def describe(self, traced: Traced, record: RequestRecord) -> None:
        decision = traced.task
        if decision is None:
            record.config[sc.SERVER_TASK_MATCH] = sc.TASK_MATCH_NONE
            return
        if decision.prompt_tokens is not None and record.prompt_tokens and decision.prompt_tokens != record.prompt_tokens:
            traced.task = None  # not this request's task after all
            record.config[sc.SERVER_TASK_MATCH] = sc.TASK_MATCH_NONE
            return
        if traced.overlapped:
            record.config[sc.SERVER_TASK_MATCH] = sc.TASK_MATCH_AMBIGUOUS
            return
        record.config[sc.SERVER_TASK_MATCH] = sc.TASK_MATCH_LOG
        record.config[sc.SERVER_SLOT_ID] = decision.slot
        record.config[sc.SERVER_TASK_ID] = decision.task
        restore = decision.restore
        if restore is not None:
            origin = self._origins.get(restore.source_task) if restore.source_task is not None else None
            record.events.append(CacheEvent(
                sc.EVENT_CACHE_RESTORE, sc.LAYER_PROMPT_CACHE, outcome=sc.OUTCOME_HIT, tokens=restore.length,
                prefix_tokens=restore.common_prefix, source=origin,
                reason=None if origin is not None else sc.REASON_SOURCE_UNKNOWN))
            if record.reused_tokens > 0:
                record.cache_layer = sc.LAYER_PROMPT_CACHE
                record.state_origin = origin
        elif decision.looked_up:
            record.events.append(CacheEvent(sc.EVENT_CACHE_LOOKUP, sc.LAYER_PROMPT_CACHE, outcome=sc.OUTCOME_MISS))

    def finished(self, traced: Traced, record: RequestRecord) -> None:
        if traced.task is not None and not traced.overlapped:
            self._origins[traced.task.task] = record.origin()
            while len(self._origins) > 4096:
                self._origins.popitem(last=False)


# --- HTTP plumbing ---------------------------------------------------------------------------


async def _read_body(receive: Callable) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            break
    return b"".join(chunks)


async def _wait_for_disconnect(receive: Callable, gone: asyncio.Event) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            gone.set()
            return


def _target(scope: dict) -> str:
    query = scope.get("query_string") or b""
    path = scope.get("raw_path") or scope["path"].encode()
    return (path + (b"?" + query if query else b"")).decode("latin-1")


def _header_carrier(scope: dict) -> dict[str, str]:
    carrier: dict[str, str] = {}
    for name, value in scope.get("headers") or ():
        key, text = name.decode("latin-1").lower(), value.decode("latin-1")
        carrier[key] = f"{carrier[key]},{text}" if key in carrier else text
    return carrier


def _forwarded_headers(scope: dict) -> list[tuple[bytes, bytes]]:
    headers = [(name, value) for name, value in scope.get("headers") or ()
               if name.decode("latin-1").lower() not in HOP_BY_HOP and name.lower() != b"accept-encoding"]
    headers.append((b"accept-encoding", b"identity"))
    return headers


def _response_headers(response: httpx.Response) -> list[tuple[bytes, bytes]]:
    return [(name, value) for name, value in response.headers.raw if name.decode("latin-1").lower()
            not in RESPONSE_DROPPED]


async def _send_whole(send: Callable, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": headers + [(b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _error_message(body: bytes) -> str:
    try:
        document = json.loads(body)
        error = document.get("error") if isinstance(document, dict) else None
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])[:500]
        if isinstance(error, str):
            return error[:500]
    except ValueError:
        pass
    return body[:300].decode("utf-8", "replace")


def serve(upstream: str, host: str, port: int, llama_server_log: Optional[Path] = None) -> None:
    """Run the proxy until interrupted (uvicorn, one process, no access log)."""
    import uvicorn

    app = ProxyApp(upstream, llama_server_log=llama_server_log)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                            server_header=False, date_header=False, lifespan="on")
    # SIGTERM / Ctrl-C are how a proxy is stopped: uvicorn shuts down gracefully (the lifespan flushes
    # the spans) and then raises the signal again; these handlers take it, so the process ends
    # normally and the recorder's exit handler runs.
    for stop in (signal.SIGINT, signal.SIGTERM):
        signal.signal(stop, lambda number, frame: None)
    uvicorn.Server(config).run()
