"""Varied upstream answers (streams and whole bodies) and what a record reads from each, as plain
JSON values: the cases tests/unit/test_stream_records.py holds the record's reading to."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from kvtrace.exchanges.exchange import ExchangeError, TextHasher, parse_exchange
from kvtrace.proxy import answers

CHAT_REQUEST = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True, "temperature": 0.5}
COMPLETION_REQUEST = {"model": "m", "prompt": "once", "stream": True, "max_tokens": 8}
NATIVE_REQUEST = {"prompt": "once", "stream": True, "n_predict": 4}


def _entry(text: str, logprob: Any, token_id: Any = None, raw: Any = "utf8", **extra: Any) -> dict:
    entry = {"token": text, "logprob": logprob}
    if token_id is not None:
        entry["id"] = token_id
    if raw == "utf8":
        entry["bytes"] = list(text.encode())
    elif raw is not None:
        entry["bytes"] = raw
    return {**entry, **extra}


def _chat_event(entries: list, finish: Any = None, **extra: Any) -> dict:
    choice = {"index": 0, "finish_reason": finish, "delta": {"content": "x"}}
    if entries is not None:
        choice["logprobs"] = {"content": entries}
    return {"id": "c", "object": "chat.completion.chunk", "model": "fake", "choices": [choice], **extra}


def _sse(*documents: Any) -> bytes:
    lines = []
    for document in documents:
        data = document if isinstance(document, str) else json.dumps(document)
        lines.append(f"data: {data}\n\n")
    return ("".join(lines) + "data: [DONE]\n\n").encode()


def _with_alternatives(text: str, logprob: float, token_id: Any, alternatives: list) -> dict:
    return _entry(text, logprob, token_id, top_logprobs=alternatives)


def _tokens(count: int, ids: bool = True, raw: Any = "utf8") -> list[dict]:
    out = []
    for n in range(count):
        text = f" t{n % 5}"
        first = _entry(text, -0.25 - n / 100, 100 + n % 5 if ids else None, raw)
        second = _entry(" a", -1.5 + n / 1000, 7 if ids else None, raw)
        out.append(_with_alternatives(text, -0.25 - n / 100, 100 + n % 5 if ids else None,
                                      [first, second] if n % 2 else [second, first]))
    return out


def _last(tokens: int) -> dict:
    return {"id": "c", "model": "fake", "choices": [{"index": 0, "finish_reason": "length", "delta": {}}],
            "usage": {"completion_tokens": tokens, "prompt_tokens": 9, "total_tokens": 9 + tokens},
            "timings": {"cache_n": 4, "prompt_n": 5, "predicted_n": tokens}}


def cases() -> dict[str, tuple[str, str, dict, bytes]]:
    """name → (endpoint, "stream" or "whole", request, the answer's bytes)."""
    tied = [_with_alternatives(" b", -1.0, 3, [_entry(" b", -1.0, 3), _entry(" c", -1.0, 4)])]
    three = [_with_alternatives(" b", -1.0, 3, [_entry(" c", -2.0, 4), _entry(" b", -1.0, 3), _entry(" d", -0.5, 5)])]
    one_alternative = _tokens(2) + [_with_alternatives(" z", -0.1, 9, [_entry(" z", -0.1, 9)])]
    mixed_ids = _tokens(2) + [_with_alternatives(" q", -0.3, None, [_entry(" q", -0.3, 11), _entry(" r", -2.0, 12)])]
    odd_bytes = [_with_alternatives("é", -0.2, None, [_entry("é", -0.2, None, [195, 169]),
                                                      _entry("e", -0.9, None, [300, 1])])]
    no_bytes = [_with_alternatives("ü", -0.2, None, [_entry("ü", -0.2, None, None), _entry("u", -1.1, None, None)])]
    vllm = [_with_alternatives("token_id:42", -0.2, None, [_entry("token_id:42", -0.2), _entry("token_id:43", -1.0)])]
    post_sampling = [{"id": 5, "token": " p", "bytes": [32, 112], "prob": 0.75,
                      "top_probs": [{"id": 5, "token": " p", "bytes": [32, 112], "prob": 0.75},
                                    {"id": 6, "token": " q", "bytes": [32, 113], "prob": 0.0}]}]
    legacy_logprobs = {"tokens": [" a"], "token_logprobs": [-0.5], "top_logprobs": [{" a": -0.5, " b": -1.25}]}
    legacy_event = {"id": "c", "model": "fake",
                    "choices": [{"index": 0, "text": " a", "finish_reason": None, "logprobs": legacy_logprobs}]}
    native_events = [{"content": " a", "completion_probabilities": [_with_alternatives(" a", -0.5, 1, [
        _entry(" a", -0.5, 1), _entry(" b", -2.5, 2)])], "stop": False},
        {"content": "", "stop": True, "stop_type": "limit", "model": "fake", "tokens_evaluated": 6, "id_slot": 1,
         "timings": {"cache_n": 2, "prompt_n": 4, "predicted_n": 1}}]
    whole_native = {"content": " a\u00e9", "tokens": [1, 2, 3], "stop": True, "stop_type": "eos", "model": "fake",
                    "tokens_evaluated": 6, "id_slot": 0, "timings": {"cache_n": 0, "prompt_n": 6, "predicted_n": 3},
                    "completion_probabilities": [_with_alternatives(" a", -0.5, 1, [_entry(" a", -0.5, 1),
                                                                                    _entry(" b", -2.5, 2)]),
                                                 _with_alternatives("\u00e9", -0.7, 3, [_entry("\u00e9", -0.7, 3),
                                                                                        _entry("e", -2.0, 4)])]}
    return {
        "ids, 24 tokens": ("chat", "stream", CHAT_REQUEST, _sse(*[_chat_event([e]) for e in _tokens(24)], _last(24))),
        "text hashes": ("chat", "stream", CHAT_REQUEST, _sse(*[_chat_event([e]) for e in _tokens(6, ids=False)],
                                                             _last(6))),
        "several tokens an event": ("chat", "stream", CHAT_REQUEST, _sse(_chat_event(_tokens(5)), _last(5))),
        "tied alternatives": ("chat", "stream", CHAT_REQUEST, _sse(_chat_event(tied), _last(1))),
        "three alternatives": ("chat", "stream", CHAT_REQUEST, _sse(_chat_event(three), _last(1))),
        "one alternative: no margins": ("chat", "stream", CHAT_REQUEST, _sse(_chat_event(one_alternative), _last(3))),
        "an id missing: text hashes": ("chat", "stream", CHAT_REQUEST, _sse(_chat_event(mixed_ids), _last(3))),
        "bytes past 255, bytes missing": ("chat", "stream", CHAT_REQUEST,
                                          _sse(_chat_event(odd_bytes), _chat_event(no_bytes), _last(2))),
        "vLLM's token_id:N": ("chat", "stream", CHAT_REQUEST, _sse(_chat_event(vllm), _last(1))),
        "post-sampling probabilities": ("chat", "stream", CHAT_REQUEST, _sse(_chat_event(post_sampling), _last(1))),
        "a malformed event": ("chat", "stream", CHAT_REQUEST,
                              _sse(_chat_event(_tokens(1)), '{"choices": [', _chat_event(_tokens(2)[1:]), _last(2))),
        "an error midway": ("chat", "stream", CHAT_REQUEST,
                            _sse(_chat_event(_tokens(1)), {"error": {"message": "out of memory", "code": 500}})),
        "no logprobs": ("chat", "stream", CHAT_REQUEST, _sse(_chat_event(None), _last(1))),
        "other choices and pings": ("chat", "stream", CHAT_REQUEST, b": ping\n\n" + _sse(
            {"model": "fake", "choices": [{"index": 1, "logprobs": {"content": _tokens(1)}}, "x"]},
            _chat_event(_tokens(1)), _last(1))),
        "a logprob as text": ("chat", "stream", CHAT_REQUEST,
                              _sse(_chat_event([_with_alternatives(" s", "-0.5", 1, [_entry(" s", "-0.5", 1),
                                                                                     _entry(" t", -1, 2)])]))),
        "a logprob missing": ("chat", "stream", CHAT_REQUEST, _sse(_chat_event([{"token": " s", "top_logprobs": []}]))),
        "a logprob not finite": ("chat", "stream", CHAT_REQUEST,
                                 _sse('{"choices": [{"index": 0, "logprobs": {"content": [{"token": "x", '
                                      '"logprob": NaN, "top_logprobs": []}]}}]}')),
        "an id out of range": ("chat", "stream", CHAT_REQUEST,
                               _sse(_chat_event([_with_alternatives(" s", -0.5, 2**63, [])]))),
        "a negative id": ("chat", "stream", CHAT_REQUEST, _sse(_chat_event([_with_alternatives(" s", -0.5, -1, [])]))),
        "alternatives not a list": ("chat", "stream", CHAT_REQUEST, _sse(_chat_event([_entry(" s", -0.5, 1,
                                                                                         top_logprobs={"a": 1})]))),
        "completions, legacy logprobs": ("completions", "stream", COMPLETION_REQUEST, _sse(legacy_event, legacy_event)),
        "native stream": ("native", "stream", NATIVE_REQUEST, _sse(*native_events)),
        "native whole, an id left out": ("native", "whole", {"prompt": "once"}, json.dumps(whole_native).encode()),
    }


def reading(endpoint: str, shape: str, request: dict, body: bytes) -> dict[str, Any]:
    """What a record takes from one answer, or the error that refuses it."""
    if shape == "stream":
        answer = answers.streamed_answer(endpoint, body)
    else:
        answer = answers.whole_answer(endpoint, body.decode())
    seen = {"error": answer.error, "slot": answer.slot, "margin_unit": answer.margin_unit}
    try:
        exchange = parse_exchange(request, answer.response, TextHasher(b"key"), lambda ids: f"ids:{ids}")
    except ExchangeError as exc:
        return {**seen, "refused": str(exc)}
    return {**seen, "exchange": dataclasses.asdict(exchange)}


if __name__ == "__main__":  # writes the expected readings from the tree on sys.path
    print(json.dumps({name: reading(*case) for name, case in cases().items()}, indent=1, sort_keys=True))
