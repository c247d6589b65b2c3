"""One OpenAI-compatible request/response pair → a kvtrace request record.

Shared by ``kvtrace probe`` (requests it sends itself) and ``kvtrace import``
(requests some other harness logged).  Such a server is not instrumented, so
what an engine patch observes directly is read back from the response:

* **Margins.**  ``logprobs.content[i].top_logprobs`` (chat) or the legacy
  ``logprobs.top_logprobs[i]`` (completions): top-1 − top-2 log-probability.
  Log-softmax subtracts the same log-sum-exp from every logit of a position,
  so this equals the raw-logit margin the engine patches record.  A request
  whose positions lack a second alternative keeps its tokens but no margins.
* **Token ids.**  Used as given when the server reports them (llama-server's
  ``id``, vLLM's ``token_id:N`` strings with ``return_tokens_as_token_ids``);
  otherwise each token's bytes (``bytes``, else the UTF-8 of ``token``) are
  turned into a 63-bit keyed hash under the deployment key
  (``KVTRACE_HASH_KEY``): equal tokens compare equal across runs, the text
  cannot be recovered.  The capture policy then applies to these ids as to
  any others.  ``kvtrace.output.token_id_source`` says which.  Where the
  answer lists every generated id besides (``choices[0].token_ids``: a whole
  llama-server ``/completion`` answer's ``tokens``) and the logprobs leave some
  out (a token that ends inside a UTF-8 character), the ids are the list and
  the per-token arrays stop at the first id left out (``rows_cut_at``).
* **Prompt hash.**  The keyed hash of the prompt token ids when the response
  carries them (vLLM ``return_token_ids``), else a keyed hash of the canonical
  JSON of the prompt-shaping request fields (messages / prompt, tools,
  response format).  Text is hashed, never stored.
* **Reused prompt tokens.**  ``usage.prompt_tokens_details.cached_tokens``
  (OpenAI, vLLM with ``--enable-prompt-tokens-details``) or llama-server's
  ``timings.cache_n``; when the server reports neither the caller says what
  it knows (the probe: how it sent the request), and
  ``kvtrace.cache.reused_tokens.source`` records where the number came from.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any, Optional

from kvtrace import semconv as sc
from kvtrace.recording.records import RequestRecord

PROMPT_FIELDS = ("messages", "prompt", "suffix", "tools", "tool_choice", "functions", "function_call",
                 "response_format", "chat_template_kwargs")
"""Request fields that shape the prompt the model sees (sampling settings do not)."""
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "max_completion_tokens",
                   "presence_penalty", "frequency_penalty", "repeat_penalty", "stop", "n")


class ExchangeError(ValueError):
    """The response cannot be read as a completion with logprobs (the message says what is missing)."""


@dataclass
class Exchange:
    """What kvtrace reads from one request/response pair."""

    operation: str
    model: str
    prompt_hash: str
    prompt_hash_source: str
    prompt_token_ids: Optional[list[int]]
    prompt_tokens: int
    cached_tokens: Optional[int]
    cached_tokens_source: str
    token_ids: list[int] = field(default_factory=list)
    top1_ids: list[int] = field(default_factory=list)
    runner_up_ids: list[int] = field(default_factory=list)
    margins: list[float] = field(default_factory=list)
    """Empty when some position had no second alternative (invariant: else parallel to token_ids)."""
    logprobs: list[float] = field(default_factory=list)
    token_id_source: str = sc.TOKEN_ID_SOURCE_TEXT_HASH
    finish_reason: str = ""
    sampling: dict[str, Any] = field(default_factory=dict)
    rows_cut_at: Optional[int] = None
    """Where the per-token arrays (logprobs, margins, top-1, runner-up) stop short of ``token_ids``: the
    first generated id the logprobs left out (``None``: none was)."""


class TextHasher:
    """Keyed hashes of text, under the same deployment key as the capture policy's token hashes."""

    def __init__(self, key: bytes):
        self._key = hashlib.blake2b(key, digest_size=32).digest()
        self._memo: dict[bytes, int] = {}

    def _digest(self, domain: bytes, payload: bytes, size: int = 8) -> bytes:
        # The domain keeps text hashes apart from the capture policy's token-id hashes.
        return hashlib.blake2b(domain + b"\0" + payload, key=self._key, digest_size=size).digest()

    def request_hash(self, request: dict[str, Any]) -> str:
        """A prompt hash: 128-bit, as the capture policy's (it is the place of every token hashed under it)."""
        shaping = {k: request[k] for k in PROMPT_FIELDS if request.get(k) is not None}
        canonical = json.dumps(shaping, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        return self._digest(b"kvtrace.request_text", canonical.encode("utf-8", "surrogatepass"), size=16).hex()

    def token_id(self, token_bytes: bytes) -> int:
        value = self._memo.get(token_bytes)
        if value is None:
            value = int.from_bytes(self._digest(b"kvtrace.token_text", token_bytes), "little") >> 1
            self._memo[token_bytes] = value
        return value


_Token = tuple[str, float, Any, Optional[int]]
"""(text, logprob, the entry's ``bytes`` member as given, engine id or ``None``): a plain tuple, as a record
reads three of them a token; the bytes are checked only where a token's id is hashed from them."""
_TEXT, _LOGPROB, _RAW, _ENGINE_ID = range(4)


def parse_exchange(request: dict[str, Any], response: dict[str, Any], hasher: TextHasher,
                   prompt_hash_of_ids) -> Exchange:
    """Read one non-streamed completion.  ``prompt_hash_of_ids``: the capture policy's ``hash_tokens``."""
    if not isinstance(request, dict) or not isinstance(response, dict):
        raise ExchangeError("request and response must be JSON objects")
    choices = response.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise ExchangeError("response has no choices[0]")
    choice = choices[0]
    chat = "messages" in request or response.get("object") == "chat.completion"
    rows = _plain_engine_rows(choice.get("logprobs"))
    positions = _positions(choice.get("logprobs")) if rows is None else []
    usage = response.get("usage") if isinstance(response.get("usage"), dict) else {}
    prompt_ids = response.get("prompt_token_ids") or choice.get("prompt_token_ids")
    if isinstance(prompt_ids, list) and prompt_ids and all(isinstance(t, int) for t in prompt_ids):
        for token_id in prompt_ids:
            _check_id(token_id, "prompt token id")
        prompt_hash, hash_source = prompt_hash_of_ids(prompt_ids), sc.PROMPT_HASH_SOURCE_TOKEN_IDS
    else:
        prompt_ids = None
        prompt_hash, hash_source = hasher.request_hash(request), sc.PROMPT_HASH_SOURCE_REQUEST_TEXT
    cached, cached_source = _cached_tokens(response, usage)
    exchange = Exchange(
        operation=sc.OPERATION_CHAT if chat else sc.OPERATION_TEXT_COMPLETION,
        model=str(response.get("model") or request.get("model") or ""),
        prompt_hash=prompt_hash, prompt_hash_source=hash_source, prompt_token_ids=prompt_ids,
        prompt_tokens=_int(usage.get("prompt_tokens"), len(prompt_ids or [])),
        cached_tokens=cached, cached_tokens_source=cached_source,
        finish_reason=str(choice.get("finish_reason") or ""),
        sampling={k: request[k] for k in SAMPLING_FIELDS if k in request},
    )
    if rows is not None:
        exchange.token_id_source = sc.TOKEN_ID_SOURCE_ENGINE
        exchange.token_ids, exchange.logprobs, exchange.top1_ids, exchange.runner_up_ids, exchange.margins = rows
        _fill_unreported(exchange, choice.get("token_ids"))
        return exchange
    use_engine_ids = _engine_ids_throughout(positions)
    exchange.token_id_source = sc.TOKEN_ID_SOURCE_ENGINE if use_engine_ids else sc.TOKEN_ID_SOURCE_TEXT_HASH
    _fill_rows(exchange, positions, _ENGINE_ID if use_engine_ids else None, hasher)
    if use_engine_ids:
        _fill_unreported(exchange, choice.get("token_ids"))
    return exchange


def _engine_ids_throughout(positions: list[tuple[_Token, list[_Token]]]) -> bool:
    """Whether every position's token and alternatives carry the engine's id (loops, not generators: a
    stream has three tokens a position)."""
    if not positions:
        return False
    for chosen, alternatives in positions:
        if chosen[_ENGINE_ID] is None:
            return False
        for token in alternatives:
            if token[_ENGINE_ID] is None:
                return False
    return True


_INFINITY = float("inf")


def _plain_engine_rows(logprobs: Any) -> Optional[tuple[list[int], list[float], list[int], list[int], list[float]]]:
    """The per-token arrays (ids, logprobs, top-1, runner-up, margins) read in one pass where every chat entry is
    the plain case: an engine id and a finite float logprob, two alternatives alike; ``None`` otherwise, and
    :func:`_positions` and :func:`_fill_rows` read the entries (and say what is wrong with them). The same
    arrays as theirs, without a tuple a token on the way."""
    if type(logprobs) is not dict:
        return None
    entries = logprobs.get("content")
    if type(entries) is not list or not entries:
        return None
    token_ids, values, top1_ids, runner_up_ids, margins = [], [], [], [], []
    for entry in entries:
        if type(entry) is not dict:
            return None
        alternatives = entry.get("top_logprobs")
        if type(alternatives) is not list or len(alternatives) != 2:
            return None
        first, second = alternatives
        if type(first) is not dict or type(second) is not dict:
            return None
        token_id, logprob = entry.get("id"), entry.get("logprob")
        first_id, first_logprob = first.get("id"), first.get("logprob")
        second_id, second_logprob = second.get("id"), second.get("logprob")
        if type(token_id) is not int or type(first_id) is not int or type(second_id) is not int \
                or type(logprob) is not float or type(first_logprob) is not float \
                or type(second_logprob) is not float:
            return None
        if not (0 <= token_id <= MAX_TOKEN_ID and 0 <= first_id <= MAX_TOKEN_ID and 0 <= second_id <= MAX_TOKEN_ID
                and -_INFINITY < logprob < _INFINITY and -_INFINITY < first_logprob < _INFINITY
                and -_INFINITY < second_logprob < _INFINITY):
            return None
        if second_logprob > first_logprob:  # as a stable sort by descending logprob ranks them
            first_id, first_logprob, second_id, second_logprob = second_id, second_logprob, first_id, first_logprob
        token_ids.append(token_id)
        values.append(logprob)
        top1_ids.append(first_id)
        runner_up_ids.append(second_id)
        margins.append(first_logprob - second_logprob)
    return token_ids, values, top1_ids, runner_up_ids, margins


def _fill_rows(exchange: Exchange, positions: list[tuple[_Token, list[_Token]]], engine_id: Optional[int],
               hasher: TextHasher) -> None:
    """The per-token arrays: each position's token, its logprob, the top two alternatives and their margin."""
    if engine_id is not None:
        def ident(t: _Token) -> int:
            return t[engine_id]
    else:
        def ident(t: _Token) -> int:
            return hasher.token_id(_token_bytes(t))

    token_ids, logprobs, top1_ids, runner_up_ids, margins = [], [], [], [], []
    complete = True
    for chosen, alternatives in positions:
        if len(alternatives) == 2:
            first, second = alternatives
            if second[_LOGPROB] > first[_LOGPROB]:  # as a stable sort by descending logprob ranks them
                first, second = second, first
            ranked = (first, second)
        else:
            ranked = sorted(alternatives, key=lambda t: -t[_LOGPROB])
        token_ids.append(ident(chosen))
        logprobs.append(chosen[_LOGPROB])
        top1_ids.append(ident(ranked[0]) if ranked else ident(chosen))
        if len(ranked) >= 2:
            runner_up_ids.append(ident(ranked[1]))
            margins.append(ranked[0][_LOGPROB] - ranked[1][_LOGPROB])
        else:
            complete = False
            runner_up_ids.append(-1)
    exchange.token_ids, exchange.logprobs, exchange.top1_ids = token_ids, logprobs, top1_ids
    exchange.runner_up_ids = runner_up_ids
    exchange.margins = margins if complete else []


def _token_bytes(token: _Token) -> bytes:
    """The token's bytes as the answer lists them where they are bytes, else the UTF-8 of its text."""
    raw = token[_RAW]
    if isinstance(raw, list) and all(isinstance(b, int) and 0 <= b < 256 for b in raw):
        return bytes(raw)
    return token[_TEXT].encode("utf-8", "surrogatepass")


def _fill_unreported(exchange: Exchange, generated: Any) -> None:
    """Every generated id, where the answer lists them and the logprobs' ids are among them in order; the
    per-token arrays cut where the first id without logprobs stands."""
    if not isinstance(generated, list) or len(generated) <= len(exchange.token_ids) \
            or not all(isinstance(t, int) and not isinstance(t, bool) for t in generated):
        return
    first_unreported = None
    position = 0
    for reported in exchange.token_ids:
        # The server leaves out the tokens before the one that completes a character: skip to it.
        while position < len(generated) and generated[position] != reported:
            if first_unreported is None:
                first_unreported = position
            position += 1
        if position == len(generated):
            return  # not the same generation: the logprobs' ids stand alone
        position += 1
    cut_at = position if first_unreported is None else first_unreported
    exchange.token_ids = [_check_id(t, "token id") for t in generated]
    exchange.rows_cut_at = cut_at
    for name in ("top1_ids", "runner_up_ids", "margins", "logprobs"):
        setattr(exchange, name, getattr(exchange, name)[:cut_at])


def _positions(logprobs: Any) -> list[tuple[_Token, list[_Token]]]:
    """(chosen token, top alternatives) per generated position, from either logprobs format."""
    if not isinstance(logprobs, dict):
        raise ExchangeError("response has no logprobs: send logprobs=true with top_logprobs=2 "
                            "(completions: logprobs=2)")
    if isinstance(logprobs.get("content"), list):
        out = []
        for i, entry in enumerate(logprobs["content"]):
            if not isinstance(entry, dict) or "logprob" not in entry:
                raise ExchangeError(f"logprobs.content[{i}] has no logprob")
            alternatives = entry.get("top_logprobs")
            if alternatives is None:
                alternatives = []
            if not isinstance(alternatives, list):
                raise ExchangeError(f"logprobs.content[{i}].top_logprobs must be a list, "
                                    f"got {type(alternatives).__name__}")
            for alternative in alternatives:
                if not isinstance(alternative, dict):
                    raise ExchangeError(f"logprobs.content[{i}].top_logprobs must be a list of objects "
                                        "({\"token\": ..., \"logprob\": ...})")
            out.append((_token(entry, i), [_token(a, i) for a in alternatives]))
        return out
    tokens, token_logprobs = logprobs.get("tokens"), logprobs.get("token_logprobs")
    if isinstance(tokens, list) and isinstance(token_logprobs, list) and len(tokens) == len(token_logprobs):
        tops = logprobs.get("top_logprobs") or [None] * len(tokens)
        if not isinstance(tops, list) or not all(top is None or isinstance(top, dict) for top in tops):
            raise ExchangeError("logprobs.top_logprobs must be a list of {token: logprob} objects (completions)")
        out = []
        for i, (text, lp, top) in enumerate(zip(tokens, token_logprobs, tops)):
            alternatives = [(str(t), _logprob(v, i), None, _vllm_id(str(t))) for t, v in (top or {}).items()
                            if v is not None]
            out.append(((str(text), _logprob(lp if lp is not None else 0.0, i), None, _vllm_id(str(text))),
                        alternatives))
        return out
    raise ExchangeError("logprobs has neither `content` (chat) nor `tokens`/`token_logprobs` (completions)")


MAX_TOKEN_ID = 2**63 - 1
"""Token ids are Int64 in the typed tables."""


def _check_id(value: int, what: str) -> int:
    if not 0 <= value <= MAX_TOKEN_ID:
        raise ExchangeError(f"{what} {value} is outside 0..2^63-1")
    return value


def _logprob(value: Any, position: int) -> float:
    try:
        logprob = float(value)
    except (TypeError, ValueError):
        raise ExchangeError(f"logprobs position {position}: a token without a numeric logprob "
                            f"({value!r:.40})") from None
    if not math.isfinite(logprob):
        raise ExchangeError(f"logprobs position {position}: logprob {value!r} is not a finite number")
    return logprob


def _token(entry: dict[str, Any], position: int) -> _Token:
    if "logprob" not in entry:
        raise ExchangeError(f"logprobs position {position}: a token without a numeric logprob")
    logprob = entry["logprob"]
    if type(logprob) is not float or not math.isfinite(logprob):  # a decoded float is taken as it is
        logprob = _logprob(logprob, position)
    text = entry.get("token", "")
    if type(text) is not str:
        text = str(text)
    given = entry.get("id")
    if type(given) is int:
        engine_id = given if 0 <= given <= MAX_TOKEN_ID else _check_id(given, "token id")
    elif isinstance(given, int) and not isinstance(given, bool):
        engine_id = _check_id(given, "token id")
    else:
        engine_id = _vllm_id(text)
    return (text, logprob, entry.get("bytes"), engine_id)


def _vllm_id(text: str) -> Optional[int]:
    """vLLM's ``return_tokens_as_token_ids`` writes tokens as ``token_id:123``."""
    if text.startswith("token_id:") and text[9:].isdigit():
        return _check_id(int(text[9:]), "token id")
    return None


def _cached_tokens(response: dict[str, Any], usage: dict[str, Any]) -> tuple[Optional[int], str]:
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        return details["cached_tokens"], sc.REUSED_SOURCE_OPENAI_USAGE
    timings = response.get("timings")
    if isinstance(timings, dict) and isinstance(timings.get("cache_n"), int):
        return timings["cache_n"], sc.REUSED_SOURCE_LLAMA_SERVER_TIMINGS
    return None, sc.REUSED_SOURCE_UNKNOWN


def _int(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def fill_record(record: RequestRecord, exchange: Exchange, reused_tokens: int, reused_source: str,
                cache_layer: str) -> None:
    """Copy an exchange into a record made by ``Recorder.start_request`` (correlation already set)."""
    record.model = record.model or exchange.model
    record.operation = exchange.operation
    record.config[sc.MODEL_FINGERPRINT] = record.config.get(sc.MODEL_FINGERPRINT) or exchange.model
    record.config[sc.SAMPLING_SETTINGS] = exchange.sampling or None
    record.config[sc.CACHE_REUSED_TOKENS_SOURCE] = reused_source
    record.config[sc.OUTPUT_TOKEN_ID_SOURCE] = exchange.token_id_source
    record.config[sc.PROMPT_HASH_SOURCE] = exchange.prompt_hash_source
    if exchange.prompt_token_ids is not None:
        record.prompt_token_ids = exchange.prompt_token_ids
    else:
        # The recorder only hashes token ids; a text-derived hash goes in as a ready attribute.
        record.config[sc.PROMPT_HASH] = exchange.prompt_hash
    record.prompt_tokens = exchange.prompt_tokens
    record.reused_tokens = max(0, min(reused_tokens, exchange.prompt_tokens or reused_tokens))
    record.recomputed_tokens = max(0, exchange.prompt_tokens - record.reused_tokens)
    record.cache_layer = cache_layer if record.reused_tokens > 0 else sc.LAYER_NONE
    record.output_token_ids = list(exchange.token_ids)
    record.top1_ids = list(exchange.top1_ids)
    record.runner_up_ids = list(exchange.runner_up_ids)
    record.margins = list(exchange.margins)
    record.logprobs = list(exchange.logprobs)
    record.finish_reason = exchange.finish_reason or None
    if exchange.rows_cut_at is not None:
        record.rows_cut_at, record.rows_cut_reason = exchange.rows_cut_at, sc.ROWS_UNREPORTED
