"""In-context KV prefix reuse: ``Llama.generate`` and the first ``Llama.eval`` of a request.

``generate(tokens, …, reset=True)`` keeps the longest common prefix of the live context and the
prompt in the KV cache and evaluates the rest; when the whole prompt matches, llama.cpp still
evaluates its last token again to refresh the logits (cached, but recomputed: one *replayed*
token).  ``generate`` is wrapped to see the prompt, the live context and the sampling parameters
before its body runs; the first ``eval`` of the request tells what llama.cpp actually did:
``n_tokens`` tokens kept, ``len(tokens)`` recomputed, and whether the kept tokens are the prompt's own
(the cache integrity verdict).

``eval`` runs once per generated token, so it is not wrapped: ``generate``'s wrapper shadows it on
that ``Llama`` instance with a watcher that removes itself at the first call (or when the request
ends without one).  The tokens after the first pay nothing.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Sequence

import numpy as np

from kvtrace import semconv as sc
from kvtrace.patches.llama_cpp.calls import CALLS, CallState
from kvtrace.patches.llama_cpp.engine import FAILURES
from kvtrace.recording.records import CacheEvent

SAMPLING_PARAMETERS = ("temp", "top_k", "top_p", "min_p", "typical_p", "repeat_penalty", "frequency_penalty",
                       "presence_penalty", "tfs_z", "mirostat_mode", "mirostat_tau", "mirostat_eta")
"""``Llama.generate`` arguments recorded as the request's sampling settings."""


def generate_wrapper(wrapped, instance, args, kwargs):
    state = CALLS.of(instance)
    if state is not None and state.prompt is None:
        try:
            on_generate(state, instance, args, kwargs)
        except Exception:
            FAILURES.count("generate", state.recorder)
        if state.prompt is not None:  # the prompt is known: what the first eval does can be told
            try:
                watch_first_eval(state, instance)
            except Exception:
                FAILURES.count("eval watch", state.recorder)
    return wrapped(*args, **kwargs)


@functools.lru_cache(maxsize=8)
def _signature(generate: Callable) -> inspect.Signature:
    return inspect.signature(generate)


def on_generate(state: CallState, llama: Any, args: tuple, kwargs: dict) -> None:
    """The prompt, the live prefix it shares, and the sampling parameters the sampler gets."""
    generate = type(llama).generate
    signature = _signature(getattr(generate, "__wrapped__", generate))
    bound = signature.bind_partial(llama, *args, **kwargs)
    params = {k: v for k, v in bound.arguments.items() if k != "self"}
    defaults = {k: p.default for k, p in signature.parameters.items() if p.default is not p.empty}
    prompt = [int(t) for t in params["tokens"]]
    state.prompt = prompt
    n_live = int(llama.n_tokens)
    state.live_tokens_before = n_live
    reset = params.get("reset", defaults.get("reset", True))
    state.live_compared = bool(reset and n_live > 0)
    state.live_prefix = common_prefix(llama.input_ids[:n_live], prompt) if state.live_compared else 0

    record = state.record
    record.prompt_token_ids = prompt
    record.prompt_tokens = len(prompt)

    def param(name: str) -> Any:
        return params.get(name, defaults.get(name))

    sampling = {name: param(name) for name in SAMPLING_PARAMETERS}
    seed = int(getattr(llama, "_seed", 0) or 0)
    sampling["seed"] = seed
    sampling["penalty_last_n"] = getattr(llama, "last_n_tokens_size", None)
    sampling["grammar"] = params.get("grammar") is not None
    sampling["logits_processor"] = params.get("logits_processor") is not None
    record.config[sc.SAMPLING_SETTINGS] = sampling
    record.config[sc.GEN_AI_REQUEST_TEMPERATURE] = float(sampling["temp"])
    record.config[sc.GEN_AI_REQUEST_TOP_P] = float(sampling["top_p"])
    record.config[sc.GEN_AI_REQUEST_TOP_K] = int(sampling["top_k"])
    record.config[sc.GEN_AI_REQUEST_SEED] = seed


_NOT_SHADOWED = object()


class FirstEvalWatch:
    """Stands in for ``llama.eval`` (an instance attribute shadowing the class's) until the request's first eval.

    At that call it reports the prompt evaluation, puts back whatever ``llama.eval`` was on the
    instance before, and calls the engine's ``eval`` unchanged.  A call made outside the request
    (another thread, or after it ended) only passes through.
    """

    def __init__(self, state: CallState, llama: Any):
        self.state = state
        self.llama = llama
        self.previous = vars(llama).get("eval", _NOT_SHADOWED)
        self.engine_eval = llama.eval

    def __call__(self, *args, **kwargs):
        state = self.state
        try:
            if CALLS.of(self.llama) is state:
                self.remove()
                tokens = args[0] if args else kwargs["tokens"]
                on_prompt_eval(state, int(self.llama.n_tokens), len(tokens))
        except Exception:
            FAILURES.count("eval", state.recorder)
        return self.engine_eval(*args, **kwargs)

    def remove(self) -> None:
        """Put back what ``llama.eval`` was on the instance (idempotent; leaves a later replacement alone)."""
        attributes = vars(self.llama)
        if attributes.get("eval") is self:
            if self.previous is _NOT_SHADOWED:
                del attributes["eval"]
            else:
                attributes["eval"] = self.previous
        if self.state.unwatch_eval == self.remove:
            self.state.unwatch_eval = None


def watch_first_eval(state: CallState, llama: Any) -> None:
    """Have the request's first ``llama.eval`` call :func:`on_prompt_eval`, at no cost to later calls."""
    watch = FirstEvalWatch(state, llama)
    vars(llama)["eval"] = watch
    state.unwatch_eval = watch.remove


def on_prompt_eval(state: CallState, kept: int, evaluated: int) -> None:
    """The first ``eval`` of a request: ``kept`` tokens stay in the KV cache, ``evaluated`` are computed."""
    record = state.record
    prompt_len = len(state.prompt or ())
    record.reused_tokens = kept
    record.recomputed_tokens = evaluated
    # The whole prompt matched the live context, yet llama.cpp re-evaluates
    # its last token to refresh the logits: cached, but recomputed.
    replayed = kept > 0 and state.live_prefix >= prompt_len and evaluated == 1 and kept == prompt_len - 1
    record.replayed_tokens = 1 if replayed else 0
    layer = sc.LAYER_NONE
    if kept > 0:
        layer = sc.LAYER_PROMPT_CACHE if state.restored else sc.LAYER_KV_REUSE
    record.cache_layer = layer
    block = state.recorder.settings.block_size
    record.block_layers = [layer if (i + 1) * block <= kept else sc.LAYER_NONE for i in range(prompt_len // block)]
    if state.live_tokens_before > 0 or kept > 0:
        record.events.append(CacheEvent(
            name=sc.EVENT_CACHE_REUSE,
            layer=layer if kept > 0 else sc.LAYER_KV_REUSE,
            outcome=sc.OUTCOME_HIT if kept > 0 else sc.OUTCOME_MISS,
            key_hash=record.state_key if state.restored else None,
            tokens=kept,
            prefix_tokens=state.live_prefix,
            reason=sc.REASON_REPLAY_LAST_TOKEN if replayed else None,
            source=record.state_origin if state.restored else None,
        ))
    if kept > 0:
        judge_kept_tokens(state, kept, layer)


def judge_kept_tokens(state: CallState, kept: int, layer: str) -> None:
    """Whether the ``kept`` tokens the engine continues from are the prompt's own: the restored state's
    tokens (as stored) or the live context's, compared with the prompt's first ``kept``."""
    record = state.record
    # generate compared the live context (after a restore: the state's input_ids) with the prompt already
    matched = state.live_prefix if state.live_compared else None
    if state.restored and state.restored_tokens is not None:
        matched = common_prefix(state.restored_tokens[:kept], state.prompt[:kept])
    record.judge_integrity(layer, kept, matched, sc.INTEGRITY_TOKENS_DIFFER,
                           source=(state.restored_origin or record.state_origin) if state.restored else None,
                           key_hash=record.state_key if state.restored else None)


def common_prefix(live: Sequence[int], prompt: Sequence[int]) -> int:
    """Length of the longest common prefix (vectorised; llama.cpp compares the same way)."""
    n = min(len(live), len(prompt))
    if n == 0:
        return 0
    a = np.asarray(live[:n], dtype=np.int64)
    b = np.asarray(prompt[:n], dtype=np.int64)
    diff = np.flatnonzero(a != b)
    return int(diff[0]) if diff.size else n
