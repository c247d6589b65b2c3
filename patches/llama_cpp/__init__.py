"""llama-cpp-python instrumentation (imported as ``kvtrace.patches.llama_cpp``).

One :class:`~kvtrace.recording.records.RequestRecord` per generation call (``Llama.create_completion`` /
``create_chat_completion``, streaming or not), filled by the hooks in :data:`HOOKS`, one module
per hook area:

* :mod:`.request` — the completion calls: a record per call, bound to the thread while the engine
  works on it (:mod:`.calls` holds that per-call state);
* :mod:`.reuse` — ``Llama.generate`` and the request's first ``Llama.eval`` (watched from
  ``generate``; ``eval`` itself is not wrapped): the prompt tokens llama.cpp kept from the live KV
  cache, recomputed, or replayed;
* :mod:`.sampling` — ``Llama.sample``: chosen id, top-1, runner-up, margin and log-probability
  from the raw logits row, in one pass (:mod:`kvtrace.patches.rowstats`, compiled where it was built);
* :mod:`.prompt_cache` — ``Llama.load_state`` and the ``BaseLlamaCache`` classes: lookups,
  restores, stores and evictions, each with the origin of the state;
* :mod:`.model_load` — ``Llama.__init__``: the weight repack off where ``KVTRACE_LLAMA_REPACK=off``
  asks, and a warning for a quantized model loaded with the repack on an Intel AMX CPU;
* :mod:`.config` — what the ``Llama`` is configured with (fingerprint, weight format, numerics);
* :mod:`.batching` — at the call's end, its batch composition: how the prompt was split into
  micro-batches, and the one-row steps of its tokens (from the settings, nothing watched per token);
* :mod:`.server` — ``llama_cpp.server``'s app: each HTTP request's W3C context becomes current.

Beside the hooks: :mod:`.repack` loads kvtrace's own engines without llama.cpp's weight repack
(and detects Intel AMX), :mod:`.log` routes llama.cpp's log to Python logging around kvtrace's
own calls.

Invariants: the engine's return values and buffers are never modified (the logits view is
read-only); every hook catches its own failures, counts them in
``recorder.pipeline.counters["instrumentation_errors"]`` and returns the engine's result unchanged.
"""

from __future__ import annotations

from kvtrace import semconv as sc
from kvtrace.patches.hooks import Hook, HookTable
from kvtrace.patches.llama_cpp import model_load, prompt_cache, request, reuse, sampling, server
from kvtrace.patches.llama_cpp.engine import ENGINE, FAILURES, MODULE, VERSION

__all__ = ["ENGINE", "MODULE", "VERSION", "HOOKS", "get_version", "supported_versions", "patch", "unpatch"]

LLAMA_MODULE = "llama_cpp.llama"

HOOKS = HookTable(ENGINE, [
    Hook(LLAMA_MODULE, "Llama.__init__", model_load.init_wrapper),
    Hook(LLAMA_MODULE, "Llama.create_completion", request.completion_wrapper(sc.OPERATION_TEXT_COMPLETION)),
    Hook(LLAMA_MODULE, "Llama.create_chat_completion", request.completion_wrapper(sc.OPERATION_CHAT)),
    Hook(LLAMA_MODULE, "Llama.generate", reuse.generate_wrapper),
    Hook(LLAMA_MODULE, "Llama.sample", sampling.sample_wrapper),
    Hook(LLAMA_MODULE, "Llama.load_state", prompt_cache.load_state_wrapper),
    *(Hook(prompt_cache.CACHE_MODULE, f"{cls}.{method}", wrapper)
      for cls in prompt_cache.BUILT_IN_CACHES for method, wrapper in prompt_cache.CACHE_METHODS.items()),
    Hook(server.SERVER_MODULE, "create_app", server.create_app_wrapper),
], FAILURES)
"""Every hook on llama-cpp-python; users' cache subclasses get the cache hooks when first met."""


def get_version() -> str:
    """Installed llama-cpp-python version ("" when not installed)."""
    return VERSION.installed()


def supported_versions() -> dict[str, str]:
    """Distribution name → version specifier this patch is written against."""
    return VERSION.supported()


def patch() -> bool:
    """Instrument llama-cpp-python.  Idempotent; returns whether it is instrumented.

    An unsupported version is refused with a logged message; nothing raises.  Modules of
    llama-cpp-python imported later are wrapped when they are imported.
    """
    if HOOKS.active:
        return True
    if not VERSION.gate(get_version()):
        return False
    HOOKS.install()
    prompt_cache.CACHE_CLASSES.install()
    return True


def unpatch() -> None:
    """Restore every wrapped attribute (newest first).  Idempotent."""
    prompt_cache.CACHE_CLASSES.restore()
    HOOKS.restore()
