"""Asking an upstream server for the top two alternatives per token, and taking them back out.

A client that asked for no logprobs must receive what the server would have sent it. The proxy
therefore adds the smallest request for the top two alternatives the server understands and
cuts exactly what that request added out of every answer document (a whole JSON body, or one
server-sent event of a stream) before the client sees it. Only the added members are cut; every
other byte of the server's answer is passed on as the server wrote it.

What each server adds, and therefore what is cut (``UpstreamProfile``):

* **llama-server** (llama.cpp's own server). Every endpoint takes ``n_probs`` (its OpenAI
  endpoints copy unknown fields into the native parameters), which, unlike ``logprobs``, is also
  accepted with ``tools`` in a stream. Probabilities are asked before sampling
  (``post_sampling_probs: false``): the log of a softmax over the raw logits, so top-1 − top-2
  equals the raw-logit margin. Cut: chat ``choices[].logprobs`` (absent when not asked),
  completions ``choices[].logprobs`` back to ``null``, native ``completion_probabilities``,
  and the echoed ``n_probs`` / ``post_sampling_probs`` in ``generation_settings`` back to the
  values the request would have had. A whole native answer is also asked for its generated ids
  (``return_tokens``; its ``tokens`` back to ``[]`` unless the client asked for them): the
  probabilities leave out a token that ends inside a UTF-8 character, the ids do not. llama-server
  returns those ids on no other endpoint, and a stream's events leave such a token out too.
* **any other OpenAI-compatible server.** ``logprobs: true, top_logprobs: 2`` (chat) or
  ``logprobs: 2`` (completions); the answer's ``logprobs`` back to ``null``, as OpenAI's API
  writes it when not asked.

When the client asked for logprobs itself, nothing is added or cut: its answer passes untouched
and its logprobs give the margins (none when it asked for fewer than two alternatives).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Optional

import msgspec

from kvtrace import semconv as sc

CHAT = "chat"
COMPLETIONS = "completions"
NATIVE = "native"

ENDPOINTS = {
    "/v1/chat/completions": CHAT,
    "/chat/completions": CHAT,
    "/v1/completions": COMPLETIONS,
    "/completions": COMPLETIONS,
    "/completion": NATIVE,
}
"""Paths the proxy traces (llama-server serves the OpenAI ones with and without ``/v1``)."""

TOP_ALTERNATIVES = 2
_DECODER = json.JSONDecoder()
_ONE_VALUE = msgspec.json.Decoder(msgspec.Raw).decode
"""Checks that a text is exactly one JSON value, without building it (``ValueError`` if not)."""
_CLOSING = {"{": "}", "[": "]", '"': '"'}
"""The character that closes a value opened by the key: objects, arrays and strings delimit themselves."""
_GUESSES_LAST = 2
"""Closing characters that a ``}`` follows looked at first, from the value's start."""
_GUESSES = 6
"""Closing characters looked at from the right before the JSON decoder measures the value instead."""


@dataclass(frozen=True)
class UpstreamProfile:
    """What kind of server is upstream, as far as asking for and cutting logprobs goes."""

    engine: str
    """Recorded as the engine name."""
    llama_server: bool = False
    default_n_probs: int = 0
    """llama-server's own ``n_probs`` default (``--n-probs``): a request without one gets this many."""
    default_post_sampling_probs: bool = False
    version: str = ""
    weight_format: str = ""
    total_slots: Optional[int] = None
    default_dry_multiplier: float = 0.0
    default_dry_penalty_last_n: Optional[int] = None
    """llama-server's DRY defaults: with DRY off, ``dry_penalty_last_n`` changes nothing and may carry a marker."""
    settings: dict[str, Any] = field(default_factory=dict)
    """Server-wide settings worth recording (context size, slots, model)."""


OPENAI_COMPATIBLE = UpstreamProfile(engine="openai-compatible")


@dataclass(frozen=True)
class MarginPlan:
    """How one request's margins are obtained, and what to cut from its answers."""

    endpoint: str
    source: str
    """``injected`` (the proxy asked), ``client`` (the client asked) or ``unavailable``."""
    upstream_request: Optional[dict[str, Any]] = None
    """The request to send instead of the client's; ``None``: send the client's bytes unchanged."""
    cuts: tuple[tuple[str, Any], ...] = ()
    """(member name, replacement) per member the request added; replacement ``_REMOVE`` drops it."""

    @property
    def injected(self) -> bool:
        return self.upstream_request is not None


class _Remove:
    def __repr__(self) -> str:
        return "REMOVE"


_REMOVE = _Remove()


def _count(value: Any) -> int:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float)):
        return int(value)
    return 0


def plan_request(endpoint: str, request: dict[str, Any], profile: UpstreamProfile) -> MarginPlan:
    """The plan for one parsed client request (``endpoint`` is a value of :data:`ENDPOINTS`)."""
    if profile.llama_server:
        return _plan_llama_server(endpoint, request, profile)
    return _plan_openai(endpoint, request)


def _plan_llama_server(endpoint: str, request: dict[str, Any], profile: UpstreamProfile) -> MarginPlan:
    alternatives = _llama_server_n_probs(endpoint, request, profile)
    if alternatives > 0:
        return MarginPlan(endpoint, _client_source(alternatives))
    if request.get("backend_sampling"):
        # Probabilities before sampling turn backend sampling off, which could change the numerics.
        return MarginPlan(endpoint, sc.MARGIN_SOURCE_UNAVAILABLE)
    if endpoint == NATIVE and request.get("response_fields"):
        # The client chose which fields it gets; the probabilities would not be among them.
        return MarginPlan(endpoint, sc.MARGIN_SOURCE_UNAVAILABLE)
    upstream = {**request, "n_probs": TOP_ALTERNATIVES, "post_sampling_probs": False}
    # The answer's echo of the settings goes back to what the client's request set.
    echoed = (("n_probs", 0),
              ("post_sampling_probs", bool(request.get("post_sampling_probs", profile.default_post_sampling_probs))))
    if endpoint == CHAT:
        cuts = (("logprobs", _REMOVE),) + echoed
    elif endpoint == COMPLETIONS:
        cuts = (("logprobs", None),) + echoed
    else:
        cuts = (("completion_probabilities", _REMOVE),) + echoed
        if not request.get("stream") and request.get("return_tokens") is not True:
            upstream["return_tokens"] = True
            cuts += (("tokens", []),)  # what a whole native answer carries when not asked
    return MarginPlan(endpoint, sc.MARGIN_SOURCE_INJECTED, upstream, cuts)


def _llama_server_n_probs(endpoint: str, request: dict[str, Any], profile: UpstreamProfile) -> int:
    """How many alternatives per token llama-server returns for this request as the client sent it."""
    if endpoint == CHAT and request.get("logprobs"):
        return _count(request.get("top_logprobs", 20))  # its chat endpoint's default
    if "n_probs" in request:
        return _count(request["n_probs"])
    if "logprobs" in request:  # an alias of n_probs (the chat endpoint copies it through)
        return _count(request["logprobs"])
    return profile.default_n_probs


def _plan_openai(endpoint: str, request: dict[str, Any]) -> MarginPlan:
    if endpoint == NATIVE:
        return MarginPlan(endpoint, sc.MARGIN_SOURCE_UNAVAILABLE)
    if endpoint == CHAT:
        if request.get("logprobs"):
            return MarginPlan(endpoint, _client_source(_count(request.get("top_logprobs", 0))))
        upstream = {**request, "logprobs": True, "top_logprobs": TOP_ALTERNATIVES}
    else:
        if request.get("logprobs") not in (None, False):
            return MarginPlan(endpoint, _client_source(_count(request.get("logprobs"))))
        upstream = {**request, "logprobs": TOP_ALTERNATIVES}
    return MarginPlan(endpoint, sc.MARGIN_SOURCE_INJECTED, upstream, (("logprobs", None),))


def _client_source(alternatives: int) -> str:
    return sc.MARGIN_SOURCE_CLIENT if alternatives >= TOP_ALTERNATIVES else sc.MARGIN_SOURCE_UNAVAILABLE


def with_marker(plan: MarginPlan, request: dict[str, Any], profile: UpstreamProfile, name: str,
                marker: int) -> MarginPlan:
    """The plan with ``name: marker`` added to the upstream request and its echo set back, where the
    field changes nothing the server computes (llama-server, DRY off, the client did not set it)."""
    if not profile.llama_server or profile.default_dry_penalty_last_n is None or name in request:
        return plan
    multiplier = request.get("dry_multiplier", profile.default_dry_multiplier)
    if not isinstance(multiplier, (int, float)) or multiplier != 0:
        return plan
    upstream = {**(plan.upstream_request or request), name: marker}
    # Built, not dataclasses.replace: that costs several times a constructor, on the client's path.
    return MarginPlan(plan.endpoint, plan.source, upstream, plan.cuts + ((name, profile.default_dry_penalty_last_n),))


def cut(plan: MarginPlan, text: str) -> str:
    """One answer document (a JSON body or one event's data) with what the plan added taken out."""
    for name, replacement in plan.cuts:
        if f'"{name}"' in text:
            text = _edit_member(text, name, replacement)
    return text


def _edit_member(text: str, name: str, replacement: Any) -> str:
    """Drop or replace every member ``"name": value`` of any object in the JSON ``text``.

    A ``"name"`` preceded by ``{`` or ``,`` and followed by ``:`` is a member name, never string
    content: inside a JSON string every ``"`` is escaped, so ``,"`` cannot occur there. Where the
    value ends comes from :func:`_value_end`.
    """
    marker = f'"{name}"'
    pieces = []
    position = 0
    start = text.find(marker)
    while start != -1:
        before = start - 1
        while before >= 0 and text[before] in " \t\r\n":
            before -= 1
        colon = start + len(marker)
        while colon < len(text) and text[colon] in " \t\r\n":
            colon += 1
        if before < 0 or text[before] not in ",{" or colon == len(text) or text[colon] != ":":
            start = text.find(marker, start + 1)
            continue
        value_start = colon + 1
        while value_start < len(text) and text[value_start] in " \t\r\n":
            value_start += 1
        value_end = _value_end(text, value_start)
        if replacement is _REMOVE:
            if text[before] == ",":
                pieces.append(text[position:before])
            else:  # first member: keep the brace, drop the comma after the value
                pieces.append(text[position:start])
                after = value_end
                while after < len(text) and text[after] in " \t\r\n":
                    after += 1
                if after < len(text) and text[after] == ",":
                    value_end = after + 1
        else:
            pieces.append(text[position:value_start])
            pieces.append(json.dumps(replacement))
        position = value_end
        start = text.find(marker, position)
    if not pieces:
        return text
    pieces.append(text[position:])
    return "".join(pieces)


def _value_end(text: str, start: int) -> int:
    """Where the member value that begins at ``start`` ends (``ValueError`` if it is not JSON).

    An object, array or string ends at a closing character that a ``,`` or ``}`` follows (the
    member's object goes on or ends there). The added members are mostly last in their objects, so
    the first guesses are closing characters that a ``}`` follows, from the value's start; then the
    guesses go from the right. A guess counts only where the text up to it is exactly
    one JSON value: a value that delimits itself and is whole ends there and nowhere else. Decoding
    the value to find its end costs ten times that check; it is left for the values no guess
    fits (numbers, literals, malformed text, a member far from the end). One difference: JSON that
    Python's decoder alone refuses (an integer of over 4,300 digits) is cut, where it was not.
    """
    closing = _CLOSING.get(text[start:start + 1])
    if closing is not None:
        # First where the value would end its object: an added member is last in llama-server's and vLLM's
        # answers, and a whole answer goes on after it (counts, timings), where guesses from the right miss.
        last_in_object = closing + "}"
        guess = text.find(last_in_object, start + 1)
        for _ in range(_GUESSES_LAST):
            if guess == -1:
                break
            try:
                _ONE_VALUE(text[start:guess + 1])
                return guess + 1
            except ValueError:
                guess = text.find(last_in_object, guess + 1)
        end = len(text)
        guess = end
        for _ in range(_GUESSES):
            guess = text.rfind(closing, start + 1, guess)
            if guess == -1:
                break
            after = guess + 1
            while after < end and text[after] in " \t\r\n":
                after += 1
            if after < end and text[after] in ",}":
                try:
                    _ONE_VALUE(text[start:guess + 1])
                    return guess + 1
                except ValueError:
                    pass
    return _DECODER.raw_decode(text, start)[1]
