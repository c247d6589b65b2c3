"""Per-token margins: ``Llama.sample``.

Once the engine has sampled, the step's raw logits row gives top-1, runner-up, their margin and
the chosen token's log-probability, in one call (:mod:`kvtrace.patches.rowstats`: one compiled pass, no copy).
The raw logits come before penalties, grammar and logits processors, so the chosen token may
differ from top-1; both are recorded.  Reading the row after sampling is safe: llama.cpp's sampler
copies the row into its own candidates array and never writes it, and the row stays valid until
the next decode.

Why on the decode thread: copying the row to compute later on the exporter thread was measured
(base model, 32k vocabulary, right after a decode step): the copy alone, 73–84 µs, costs more than
the compiled pass, 46–52 µs, and the exporter's work would come on top.
"""

from __future__ import annotations

import ctypes
from typing import Any, Callable, Optional

from kvtrace.patches.llama_cpp.calls import CALLS
from kvtrace.patches.llama_cpp.engine import FAILURES
from kvtrace.patches.rowstats import RowStats, context_reader, row_stats

SAMPLE_IDX_POSITION = 15
"""Position of ``idx`` among ``Llama.sample``'s arguments: ``sample(top_k, …, grammar, idx)``."""


def sample_wrapper(wrapped, instance, args, kwargs):
    state = CALLS.of(instance)
    if state is None:
        return wrapped(*args, **kwargs)
    token = wrapped(*args, **kwargs)
    try:
        if "idx" in kwargs:
            idx = kwargs["idx"]
        else:
            idx = args[SAMPLE_IDX_POSITION] if len(args) > SAMPLE_IDX_POSITION else None
        state.record.add_token(token, *raw_top2(instance, idx, token))
    except Exception:
        FAILURES.count("sample", state.recorder)
    return token


READER_ATTRIBUTE = "_kvtrace_logits_reader"
"""Where a ``Llama`` keeps its row reader: (context, context handle, reader)."""


def raw_top2(llama: Any, idx: Optional[int], token: int) -> tuple[int, int, float, float]:
    """(top1, runner_up, margin, logprob): the raw logits' top two and ``token``'s log-probability.

    Ties go to the lower token id, so equal logits give a margin of exactly 0.  Runs on every
    sampled token: one Python frame, then the compiled reader (see :func:`logits_reader`).
    """
    ridx = idx - llama.n_tokens if idx is not None else -1
    context = llama._ctx
    cached = getattr(llama, READER_ATTRIBUTE, None)
    if cached is None or cached[0] is not context or cached[1] is not getattr(context, "ctx", None):
        cached = logits_reader(llama)
    return cached[2](ridx, int(token))


def logits_reader(llama: Any) -> tuple[Any, Any, Callable[[int, int], tuple[int, int, float, float]]]:
    """A new ``read(ridx, token)`` for ``llama``'s current context, cached on the instance with the
    context it is valid for (a ``Llama`` whose context changes gets a new one)."""
    context = llama._ctx
    cached = (context, getattr(context, "ctx", None), _new_reader(context, int(llama._n_vocab)))
    setattr(llama, READER_ATTRIBUTE, cached)
    return cached


def _new_reader(context: Any, n_vocab: int) -> Callable[[int, int], tuple[int, int, float, float]]:
    direct = _llama_cpp_addresses(context)
    if direct is not None:
        return context_reader(*direct, n_vocab)

    def read(ridx: int, token: int) -> RowStats:  # any other context: through its own get_logits_ith
        try:
            address = ctypes.addressof(context.get_logits_ith(ridx).contents)
        except ValueError:  # a NULL pointer
            raise ValueError(f"llama.cpp has no logits for output row {ridx}") from None
        return row_stats(address, n_vocab, token)

    return read


def _llama_cpp_addresses(context: Any) -> Optional[tuple[int, int]]:
    """(``llama_get_logits_ith``, the ``llama_context``) as addresses, for llama-cpp-python's own
    ``LlamaContext`` whose binding has llama.h's signature; ``None`` otherwise."""
    try:
        import llama_cpp  # the engine this package instruments; absent for a stand-in
        from llama_cpp import _internals
    except ImportError:
        return None
    function = getattr(llama_cpp, "llama_get_logits_ith", None)
    if type(context) is not getattr(_internals, "LlamaContext", None) or function is None:
        return None
    if (list(getattr(function, "argtypes", None) or ()) != [llama_cpp.llama_context_p_ctypes, ctypes.c_int32]
            or getattr(function, "restype", None) is not ctypes.POINTER(ctypes.c_float)):
        return None
    function_address = ctypes.cast(function, ctypes.c_void_p).value
    handle = context.ctx
    context_address = getattr(handle, "value", handle)
    if not function_address or not context_address:
        return None
    return function_address, int(context_address)
