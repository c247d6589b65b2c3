"""An upstream's answer — whole, streamed, or in llama-server's native shape — as one
OpenAI-style completion that ``kvtrace.exchanges.exchange.parse_exchange`` reads.

The proxy keeps the answer's documents as the upstream sent them (with the logprobs it may have
asked for) and reads them here once the client has its answer, so that none of this work sits
between the upstream and the client.

* **Streams** are merged: per-position logprobs of choice 0 in order, the last finish reason,
  and the usage / timings the last events carry.
* **llama-server's native** ``/completion``: ``completion_probabilities`` become
  ``logprobs.content`` (the same entries), ``tokens_evaluated`` the prompt tokens,
  ``stop_type`` the finish reason, and a whole answer's ``tokens`` (every generated id, where
  the entries leave out a token that ends inside a UTF-8 character) the choice's ``token_ids``.
* **Post-sampling probabilities** (``post_sampling_probs``: ``prob`` / ``top_probs`` instead of
  ``logprob`` / ``top_logprobs``) are turned into their logarithms, and the answer says so
  (:attr:`UpstreamAnswer.margin_unit`): after the sampling chain (temperature, truncation) their
  differences are no longer raw-logit margins.
* Cache counts: ``usage.prompt_tokens_details.cached_tokens`` or ``timings.cache_n``
  (``parse_exchange`` reads them); without ``usage`` the prompt tokens are
  ``timings.cache_n + timings.prompt_n``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Iterable, Optional

from kvtrace import semconv as sc
from kvtrace.json_decode import loads
from kvtrace.proxy.margin_request import CHAT, NATIVE


@dataclass
class UpstreamAnswer:
    response: dict[str, Any]
    """OpenAI-shaped: ``model``, ``object``, ``choices[0].logprobs`` / ``finish_reason``, ``usage``, ``timings``."""
    slot: Optional[int] = None
    """The llama-server slot that served the request, where the answer says (native endpoint)."""
    error: Optional[str] = None
    """An error the upstream reported inside a 200 answer (a stream that failed midway)."""
    margin_unit: str = sc.MARGIN_UNIT_RAW_LOGIT


def whole_answer(endpoint: str, body: str) -> UpstreamAnswer:
    """A non-streamed answer body (``ValueError`` when it is not a JSON object)."""
    document = loads(body)
    if not isinstance(document, dict):
        raise ValueError("the answer is not a JSON object")
    if endpoint == NATIVE:
        return _native([document])
    answer = UpstreamAnswer(document)
    _fill_prompt_tokens(document)
    _convert_probabilities(answer)
    return answer


def stream_events(raw: bytes) -> Iterable[dict[str, Any]]:
    """The JSON documents of a server-sent event stream (``data:`` lines; ``[DONE]`` and pings skipped)."""
    for line in raw.decode("utf-8", "replace").splitlines():
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if not payload or payload == "[DONE]":
            continue
        try:
            document = loads(payload)
        except ValueError:
            continue
        if isinstance(document, dict):
            yield document


def streamed_answer(endpoint: str, raw: bytes) -> UpstreamAnswer:
    if endpoint == NATIVE:
        return _native(list(stream_events(raw)))
    # One event decoded at a time: what the record keeps of it outlives it, the rest dies young (a
    # stream's events held at once all outlived the collector's youngest generation, to be traversed).
    documents = stream_events(raw)
    merged: dict[str, Any] = {"object": "chat.completion" if endpoint == CHAT else "text_completion"}
    content: list[dict[str, Any]] = []
    legacy: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": []}
    finish_reason = None
    any_logprobs = False
    error = None
    # A stream has an event a token: this loop reads each event's few members once (no per-key loops).
    for document in documents:
        if "error" in document:
            error = _error_text(document["error"])
            continue
        if "model" not in merged:
            merged["model"] = document.get("model")
        usage, timings = document.get("usage"), document.get("timings")
        if isinstance(usage, dict):
            merged["usage"] = usage
        if isinstance(timings, dict):
            merged["timings"] = timings
        for choice in document.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            finish_reason = choice.get("finish_reason") or finish_reason
            logprobs = choice.get("logprobs")
            if not isinstance(logprobs, dict):
                continue
            any_logprobs = True
            entries = logprobs.get("content")
            if isinstance(entries, list):
                content += entries
            elif isinstance(logprobs.get("tokens"), list):
                for key in legacy:
                    legacy[key].extend(logprobs.get(key) or [None] * len(logprobs["tokens"]))
    if legacy["tokens"]:
        logprobs_out: Optional[dict[str, Any]] = legacy
    else:
        logprobs_out = {"content": content} if any_logprobs else None
    merged["choices"] = [{"index": 0, "finish_reason": finish_reason, "logprobs": logprobs_out}]
    answer = UpstreamAnswer(merged, error=error)
    _fill_prompt_tokens(merged)
    _convert_probabilities(answer)
    return answer


def _native(documents: list[dict[str, Any]]) -> UpstreamAnswer:
    """llama-server's ``/completion`` answer (one document, or a stream's events)."""
    probabilities: list[dict[str, Any]] = []
    last: dict[str, Any] = {}
    error = None
    any_probabilities = False
    for document in documents:
        if "error" in document:
            error = _error_text(document["error"])
            continue
        if isinstance(document.get("completion_probabilities"), list):
            any_probabilities = True
            probabilities.extend(document["completion_probabilities"])
        last = document
    timings = last.get("timings") if isinstance(last.get("timings"), dict) else {}
    response: dict[str, Any] = {
        "object": "text_completion",
        "model": last.get("model", ""),
        "choices": [{"index": 0, "finish_reason": _native_finish_reason(last),
                     "logprobs": {"content": probabilities} if any_probabilities else None}],
        "timings": timings,
    }
    if isinstance(last.get("tokens_evaluated"), int):
        response["usage"] = {"prompt_tokens": last["tokens_evaluated"]}
    generated = last.get("tokens")
    if len(documents) == 1 and isinstance(generated, list) and generated:
        response["choices"][0]["token_ids"] = generated  # a stream's events leave such a token out too
    slot = last.get("id_slot") if isinstance(last.get("id_slot"), int) and last["id_slot"] >= 0 else None
    answer = UpstreamAnswer(response, slot=slot, error=error)
    _fill_prompt_tokens(response)
    _convert_probabilities(answer)
    return answer


def _native_finish_reason(document: dict[str, Any]) -> Optional[str]:
    # The same words llama-server's OpenAI endpoints use for these stop types.
    stop_type = document.get("stop_type")
    if stop_type in ("eos", "word"):
        return "stop"
    if stop_type == "limit":
        return "length"
    return stop_type or None


def _fill_prompt_tokens(response: dict[str, Any]) -> None:
    usage = response.get("usage") if isinstance(response.get("usage"), dict) else None
    timings = response.get("timings") if isinstance(response.get("timings"), dict) else {}
    if (usage is None or "prompt_tokens" not in usage) and isinstance(timings.get("prompt_n"), int) \
            and isinstance(timings.get("cache_n"), int):
        response.setdefault("usage", {})["prompt_tokens"] = timings["prompt_n"] + timings["cache_n"]


def _convert_probabilities(answer: UpstreamAnswer) -> None:
    """``prob`` / ``top_probs`` entries (post-sampling probabilities) → ``logprob`` / ``top_logprobs``."""
    choices = answer.response.get("choices") or [{}]
    logprobs = choices[0].get("logprobs") if isinstance(choices[0], dict) else None
    entries = logprobs.get("content") if isinstance(logprobs, dict) else None
    if not isinstance(entries, list) or not any(isinstance(e, dict) and "prob" in e for e in entries):
        return
    answer.margin_unit = sc.MARGIN_UNIT_POST_SAMPLING_LOGPROB
    converted = []
    for entry in entries:
        if not isinstance(entry, dict) or "prob" not in entry:
            converted.append(entry)
            continue
        alternatives = [{**{k: v for k, v in a.items() if k != "prob"}, "logprob": _log(a.get("prob"))}
                        for a in entry.get("top_probs") or () if isinstance(a, dict)]
        converted.append({**{k: v for k, v in entry.items() if k not in ("prob", "top_probs")},
                          "logprob": _log(entry.get("prob")), "top_logprobs": alternatives})
    logprobs["content"] = converted


LOG_OF_ZERO = -3.4028234663852886e38
"""What llama-server writes for log(0) (the lowest float): JSON has no -inf."""


def _log(probability: Any) -> float:
    try:
        value = float(probability)
    except (TypeError, ValueError):
        return LOG_OF_ZERO
    return math.log(value) if value > 0 else LOG_OF_ZERO


def _error_text(error: Any) -> str:
    if isinstance(error, dict):
        return str(error.get("message") or json.dumps(error))[:500]
    return str(error)[:500]
