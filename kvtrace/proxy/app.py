"""``kvtrace proxy``: a reverse proxy that traces the requests of servers kvtrace cannot patch.

Clients point at the proxy instead of the server and change nothing else. The completion
endpoints (:data:`margin_request.ENDPOINTS`) become ``kvtrace.request`` spans in the vocabulary
of the in-process patches; every other path is forwarded untouched.

Per traced request:

* **Correlation** comes from the request's W3C ``traceparent`` / ``baggage`` (run, episode, turn,
  arm; the span's parent). The upstream gets the client's baggage and the proxy's span as its
  parent, so a server kvtrace traces too records its span as the proxy span's child, in the
  client's trace, and the saved queries count the request once (``requests_once``).
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
* **llama-server's log** (``--llama-server-log``): :mod:`kvtrace.llama_server.tasks` ties each request to
  its task (the proxy may add a marker to the upstream request for it) and checks the state the
  task kept.

HTTP/1.1 is parsed by httptools on both sides: :mod:`http1` serves the clients (blocking sockets, a
thread per connection, the limits of docs/proxy-limits.md), :mod:`upstream` talks to the server over
connections kept alive, and never sends a request twice.
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import msgspec
from opentelemetry import context as otel_context
from opentelemetry import propagate

from kvtrace import semconv as sc
from kvtrace.credentials import without_password
from kvtrace.errors import ConfigError
from kvtrace.exchanges.exchange import TextHasher, fill_record, parse_exchange
from kvtrace.exchanges.recorder import trace_headers
from kvtrace.json_decode import loads
from kvtrace.llama_server.log import LogFollower, TaskDecision
from kvtrace.llama_server.tasks import (MARKER_FIELD, Fingerprint, TaskProvenance, fingerprint, json_post,
                                        server_tokenizer)
from kvtrace.proxy import answers
from kvtrace.proxy.background import Background
from kvtrace.proxy.cpu_affinity import cpu_of_worker, keep_to
from kvtrace.proxy.heap import PeriodicTrim, collect_less_often, limit_arenas
from kvtrace.proxy.http1 import ClientGone, Headers, Request, Responder, Server
from kvtrace.proxy.limits import Limits, ShadowBudget
from kvtrace.proxy.margin_request import (ENDPOINTS, NATIVE, MarginPlan, UpstreamProfile, cut,
                                          plan_request, with_marker)
from kvtrace.proxy.record_settings import request_cache_settings, server_settings
from kvtrace.proxy.shadow import Shadows, refuse_without_bypass
from kvtrace.proxy.shadow_ledger import ShadowLedger
from kvtrace.proxy.upstream import Upstream, UpstreamBrokeOff, UpstreamResponse, UpstreamUnreachable
from kvtrace.proxy.upstream_profile import UpstreamProfiles
from kvtrace.recording.recorder import Recorder, get_recorder
from kvtrace.recording.records import CacheEvent, RequestRecord

log = logging.getLogger("kvtrace.proxy")

HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
                        b"trailer", b"transfer-encoding", b"upgrade"})
"""Headers that belong to one connection, not to the message (RFC 9110 §7.6.1)."""
FORWARD_DROPPED = HOP_BY_HOP | {b"host", b"content-length", b"expect", b"accept-encoding"}
"""Not forwarded upstream: the proxy frames the request itself and asks for identity encoding."""
RESPONSE_DROPPED = HOP_BY_HOP | {b"content-length", b"content-encoding"}
"""Not copied into the client's answer: the proxy frames it itself (the upstream was asked for identity)."""
_RESPONSE_DROPPED_BUT_LENGTH = RESPONSE_DROPPED - {b"content-length"}
RECORDS_IN_FLIGHT = 64
"""Records made on threads of their own at once; beyond it one is made on its client's connection thread, which
holds that client's next request. A record waiting for the record of the state its task kept is parked and holds
no thread (:meth:`TaskProvenance.when_settled`); what holds one is reading the log and the integrity check's calls.
With 1,024 a saturated proxy ran a thousand threads, and opened and closed upstream connections past the 64 it
keeps idle: 1.95-2.28 ms of CPU a request against 1.61-1.83 with 64 (docs/findings.md)."""


def _last_event_end(buffer: bytes) -> int:
    """Where the last complete server-sent event in ``buffer`` ends (0: none yet); LF or CRLF lines."""
    lf = buffer.rfind(b"\n\n")
    # Only a CRLF end past the LF one counts, so it is sought no further back (not across a whole answer).
    crlf = buffer.rfind(b"\r\n\r\n", max(lf - 1, 0))
    return max(lf + 2 if lf != -1 else 0, crlf + 4 if crlf != -1 else 0)


@dataclass
class Traced:
    """One traced request on its way: the record, the client's request and the margin plan."""

    record: RequestRecord
    request: dict[str, Any]
    plan: MarginPlan
    profile: UpstreamProfile
    target: str = ""
    """The path and query the client posted to (a shadow twin goes to the same)."""
    task: Optional[TaskDecision] = None
    """llama-server's task for this request, from its log (``--llama-server-log``)."""
    match: Optional[str] = None
    """How ``task`` was found (a ``TASK_MATCH_*`` value)."""
    marker: Optional[int] = None
    """The marker the proxy set on the upstream request (``kvtrace.llama_server.tasks``), if it could."""
    sent_at: tuple[int, int] = (0, 0)
    """Where llama-server's log ended when the request went upstream (``LogFollower.end``): no task logged
    before it is its own."""
    answer: Any = None
    """What the answer says about its task (``tasks.Fingerprint``), once read."""
    prompt_chain: Any = None
    """The prompt's token hash chain (``tasks.PromptChains``), for the integrity check."""


class ProxyApp:
    """The proxy: :meth:`handle` answers one client request (served by :class:`http1.Server`)."""

    def __init__(self, upstream: str, recorder: Callable[[], Optional[Recorder]] = get_recorder,
                 llama_server_log: Optional[Path] = None, shadow: Optional[ShadowBudget] = None,
                 ledger: Optional[ShadowLedger] = None, lane: tuple[int, int] = (0, 1)):
        self.upstream_url = upstream.rstrip("/")
        self.upstream = Upstream(self.upstream_url)
        self.provenance = TaskProvenance(LogFollower(llama_server_log), server_tokenizer(json_post(self.upstream)),
                                         lane) if llama_server_log else None
        self._recorder = recorder
        self.profiles = UpstreamProfiles(self.upstream)
        self._hasher: Optional[TextHasher] = None
        self.background = Background(RECORDS_IN_FLIGHT)
        self._upstream_records: set[int] = set()
        """``id`` of each traced request's record while this worker has it upstream (twins included), kept
        only for the shadow budget."""
        self.ledger = (ledger or ShadowLedger(shadow)) if shadow else None
        """The shadow budget's state, shared with the proxy's other workers."""
        self.shadows = Shadows(shadow, self.upstream, self.handle, self.count, self.others_upstream,
                               self.ledger.sent, self.ledger) if shadow else None

    def handle(self, request: Request, responder: Responder) -> None:
        endpoint = ENDPOINTS.get(request.path) if request.method == "POST" else None
        traced = self._begin(request, endpoint) if endpoint else None
        if traced is None or self.shadows is None:
            self._forward(request, responder, traced)
            return
        key = id(traced.record)
        self.ledger.request_sent()
        self._upstream_records.add(key)
        try:
            self._forward(request, responder, traced)
        finally:
            self._upstream_records.discard(key)
            self.ledger.request_back()

    def others_upstream(self, record: RequestRecord) -> int:
        """Traced requests upstream now through every worker, ``record``'s own left out."""
        return self.ledger.upstream() - (id(record) in self._upstream_records)

    def _forward(self, request: Request, responder: Responder, traced: Optional[Traced]) -> None:
        upstream_body = request.body
        if traced is not None and traced.plan.injected:
            upstream_body = _upstream_body(request.body, traced.request, traced.plan.upstream_request)
        if traced is not None and self.provenance is not None:
            self.provenance.sent(traced)
        headers = _forwarded_headers(request.headers)
        if traced is not None:
            headers = _with_trace_context(headers, traced.record)
        try:
            response = self.upstream.request(request.method, request.target, headers, upstream_body)
        except UpstreamUnreachable as exc:
            message = f"kvtrace proxy: the upstream {without_password(self.upstream_url)} could not be reached: {exc}"
            _send_error(responder, 502, "upstream_unreachable", message)
            if traced is not None:
                self._finish_error(traced, 502, message)
            return
        try:
            if traced is None or response.status >= 400:
                self._pass_through(response, responder, traced)
            elif response.header(b"content-type").startswith("text/event-stream"):
                self._stream(response, responder, traced)
            else:
                self._whole(response, responder, traced)
        finally:
            response.close()

    # --- the three ways an answer goes back ----------------------------------------------

    def _pass_through(self, response: UpstreamResponse, responder: Responder, traced: Optional[Traced]) -> None:
        # The upstream's length goes on only when it framed the body by it (not with transfer-encoding).
        keep_length = not response.header(b"transfer-encoding")
        responder.start(response.status, _response_headers(response, keep_length=keep_length))
        kept = bytearray()
        try:
            for piece in response.chunks():
                responder.send(piece)
                if traced is not None and len(kept) < 4096:
                    kept += piece
            responder.end()
        except UpstreamBrokeOff as exc:
            # The client's answer ends where the upstream's did (its connection closes, unfinished),
            # or, when nothing of it went out yet, is a 502.
            self._broke_off(responder, str(exc))
        except ClientGone:
            pass  # the client left
        if traced is not None:
            self._finish_error(traced, response.status, f"upstream HTTP {response.status}", _error_message(bytes(kept)))

    def _whole(self, response: UpstreamResponse, responder: Responder, traced: Traced) -> None:
        try:
            body = response.read()
        except UpstreamBrokeOff as exc:
            self._finish_error(traced, 502, self._broke_off(responder, str(exc)))
            return
        out = body
        if traced.plan.injected:
            try:
                out = cut(traced.plan, body.decode("utf-8")).encode("utf-8")
            except Exception:
                # The answer could not be read as JSON: it goes back as the upstream sent it.
                self._count_failure("cutting the added logprobs from an answer")
        responder.start(response.status, _response_headers(response) + [(b"content-length", str(len(out)).encode())])
        try:
            responder.end(out)
        except ClientGone:
            pass  # the client left; the request still happened and is recorded
        self._finish(traced, response.status, lambda: answers.whole_answer(traced.plan.endpoint, body.decode("utf-8")))

    def _stream(self, response: UpstreamResponse, responder: Responder, traced: Traced) -> None:
        responder.start(response.status, _response_headers(response))
        kept = bytearray()
        broken = self._relay(response, responder, traced.plan, kept)
        gone = responder.client_gone
        if broken is not None:
            self._broke_off(responder, broken)  # unfinished, as the upstream left it
        elif not gone:
            try:
                responder.end()
            except ClientGone:
                gone = True
        raw = bytes(kept)
        self._finish(traced, response.status, lambda: answers.streamed_answer(traced.plan.endpoint, raw),
                     cancelled=gone, broken=broken)

    def _relay(self, response: UpstreamResponse, responder: Responder, plan: MarginPlan,
               kept: bytearray) -> Optional[str]:
        """Forward a stream chunk by chunk, keeping what the upstream sent; why it broke off, if it did.

        Without added logprobs every chunk goes on as it arrived. With them, an event must be whole
        before its added members can be cut, so a chunk waits only for the rest of its event.
        """
        pending = b""
        try:
            for piece in response.chunks():
                # A client that left is noticed when a write to it fails (the second after it left):
                # then closing the upstream connection stops the generation.
                kept += piece
                if not plan.injected:
                    responder.send(piece)
                    continue
                pending += piece
                end = _last_event_end(pending)
                if end:
                    events, pending = pending[:end], pending[end:]
                    responder.send(self._cut_events(plan, events))
        except UpstreamBrokeOff as exc:
            return f"the upstream broke off the stream: {exc}"
        except ClientGone:
            return None  # the client left while a chunk was being written
        if pending:
            try:
                responder.send(self._cut_events(plan, pending))
            except ClientGone:
                pass
        return None

    def _broke_off(self, responder: Responder, why: str) -> str:
        """The upstream's answer ended before its end: a 502 if nothing went to the client yet (else its
        connection closes with the answer unfinished, as it would without the proxy); the message."""
        message = f"kvtrace proxy: the upstream {without_password(self.upstream_url)} broke off its answer: {why}"
        _send_error(responder, 502, "upstream_broke_off", message)
        return message

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

    def _read_log(self, traced: Traced, record: RequestRecord, recorder: Recorder, answer_fingerprint: Fingerprint,
                  cached_tokens: Optional[int], then: Callable[[], None]) -> None:
        """The request's task from llama-server's log, its cache decisions and their integrity, on the record;
        then ``then()``, the record's end. That waits for the record of the state the task kept: parked
        (:meth:`TaskProvenance.when_settled`), it holds no thread, and :meth:`close` still waits for it."""
        provenance = self.provenance
        try:
            provenance.find(traced, answer_fingerprint)
            tokens = provenance.prepare_chain(traced, recorder.settings.hash_key, traced.plan.endpoint)
            if tokens is not None:
                # The prompt's ids beside the text hash (which stays the prompt hash), under ids capture
                # only: what `kvtrace replay --server` sends again.
                record.config[sc.PROMPT_TOKEN_IDS] = recorder.capture.prompt_token_ids(tokens)
        except Exception:
            self.count("instrumentation_errors")
            log.warning("kvtrace proxy: reading llama-server's log for a request failed", exc_info=True)
        release = self.background.hold()

        def described() -> None:
            try:
                provenance.describe(traced, record, cached_tokens)
                provenance.remember(traced, record)
            except Exception:
                self.count("instrumentation_errors")
                log.warning("kvtrace proxy: reading llama-server's log for a request failed", exc_info=True)
            try:
                then()
            finally:
                provenance.abandon(traced)  # matched or not, it no longer waits for a task
                release()

        provenance.when_settled(traced, described)

    def _begin(self, request: Request, endpoint: str) -> Optional[Traced]:
        try:
            recorder = self._recorder()
            if recorder is None:
                return None
            body = loads(request.body)
            if not isinstance(body, dict):
                return None  # the upstream will say what is wrong with it
            profile = self.profiles.get()
            plan = plan_request(endpoint, body, profile)
            marker = None
            if self.provenance is not None:
                candidate = self.provenance.next_marker()
                marked = with_marker(plan, body, profile, MARKER_FIELD, candidate)
                if marked is not plan:
                    plan, marker = marked, candidate
            model = str(body.get("model") or "")
            if _carries_context(request.headers):
                token = otel_context.attach(propagate.extract(_header_carrier(request.headers)))
                try:
                    record = recorder.start_request(profile.engine, model=model)
                finally:
                    otel_context.detach(token)
            else:  # what the propagators would extract is the empty context this thread is in
                record = recorder.start_request(profile.engine, model=model)
            return Traced(record, body, plan, profile, target=request.target, marker=marker)
        except ValueError:
            return None  # not JSON: forwarded as it is, the upstream answers it
        except Exception:
            self._count_failure("starting a request record")
            return None

    def _finish(self, traced: Traced, status: int, read_answer: Callable[[], answers.UpstreamAnswer],
                cancelled: bool = False, broken: Optional[str] = None) -> None:
        """The request's record, made off the client's connection (:mod:`background`)."""
        self.background.run(lambda: self._record(traced, status, read_answer, cancelled, broken))

    def _record(self, traced: Traced, status: int, read_answer: Callable[[], answers.UpstreamAnswer],
                cancelled: bool, broken: Optional[str]) -> None:
        """Makes the record; with llama-server's log, its end may come later, on another thread
        (:meth:`_read_log`). The request is let go by the provenance (``abandon``) on every path."""
        handed_on = False
        try:
            try:
                recorder = self._recorder()
            except Exception:
                self._count_failure("finding the recorder")
                return
            if recorder is None:
                return
            try:
                # The decoded answer is let go here, before the log is waited on: dozens of records wait at once.
                record, answer_fingerprint, cached_tokens = self._filled(traced, recorder, status, read_answer(),
                                                                         cancelled, broken)
            except Exception as exc:
                # Still a span: the request happened; what kvtrace could not read is said on it.
                log.debug("kvtrace proxy: an answer could not be read", exc_info=True)
                self._finish_error(traced, status, f"kvtrace could not read the answer ({type(exc).__name__})",
                                   str(exc)[:200])
                return

            def recorded() -> None:
                if record.reused_tokens > 0:
                    # What the server reported reusing, as the engine patches record a reuse.
                    record.events.append(CacheEvent(sc.EVENT_CACHE_REUSE, record.cache_layer, outcome=sc.OUTCOME_HIT,
                                                    tokens=record.reused_tokens, source=record.state_origin))
                recorder.finish(record)  # never raises
                if self.shadows is not None:
                    try:
                        self.shadows.offer(traced.request, traced.target, traced.profile, record)
                    except Exception:
                        self.count("instrumentation_errors")
                        log.warning("kvtrace proxy: a shadow twin could not be sent", exc_info=True)

            if self.provenance is None:
                recorded()
                return
            handed_on = True
            self._read_log(traced, record, recorder, answer_fingerprint, cached_tokens, recorded)
        finally:
            if self.provenance is not None and not handed_on:
                self.provenance.abandon(traced)  # matched or not, it no longer waits for a task

    def _filled(self, traced: Traced, recorder: Recorder, status: int, answer: answers.UpstreamAnswer,
                cancelled: bool, broken: Optional[str]) -> tuple[RequestRecord, Fingerprint, Optional[int]]:
        """The request's record with what the answer says; the answer's fingerprint and cached tokens."""
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
        if answer.error:
            record.error, record.error_detail = "upstream error", answer.error
        elif broken:
            record.error = broken
        return record, fingerprint(response, answer.slot), exchange.cached_tokens

    def _finish_error(self, traced: Traced, status: int, message: str, detail: Optional[str] = None) -> None:
        """``message``: kvtrace's own words; ``detail``: the upstream's, kept as the capture policy says."""
        try:
            recorder = self._recorder()
            if recorder is None:
                return
            self._configure(traced, status)
            if self.provenance is not None:
                self.provenance.abandon(traced)
            traced.record.error, traced.record.error_detail = message, detail
            recorder.finish(traced.record)
        except Exception:
            self._count_failure("recording a failed request")

    def _configure(self, traced: Traced, status: int) -> None:
        record, profile, request = traced.record, traced.profile, traced.request
        config = record.config
        config[sc.PROXY_UPSTREAM] = without_password(self.upstream_url)  # every span carries it
        config[sc.HTTP_RESPONSE_STATUS_CODE] = status
        config[sc.MARGIN_SOURCE] = traced.plan.source
        # The server's steps are out of sight here; a traced engine behind the proxy records its own.
        record.batch_composition = sc.BATCH_UNKNOWN
        if profile.version:
            config[sc.ENGINE_VERSION] = profile.version
        if profile.weight_format:
            config[sc.MODEL_WEIGHT_FORMAT] = profile.weight_format
        # The same for every record of this server: derived once, kept as the spans' text.
        server = server_settings(profile, self.provenance.server_settings() if self.provenance is not None else None)
        if server.numerics_text is not None:
            config[sc.NUMERICS_SETTINGS] = server.numerics_text
        if server.kv_cache_type is not None:
            config[sc.KV_CACHE_TYPE] = server.kv_cache_type
        config[sc.CACHE_SETTINGS] = request_cache_settings(server, request)

    def _count_failure(self, what: str) -> None:
        self.count("instrumentation_errors")
        log.warning("kvtrace proxy: %s failed; the request went through untraced", what, exc_info=True)

    def count(self, name: str) -> None:
        """One more of the recorder's counter ``name`` (published with the span counters)."""
        try:
            recorder = self._recorder()
            if recorder is not None:
                recorder.pipeline.counters.add(name)
        except Exception:
            pass

    def close(self) -> None:
        # Records first: a record that is still being made may send its shadow twin (whose own record is then
        # made on the twin's thread).
        self.background.close()
        if self.shadows is not None:
            self.shadows.close()
        self.upstream.close()
        try:
            recorder = self._recorder()
            if recorder is not None:
                recorder.pipeline.force_flush()
        except Exception:
            log.warning("kvtrace proxy: the spans could not be flushed at shutdown", exc_info=True)


# --- HTTP plumbing ---------------------------------------------------------------------------


_propagated: tuple[Any, frozenset[bytes]] = (None, frozenset())
"""The global propagator and the header names it reads (lower case), looked up again when it is replaced."""


def _carries_context(headers: Headers) -> bool:
    """Whether the request has a header the global propagator reads (``traceparent``, ``baggage``, ...)."""
    global _propagated
    propagator = propagate.get_global_textmap()
    if propagator is not _propagated[0]:
        _propagated = (propagator, frozenset(name.lower().encode("latin-1") for name in propagator.fields))
    names = _propagated[1]
    return any(name in names for name, _ in headers)  # header names come in lower case (http1)


def _header_carrier(headers: Headers) -> dict[str, str]:
    carrier: dict[str, str] = {}
    for name, value in headers:
        key, text = name.decode("latin-1").lower(), value.decode("latin-1")
        carrier[key] = f"{carrier[key]},{text}" if key in carrier else text
    return carrier


def _forwarded_headers(headers: Headers) -> Headers:
    # The proxy asks for identity encoding: it reads (and may cut) what the upstream sends.
    return [(name, value) for name, value in headers if name.lower() not in FORWARD_DROPPED] + [
        (b"accept-encoding", b"identity")]


def _upstream_body(body: bytes, request: dict[str, Any], upstream: dict[str, Any]) -> bytes:
    """The request the upstream gets: the client's bytes with the members the plan added written in
    after the opening brace, so that only those are encoded (and every other byte is the client's);
    the whole request encoded again only where the plan changed or dropped a member the client sent."""
    added = {}
    for name, value in upstream.items():
        if name not in request:
            added[name] = value
        elif request[name] is not value:
            return json.dumps(upstream, ensure_ascii=False).encode("utf-8")
    if len(upstream) - len(added) != len(request):  # a member the client sent was dropped
        return json.dumps(upstream, ensure_ascii=False).encode("utf-8")
    opening = body.index(b"{") + 1  # what precedes it is white space: the body was decoded as an object
    members = msgspec.json.encode(added)[1:-1]  # in C: json.dumps took 3.5 µs of a request's 5
    empty = body[opening:].lstrip()[:1] == b"}"
    return body[:opening] + members + (b"" if empty or not added else b",") + body[opening:]


def _with_trace_context(headers: Headers, record: RequestRecord) -> Headers:
    """The request as the upstream gets it: the proxy's record as the ``traceparent`` (a traced engine
    behind the proxy records its span as this record's child, in the client's trace, and the saved
    queries count the request once), the client's ``baggage`` as it came, or the record's correlation
    when the client sent none."""
    try:
        context = trace_headers(record)
    except Exception:
        return headers
    has_baggage = any(name.lower() == b"baggage" for name, _ in headers)
    out = [(name, value) for name, value in headers if name.lower() != b"traceparent"]
    out.append((b"traceparent", context["traceparent"].encode("latin-1")))
    if not has_baggage and context.get("baggage"):
        out.append((b"baggage", context["baggage"].encode("latin-1")))
    return out


def _response_headers(response: UpstreamResponse, keep_length: bool = False) -> Headers:
    dropped = _RESPONSE_DROPPED_BUT_LENGTH if keep_length else RESPONSE_DROPPED
    return [(name, value) for name, value in response.headers if name not in dropped]


def _send_error(responder: Responder, status: int, kind: str, message: str) -> None:
    body = json.dumps({"error": {"code": status, "message": message, "type": kind}}).encode()
    if responder.committed or responder.client_gone:
        return
    responder.start(status, [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())])
    try:
        responder.end(body)
    except ClientGone:
        pass


def _error_message(body: bytes) -> str:
    try:
        document = loads(body)
        error = document.get("error") if isinstance(document, dict) else None
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])[:500]
        if isinstance(error, str):
            return error[:500]
    except ValueError:
        pass
    return body[:300].decode("utf-8", "replace")


@contextlib.contextmanager
def proxy_in_thread(upstream: str, recorder: Optional[Recorder] = None, llama_server_log: Optional[Path] = None,
                    limits: Limits = Limits(), shadow: Optional[ShadowBudget] = None) -> Iterator[str]:
    """The proxy on a free local port, served by threads of this process; yields its base URL.

    ``recorder``: the recorder to use (default: the process recorder, as ``kvtrace proxy`` does).
    Used by ``kvtrace experiment --server``, the tests and the benchmark.
    """
    app = ProxyApp(upstream, recorder=(lambda: recorder) if recorder is not None else get_recorder,
                   llama_server_log=llama_server_log, shadow=shadow)
    server = Server(app.handle, "127.0.0.1", 0, limits, app.count).start()
    try:
        yield f"http://127.0.0.1:{server.port}"
    finally:
        server.stop()
        app.close()


def serve(upstream: str, host: str, port: int, llama_server_log: Optional[Path] = None,
          on_listening: Optional[Callable[[int], None]] = None, limits: Limits = Limits(),
          shadow: Optional[ShadowBudget] = None, ledger: Optional[ShadowLedger] = None,
          lane: tuple[int, int] = (0, 1), pin: bool = False) -> None:
    """Run the proxy until SIGINT or SIGTERM (both a normal stop: the spans are flushed, exit 0).

    With ``shadow``, an upstream known to have no cache bypass is refused (``ConfigError``). ``ledger`` and
    ``lane``: this proxy is worker ``lane[0]`` of ``lane[1]`` (:mod:`workers`), sharing the shadow budget.
    ``pin``: this process kept to its lane's CPU (:mod:`cpu_affinity`)."""
    if pin:
        keep_to(cpu_of_worker(lane[0]))  # before the proxy's threads start: they inherit it
    limit_arenas()  # before the proxy's threads start: they share the arenas
    app = ProxyApp(upstream, llama_server_log=llama_server_log, shadow=shadow, ledger=ledger, lane=lane)
    if shadow is not None:
        try:
            refuse_without_bypass(app.profiles.detected())
        except ConfigError:
            app.close()
            raise
    server = Server(app.handle, host, port, limits, app.count, reuse_port=lane[1] > 1)
    collect_less_often()
    stop = threading.Event()
    for number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(number, lambda signum, frame: stop.set())
    server.start()
    if on_listening is not None:
        on_listening(server.port)
    trim = PeriodicTrim()
    try:
        while not stop.wait(1.0):
            trim.tick()
    finally:
        server.stop()
        app.close()
