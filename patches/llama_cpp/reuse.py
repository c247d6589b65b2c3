"""In-context KV prefix reuse: ``Llama.generate`` and the first ``Llama.eval`` of a request.

``generate(tokens, …, reset=True)`` keeps the longest common prefix of the live context and the
prompt in the KV cache and evaluates the rest; when the whole prompt matches, llama.cpp still
evaluates its last token again to refresh the logits (cached, but recomputed: one *replayed*
token).  ``generate`` is wrapped to see the prompt, the live context and the sampling parameters
before its body runs; the first ``eval`` of the request tells what llama.cpp actually did:
``n_tokens`` tokens kept, ``len(tokens)`` recomputed.
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
    state.live_prefix = common_prefix(llama.input_ids[:n_live], prompt) if (reset and n_live > 0) else 0

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


def eval_wrapper(wrapped, instance, args, kwargs):
    state = CALLS.of(instance)
    if state is not None and not state.prompt_evaluated and state.prompt is not None:
        try:
            tokens = args[0] if args else kwargs["tokens"]
            on_prompt_eval(state, int(instance.n_tokens), len(tokens))
        except Exception:
            FAILURES.count("eval", state.recorder)
    return wrapped(*args, **kwargs)


def on_prompt_eval(state: CallState, kept: int, evaluated: int) -> None:
    """The first ``eval`` of a request: ``kept`` tokens stay in the KV cache, ``evaluated`` are computed."""
    state.prompt_evaluated = True
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


def common_prefix(live: Sequence[int], prompt: Sequence[int]) -> int:
    """Length of the longest common prefix (vectorised; llama.cpp compares the same way)."""
    n = min(len(live), len(prompt))
    if n == 0:
        return 0
    a = np.asarray(live[:n], dtype=np.int64)
    b = np.asarray(prompt[:n], dtype=np.int64)
    diff = np.flatnonzero(a != b)
    return int(diff[0]) if diff.size else n
