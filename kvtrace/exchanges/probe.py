"""A canary for a running OpenAI-compatible server: cold vs warm requests, recorded as kvtrace spans.

For each probe prompt the probe sends one **cold** request, with prefix reuse
bypassed the way the server allows it, then ``warm`` requests of the same body
that the server may serve from cached state — all greedy, with top-2
logprobs.  Each becomes a ``kvtrace.request`` span (see
``exchange.py`` for how margins, token ids, the prompt hash and reused
tokens are read from the responses), so ``margin_shift`` and the alert rules
compare the warm (cache-hit) requests against the cold (recompute) one.  The
server needs no instrumentation.

How a cold request bypasses reuse, per server:

* vLLM — a fresh ``cache_salt`` per cold request (prefix-cache blocks are
  keyed by it); ``return_tokens_as_token_ids`` gives real token ids.
* llama.cpp's llama-server — ``cache_prompt: false``; ``timings.cache_n``
  reports the reused tokens.
* llama-cpp-python's server — **no per-request bypass.**  The probe first
  sends a short unrelated *flush* request, so the server's single context no
  longer holds the probe prompt; only the tokens both prompts start with (the
  BOS token, a chat template's opening) can still be reused.  The server
  reports no cached-token count: cold requests are recorded with 0 reused
  tokens and warm ones with the whole prompt, marked ``assumed``.
* any other server — no bypass known: cold requests are sent as they are and
  may be served from cache (the measured shift is then a lower bound).

Every request carries W3C ``traceparent`` and ``baggage`` headers: the probe's
own span id as the parent, the probe's run, the prompt id as the episode and
the turn (0 cold, 1..N warm).  When kvtrace traces the server too (``kvtrace
run``, vLLM's plugin), the engine's span of each request is the probe span's
child in the same trace and run, with the cache provenance seen from inside;
the saved queries then read the engine's record of the request (see
``recorder.py``).  A flush request carries the run only: it belongs
to the server's history the probe made, but to no episode.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from kvtrace import semconv as sc
from kvtrace.errors import ConfigError, KvtraceError
from kvtrace.exchanges.exchange import ExchangeError, parse_exchange
from kvtrace.exchanges.recorder import OutsideRecorder, correlation_headers, trace_headers
from kvtrace.http_client import HttpStatusError, request
from kvtrace.server_kind import server_of_models

FLUSH_PROMPT = "kvtrace probe: unrelated flush text, discard."


class ProbeError(KvtraceError):
    """The server could not be reached or answered something that is not a completion."""


@dataclass(frozen=True)
class ServerKind:
    name: str
    engine: str
    """Recorded as the engine name (``llama_cpp`` matches spans of the instrumented llama-cpp-python)."""
    bypass: str
    cache_layer: str
    note: str

    def cold_fields(self) -> dict[str, Any]:
        if self.bypass == "cache_salt":
            return {"cache_salt": secrets.token_hex(16)}
        if self.bypass == "cache_prompt_false":
            return {"cache_prompt": False}
        return {}

    def warm_fields(self) -> dict[str, Any]:
        return {"cache_prompt": True} if self.bypass == "cache_prompt_false" else {}

    def every_request_fields(self) -> dict[str, Any]:
        return {"return_tokens_as_token_ids": True} if self.name == "vllm" else {}


SERVER_KINDS = {
    "vllm": ServerKind("vllm", "vllm", "cache_salt", sc.LAYER_PREFIX_BLOCKS,
                       "cold requests carry a fresh cache_salt"),
    "llama-server": ServerKind("llama-server", "llama-server", "cache_prompt_false", sc.LAYER_KV_REUSE,
                               "cold requests send cache_prompt: false"),
    "llama-cpp-python": ServerKind(
        "llama-cpp-python", "llama_cpp", "flush_request", sc.LAYER_KV_REUSE,
        "llama-cpp-python's server offers no per-request cache bypass: each cold request follows an unrelated "
        "flush request (tokens both prompts start with, such as BOS, may still be reused); cached-token "
        "counts are not reported, so reuse is recorded as assumed (cold 0, warm the whole prompt)"),
    "openai": ServerKind(
        "openai", "openai-compatible", "none", sc.LAYER_KV_REUSE,
        "no cache bypass is known for this server: cold requests may be served from cache, so the measured "
        "shift is a lower bound"),
}


@dataclass
class ProbePrompt:
    id: str
    body: dict[str, Any]
    """``messages`` (chat) or ``prompt`` (completions), plus optional per-prompt ``max_tokens``."""

    @property
    def chat(self) -> bool:
        return "messages" in self.body


def load_prompts(path: Path) -> list[ProbePrompt]:
    """JSON lines: ``{"id": "...", "messages": [...]}`` or ``{"id": "...", "prompt": "..."}``."""
    try:
        lines = Path(path).read_bytes().decode("utf-8").splitlines()
    except OSError as exc:
        raise ConfigError(f"--prompts {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"--prompts {path}: not UTF-8 text (byte {exc.start})") from None
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            entry = json.loads(line)
        except ValueError as exc:
            raise ConfigError(f"{path}:{number}: not JSON ({exc})") from None
        if not isinstance(entry, dict) or ("messages" in entry) == ("prompt" in entry):
            raise ConfigError(f"{path}:{number}: give either `messages` (chat) or `prompt` (completions)")
        body = {k: entry[k] for k in ("messages", "prompt", "max_tokens", "tools", "response_format") if k in entry}
        prompts.append(ProbePrompt(str(entry.get("id") or f"p{len(prompts)}"), body))
    if not prompts:
        raise ConfigError(f"--prompts {path}: no prompts (one JSON object per line)")
    return prompts


def http_json(method: str, url: str, body: Optional[dict] = None, timeout_s: float = 120.0,
              headers: Optional[dict[str, str]] = None) -> dict[str, Any]:
    try:
        return request(method, url, body, headers, timeout_s).raise_for_status().json()
    except HttpStatusError as exc:
        detail = exc.body[:300].decode("utf-8", "replace")
        raise ProbeError(f"{method} {url}: HTTP {exc.status} {detail}") from None
    except OSError as exc:
        raise ProbeError(f"{method} {url}: {exc}; is the server running?") from None
    except ValueError:
        raise ProbeError(f"{method} {url}: the answer is not JSON") from None


def detect_server(base_url: str, timeout_s: float = 10.0) -> tuple[ServerKind, str]:
    """(server kind, first model id) from ``GET /models``: vLLM and llama-server say who owns the model."""
    server, model = server_of_models(http_json("GET", f"{base_url}/models", timeout_s=timeout_s))
    return SERVER_KINDS[server], model


@dataclass
class ProbeResult:
    prompt: str
    role: str
    turn: int
    reused_tokens: int
    reused_source: str
    tokens: list[int] = field(default_factory=list)
    margins: list[float] = field(default_factory=list)


@dataclass
class ProbeSettings:
    base_url: str
    run_id: str
    warm: int = 2
    max_tokens: int = 16
    seed: int = 1
    model: str = ""
    weight_format: str = ""
    arm: str = "probe"
    timeout_s: float = 120.0


class Prober:
    def __init__(self, settings: ProbeSettings, kind: ServerKind, recorder: OutsideRecorder,
                 send: Callable[..., dict] = http_json):
        self.settings = settings
        self.kind = kind
        self.recorder = recorder
        self._send = send

    def probe(self, prompt: ProbePrompt) -> list[ProbeResult]:
        """One cold and ``warm`` warm requests for one prompt; returns them in order."""
        if self.kind.bypass == "flush_request":
            self._request({"prompt": FLUSH_PROMPT, "max_tokens": 1},
                          correlation_headers(self.settings.run_id, arm=self.settings.arm))
        results = [self._probe_request(prompt, sc.PROBE_ROLE_COLD, 0)]
        for turn in range(1, self.settings.warm + 1):
            results.append(self._probe_request(prompt, sc.PROBE_ROLE_WARM, turn))
        return results

    def _body(self, prompt: ProbePrompt, role: str) -> dict[str, Any]:
        body: dict[str, Any] = {"temperature": 0.0, "seed": self.settings.seed,
                                "max_tokens": self.settings.max_tokens, **prompt.body}
        if self.settings.model:
            body["model"] = self.settings.model
        if prompt.chat:
            body.update(logprobs=True, top_logprobs=2)
        else:
            body["logprobs"] = 2
        body.update(self.kind.every_request_fields())
        body.update(self.kind.cold_fields() if role == sc.PROBE_ROLE_COLD else self.kind.warm_fields())
        return body

    def _request(self, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
        path = "chat/completions" if "messages" in body else "completions"
        return self._send("POST", f"{self.settings.base_url}/{path}", body, timeout_s=self.settings.timeout_s,
                          headers=headers)

    def _probe_request(self, prompt: ProbePrompt, role: str, turn: int) -> ProbeResult:
        body = self._body(prompt, role)
        record = self.recorder.start(engine=self.kind.engine, run_id=self.settings.run_id, episode_id=prompt.id,
                                     turn=turn, arm=self.settings.arm)
        start = time.time_ns()
        response = self._request(body, trace_headers(record))
        end = time.time_ns()
        try:
            exchange = parse_exchange(body, response, self.recorder.hasher, self.recorder.hash_prompt_ids)
        except ExchangeError as exc:
            raise ProbeError(f"prompt {prompt.id} ({role}): {exc}") from None
        if exchange.cached_tokens is not None:
            reused, source = exchange.cached_tokens, exchange.cached_tokens_source
        else:
            reused = 0 if role == sc.PROBE_ROLE_COLD else exchange.prompt_tokens
            source = sc.REUSED_SOURCE_ASSUMED
        config = {sc.PROBE_ROLE: role, sc.PROBE_BYPASS: self.kind.bypass if role == sc.PROBE_ROLE_COLD else None,
                  sc.MODEL_WEIGHT_FORMAT: self.settings.weight_format or None}
        self.recorder.finish(record, exchange, reused_tokens=reused, reused_source=source,
                             cache_layer=self.kind.cache_layer, start_ns=start, end_ns=end, config=config)
        return ProbeResult(prompt.id, role, turn, reused, source, exchange.token_ids, exchange.margins)


def compare(cold: ProbeResult, warm: ProbeResult) -> str:
    """One line: where a warm request's tokens left the cold one's, and the largest margin shift before."""
    agree = 0
    for a, b in zip(cold.tokens, warm.tokens):
        if a != b:
            break
        agree += 1
    matched = min(agree + (1 if agree < min(len(cold.tokens), len(warm.tokens)) else 0),
                  len(cold.margins), len(warm.margins))
    shift = max((abs(w - c) for c, w in zip(cold.margins[:matched], warm.margins[:matched])), default=float("nan"))
    same = "same tokens" if cold.tokens == warm.tokens else f"tokens differ at position {agree}"
    return (f"{warm.prompt} warm#{warm.turn} vs cold: {same}; max |Δ margin| {shift:.4g} over {matched} "
            f"position(s); reused {warm.reused_tokens} ({warm.reused_source})")
