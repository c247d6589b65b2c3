"""Malformed requests and answers, drawn by hypothesis, against a real proxy on 127.0.0.1.

The story: whatever a client or an upstream sends, the proxy neither crashes nor hangs, and a
well-formed request beside the garbage still gets its answer and exactly one span. And where the
upstream's stream is well formed, however it is cut into chunks, the client gets exactly the
server's events minus what the proxy added, and the span every margin.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import uuid

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtrace import semconv as sc
from kvtrace.proxy.limits import Limits
from kvtrace.proxy.margin_request import (_REMOVE, CHAT, COMPLETIONS, OPENAI_COMPATIBLE, UpstreamProfile, cut,
                                          plan_request)
from scripted_upstream import Answer, ScriptedUpstream, chunked, head, json_answer, openai_profile

pytest.importorskip("h11")
pytest.importorskip("httptools")
from kvtrace.proxy.app import proxy_in_thread  # noqa: E402  (needs httptools)

pytestmark = pytest.mark.timeout(300)

FUZZ = settings(max_examples=60, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
LIMITS = Limits(max_header_bytes=8192, max_body_bytes=65536, request_timeout_s=5.0, idle_timeout_s=5.0)
"""Small enough that the drawn requests meet every limit."""
READ_BOUND_S = 20.0
"""A read that waits this long is a hang."""

COMPLETION_ANSWER = {"id": "c", "object": "text_completion", "model": "m",
                     "choices": [{"index": 0, "text": "ok", "finish_reason": "length", "logprobs": None}],
                     "usage": {"prompt_tokens": 4, "completion_tokens": 2}}
ENDPOINT_BODIES = {"/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                   "/v1/completions": {"prompt": "hi", "max_tokens": 2},
                   "/completion": {"prompt": "hi", "n_predict": 2}}

ANSWER_NAMES = ("choices", "index", "logprobs", "content", "tokens", "token_logprobs", "top_logprobs", "logprob",
                "token", "id", "prob", "top_probs", "finish_reason", "usage", "prompt_tokens",
                "prompt_tokens_details", "cached_tokens", "timings", "cache_n", "prompt_n",
                "completion_probabilities", "tokens_evaluated", "id_slot", "stop_type", "error", "message", "model",
                "delta", "text", "bytes")
"""Member names of the answers the proxy reads: documents built of them reach deep into its readers."""
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(ANSWER_NAMES) | st.text(max_size=4),
                                                                inner, max_size=4),
    max_leaves=12)


class Troubles:
    """Every error the proxy logged and every exception a thread died of, while a test runs."""

    def __init__(self):
        self.seen: list[str] = []
        self._handler = logging.Handler(logging.ERROR)
        self._handler.emit = lambda record: self.seen.append(record.getMessage())

    def __enter__(self) -> "Troubles":
        logging.getLogger("kvtrace").addHandler(self._handler)
        self._hook, threading.excepthook = threading.excepthook, lambda a: self.seen.append(repr(a.exc_value))
        return self

    def __exit__(self, *exc) -> None:
        logging.getLogger("kvtrace").removeHandler(self._handler)
        threading.excepthook = self._hook


def exchange(port: int, raw: bytes) -> bytes:
    """``raw`` on a fresh connection, its sending side then closed; everything until the proxy closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=READ_BOUND_S) as sock:
        try:
            sock.sendall(raw)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            return b""  # the proxy refused and closed while the rest was being sent
        out = b""
        while True:
            try:
                data = sock.recv(65536)
            except ConnectionResetError:
                return out
            # A socket.timeout here is the hang this test looks for: it fails the example.
            if not data:
                return out
            out += data


def spans_of(recorder, episode: str, at_least: int = 1) -> int:
    """Spans recorded for ``episode`` once there are ``at_least`` (bounded: answers come before spans)."""
    for _ in range(200):
        recorder.pipeline.force_flush()
        count = sum(1 for s in recorder.pipeline.exporter.get_finished_spans()
                    if s.attributes.get(sc.EPISODE_ID) == episode)
        if count >= at_least:
            return count
        threading.Event().wait(0.02)
    return count


def well_formed(proxy: str, path: str = "/v1/completions", stream: bool = False) -> tuple[str, httpx.Response]:
    episode = uuid.uuid4().hex
    answer = httpx.post(proxy + path, json={**ENDPOINT_BODIES[path], **({"stream": True} if stream else {})},
                        headers={"baggage": f"kvtrace.episode_id={episode}"}, timeout=READ_BOUND_S)
    return episode, answer


# --- malformed requests -----------------------------------------------------------------------

TARGET_PIECES = st.sampled_from(["/", "v1", "chat", "completions", "completion", "models", "..", ".", "%2e",
                                 "%2E%2e", "?", "#", "http://h", "*", "//", "%00", "\u00e9", ":", "@", "a" * 300])
HEADER_TEXT = st.binary(max_size=40) | st.sampled_from([b"content-length", b"transfer-encoding", b"chunked",
                                                        b"expect", b"100-continue", b"host", b"\r\n", b" ", b":"])


@st.composite
def requests(draw) -> bytes:
    if draw(st.integers(0, 9)) == 0:
        return draw(st.binary(max_size=300))  # not HTTP at all
    method = draw(st.sampled_from([b"GET", b"POST", b"HEAD", b"PUT", b"OPTIONS", b"CONNECT", b"G ET", b""]))
    target = "".join(draw(st.lists(TARGET_PIECES, max_size=8))).encode("utf-8")
    version = draw(st.sampled_from([b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2", b"HTTP/1.1x", b""]))
    lines = [method + b" " + target + b" " + version]
    if draw(st.booleans()):
        lines.append(b"host: x")
    body = draw(st.binary(max_size=200) | st.just(json.dumps(ENDPOINT_BODIES["/v1/completions"]).encode()))
    framing = draw(st.sampled_from(["length", "wrong length", "huge length", "two lengths", "chunked",
                                    "broken chunks", "none"]))
    if framing == "length":
        lines.append(b"content-length: %d" % len(body))
    elif framing == "wrong length":
        lines.append(b"content-length: %d" % (len(body) + draw(st.integers(1, 50))))
    elif framing == "huge length":
        lines.append(b"content-length: 99999999999999999999")
    elif framing == "two lengths":
        lines += [b"content-length: 1", b"content-length: 2"]
    elif framing in ("chunked", "broken chunks"):
        lines.append(b"transfer-encoding: chunked")
        body = chunked([body]) if framing == "chunked" else b"zz\r\n" + body
    for _ in range(draw(st.integers(0, 3))):
        lines.append(draw(HEADER_TEXT) + b": " + draw(HEADER_TEXT))
    if draw(st.integers(0, 9)) == 0:
        lines.append(b"x-long: " + b"a" * 9000)
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def test_malformed_requests_neither_crash_nor_hang_the_proxy_and_a_request_beside_them_gets_its_span(
        memory_recorder):
    upstream_answer = lambda received: openai_profile(received) or json_answer(COMPLETION_ANSWER)  # noqa: E731
    with Troubles() as troubles, ScriptedUpstream(upstream_answer) as upstream, \
            proxy_in_thread(upstream.url, memory_recorder, limits=LIMITS) as proxy:
        port = int(proxy.rsplit(":", 1)[1])

        @FUZZ
        @given(raw=requests())
        def garbage_then_a_request(raw: bytes) -> None:
            answer = exchange(port, raw)
            assert answer == b"" or answer.startswith(b"HTTP/1.1 "), answer[:100]
            episode, good = well_formed(proxy)
            assert good.status_code == 200 and good.json() == COMPLETION_ANSWER
            assert spans_of(memory_recorder, episode) == 1
            assert troubles.seen == []

        garbage_then_a_request()


# --- malformed answers ------------------------------------------------------------------------

LLAMA_PROPS = {"default_generation_settings": {"n_ctx": 512, "params": {"n_probs": 0}}, "total_slots": 1,
               "build_info": "b1", "model_ftype": "all F32"}


def profile_answers(kind: str):
    def answer(received):
        if kind == "llama-server" and received.target == "/props":
            return json_answer(LLAMA_PROPS)
        return openai_profile(received)
    return answer


def events(documents: list, separator: bytes) -> bytes:
    return b"".join(b"data: " + (d if isinstance(d, bytes) else json.dumps(d).encode()) + separator
                    for d in documents)


logprob_entries = st.lists(st.fixed_dictionaries({}, optional={
    name: json_values | st.lists(st.fixed_dictionaries({}, optional={"logprob": json_values, "prob": json_values,
                                                                     "token": json_values, "id": json_values}))
    for name in ("token", "id", "logprob", "prob", "top_logprobs", "top_probs", "bytes")}), max_size=3)
answer_shaped = st.fixed_dictionaries({}, optional={
    "choices": st.lists(st.fixed_dictionaries({"index": st.sampled_from([0, 0, 1, "0"])}, optional={
        "logprobs": json_values | st.fixed_dictionaries({}, optional={
            "content": logprob_entries | json_values, "tokens": json_values, "token_logprobs": json_values,
            "top_logprobs": json_values}),
        "finish_reason": json_values, "delta": json_values, "text": json_values}), max_size=2),
    "completion_probabilities": logprob_entries | json_values,
    **{name: json_values for name in ("usage", "timings", "id_slot", "tokens_evaluated", "stop_type", "error",
                                      "model", "content")}})
"""Documents in the shapes the proxy reads (OpenAI and llama-server answers), with any value in any place."""


@st.composite
def answers(draw) -> Answer:
    status = draw(st.sampled_from([200] * 6 + [204, 304, 400, 500, 101, 100]))
    streamed = draw(st.booleans())
    documents = draw(st.lists(answer_shaped | json_values | st.binary(max_size=30), max_size=5))
    if streamed:
        body = events(documents, draw(st.sampled_from([b"\n\n", b"\r\n\r\n", b"\n"]))) + \
            draw(st.sampled_from([b"", b"data: [DONE]\n\n", b"data: {\"choices\": [\n\n"]))
    else:
        body = json.dumps(documents[0]).encode() if documents and not isinstance(documents[0], bytes) else \
            draw(st.binary(max_size=100))
    headers = [("content-type", "text/event-stream" if streamed else "application/json")]
    framing = draw(st.sampled_from(["length", "short length", "long length", "chunked", "chunk split",
                                    "bad chunk line", "huge chunk", "close", "length and chunked"]))
    exact = framing in ("length", "chunked", "chunk split", "length and chunked")
    if framing in ("length", "short length", "long length"):
        declared = len(body) + {"length": 0, "short length": -1, "long length": 7}[framing]
        headers.append(("content-length", str(max(0, declared))))
    elif framing == "length and chunked":
        headers += [("content-length", "3"), ("transfer-encoding", "chunked")]
    elif framing != "close":
        headers.append(("transfer-encoding", "chunked"))
    if framing in ("chunked", "length and chunked"):
        body = chunked([body])
    elif framing == "chunk split":
        cuts = sorted(draw(st.lists(st.integers(0, len(body)), max_size=4)))
        body = chunked([body[a:b] for a, b in zip([0] + cuts, cuts + [len(body)])])
    elif framing == "bad chunk line":
        body = b"5;ext=" + b"x" * draw(st.integers(0, 70000)) + b"\r\nhello\r\n0\r\n\r\n"
    elif framing == "huge chunk":
        body = b"fffffffffffffffffff\r\n" + body
    if draw(st.booleans()):
        headers.append(("x-a", "transfer-encoding: chunked"))
    raw = head(status, tuple(headers)) + body
    splits = sorted(draw(st.lists(st.integers(0, len(raw)), max_size=3)))
    pieces = [raw[a:b] for a, b in zip([0] + splits, splits + [len(raw)])]
    # An answer whose framing leaves the proxy waiting for more (or only an interim 1xx) ends with the
    # connection's close, as a server's would: a wait for an answer that never comes is the upstream's
    # time, not a hang.
    return Answer(pieces, close=not exact or status < 200 or draw(st.booleans()), pause_s=0.002)


@pytest.mark.parametrize("kind", ["openai-compatible", "llama-server"])
def test_malformed_answers_neither_crash_nor_hang_the_proxy_and_every_request_gets_one_span(kind, memory_recorder):
    scripted: dict[str, Answer] = {}

    def upstream_answer(received):
        return profile_answers(kind)(received) or scripted["next"]

    with Troubles() as troubles, ScriptedUpstream(upstream_answer) as upstream, \
            proxy_in_thread(upstream.url, memory_recorder, limits=LIMITS) as proxy:

        @FUZZ
        @given(answer=answers(), path=st.sampled_from(sorted(ENDPOINT_BODIES)), stream=st.booleans())
        def a_request_meets_a_malformed_answer(answer: Answer, path: str, stream: bool) -> None:
            scripted["next"] = answer
            try:
                episode, _ = well_formed(proxy, path, stream)
            except httpx.TimeoutException:
                raise AssertionError("the proxy did not answer") from None
            except httpx.HTTPError:
                episode = None  # a broken answer may reach the client broken; its span is checked below
            if episode is not None:
                assert spans_of(memory_recorder, episode) == 1
            assert troubles.seen == []

        a_request_meets_a_malformed_answer()
        # Whatever came before, a plain request is served and recorded.
        scripted["next"] = json_answer(COMPLETION_ANSWER)
        episode, good = well_formed(proxy)
        assert good.status_code == 200 and spans_of(memory_recorder, episode) == 1


def test_every_request_that_met_a_broken_answer_has_its_span_too(memory_recorder):
    """The client side of the last test may fail (a truncated answer); its span must exist all the same."""
    broken = Answer([head(200, (("content-type", "application/json"), ("content-length", "50"))) + b'{"choi'],
                    close=True)
    with ScriptedUpstream(lambda received: openai_profile(received) or broken) as upstream, \
            proxy_in_thread(upstream.url, memory_recorder, limits=LIMITS) as proxy:
        episode = uuid.uuid4().hex
        answer = httpx.post(proxy + "/v1/completions", json=ENDPOINT_BODIES["/v1/completions"],
                            headers={"baggage": f"kvtrace.episode_id={episode}"}, timeout=READ_BOUND_S)
        assert answer.status_code == 502
        assert spans_of(memory_recorder, episode) == 1


# --- well-formed streams, cut anywhere --------------------------------------------------------


@st.composite
def token_streams(draw) -> tuple[list[dict], list[float]]:
    """Chat events with the top two per token, as an OpenAI-compatible server answers the proxy."""
    documents, margins = [], []
    for _ in range(draw(st.integers(1, 6))):
        top = draw(st.floats(-20, 0, allow_nan=False))
        second = draw(st.floats(-40, top, allow_nan=False))
        token = draw(st.text(min_size=1, max_size=4))
        documents.append({"id": "s", "object": "chat.completion.chunk", "model": "m", "choices": [
            {"index": 0, "delta": {"content": token}, "finish_reason": None,
             "logprobs": {"content": [{"token": token, "logprob": top, "bytes": None, "top_logprobs": [
                 {"token": token, "logprob": top, "bytes": None},
                 {"token": draw(st.text(max_size=4)), "logprob": second, "bytes": None}]}]}}]})
        margins.append(top - second)
    return documents, margins


def test_a_well_formed_stream_cut_into_any_chunks_reaches_the_client_without_the_added_logprobs(memory_recorder,
                                                                                               finished_requests):
    scripted: dict[str, Answer] = {}
    with Troubles() as troubles, ScriptedUpstream(lambda r: openai_profile(r) or scripted["next"]) as upstream, \
            proxy_in_thread(upstream.url, memory_recorder, limits=LIMITS) as proxy:

        @settings(FUZZ, max_examples=30)
        @given(stream=token_streams(), separator=st.sampled_from([b"\n\n", b"\r\n\r\n"]), data=st.data())
        def a_stream_in_pieces(stream, separator: bytes, data) -> None:
            documents, margins = stream
            raw = events(documents, separator) + b"data: [DONE]" + separator
            cuts = sorted(data.draw(st.lists(st.integers(0, len(raw)), max_size=6)))
            pieces = [raw[a:b] for a, b in zip([0] + cuts, cuts + [len(raw)])]
            scripted["next"] = Answer([head(200, (("content-type", "text/event-stream"),
                                                  ("transfer-encoding", "chunked")))]
                                      + [b"%x\r\n%b\r\n" % (len(p), p) for p in pieces if p] + [b"0\r\n\r\n"],
                                      pause_s=0.001)
            episode, answer = well_formed(proxy, "/v1/chat/completions", stream=True)
            plan = plan_request(CHAT, ENDPOINT_BODIES["/v1/chat/completions"], OPENAI_COMPATIBLE)
            expected = events([cut(plan, json.dumps(d)).encode() for d in documents], separator)
            assert answer.content == expected + b"data: [DONE]" + separator
            assert spans_of(memory_recorder, episode) == 1
            span = next(s for s in memory_recorder.pipeline.exporter.get_finished_spans()
                        if s.attributes.get(sc.EPISODE_ID) == episode)
            assert list(span.attributes[sc.OUTPUT_MARGINS]) == margins
            assert troubles.seen == []

        a_stream_in_pieces()


# --- the cut itself -----------------------------------------------------------------------------

LLAMA_SERVER = UpstreamProfile(engine="llama-server", llama_server=True)
PLANS = [plan_request(CHAT, {}, LLAMA_SERVER), plan_request(COMPLETIONS, {}, OPENAI_COMPATIBLE)]


def without_added(value, plan):
    """What the cut must leave: every member the plan names, in any object, replaced or dropped."""
    if isinstance(value, list):
        return [without_added(v, plan) for v in value]
    if not isinstance(value, dict):
        return value
    out = {}
    for key, member in value.items():
        replacement = dict(plan.cuts).get(key, member)
        if replacement is _REMOVE:
            continue
        out[key] = without_added(member, plan) if key not in dict(plan.cuts) else replacement
    return out


added_names = st.sampled_from(["logprobs", "n_probs", "post_sampling_probs", "completion_probabilities"])
documents_with_added_members = st.recursive(
    json_values,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(added_names | st.text(max_size=6), inner,
                                                                max_size=4),
    max_leaves=12)


@settings(max_examples=300, deadline=None, database=None)
@given(document=documents_with_added_members, plan=st.sampled_from(PLANS), ascii_only=st.booleans(),
       separators=st.sampled_from([(",", ":"), (", ", ": "), (" ,", " : ")]))
def test_the_cut_takes_out_exactly_the_added_members_however_the_json_is_written(document, plan, ascii_only,
                                                                                 separators):
    text = json.dumps(document, ensure_ascii=ascii_only, separators=separators)
    assert json.loads(cut(plan, text)) == without_added(document, plan)


@settings(max_examples=300, deadline=None, database=None)
@given(text=st.text(max_size=200) | st.binary(max_size=200).map(lambda b: b.decode("latin-1")),
       plan=st.sampled_from(PLANS))
def test_the_cut_of_text_that_is_not_json_fails_only_as_a_value_error(text, plan):
    try:
        cut(plan, text)
    except ValueError:
        pass  # the proxy passes such an event on as the upstream sent it (and counts it)


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),  # NaN, infinities, lone surrogates too
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4), max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(value=JSON_VALUES, ascii_only=st.booleans(), encoding=st.sampled_from(["utf-8", "utf-16", "utf-8-sig", None]))
def test_the_proxys_json_decoder_gives_what_json_loads_gives(value, ascii_only, encoding):
    from kvtrace.json_decode import loads

    text = json.dumps(value, ensure_ascii=ascii_only)
    try:
        data = text if encoding is None else text.encode(encoding)
    except UnicodeEncodeError:  # a lone surrogate has no UTF-8 bytes
        return
    assert repr(loads(data)) == repr(json.loads(data))


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=40) | st.text(alphabet='[]{}",:0123456789.eE+-tfrunalsNIy \\u', max_size=30))
def test_the_proxys_json_decoder_refuses_what_json_loads_refuses(data):
    from kvtrace.json_decode import loads

    try:
        expected = repr(json.loads(data))
    except (ValueError, RecursionError) as exc:
        with pytest.raises(type(exc) if isinstance(exc, RecursionError) else ValueError):
            loads(data)
    else:
        assert repr(loads(data)) == expected
