"""kvtrace's own llama.cpp engines load without the extra-buffer weight repack (AMX among them).

**What.** llama.cpp can copy quantized weights into "extra" CPU buffer types laid out for a
faster kernel: the AMX buffer type on Intel Xeons with AMX (Sapphire Rapids and newer, common on
cloud servers) and the CPU repack layouts.  On AMX machines that path crashes (SIGSEGV, SIGILL) or
hangs in the first decode of a quantized model (Q8_0, Q4_0, Q4_K_M; llama.cpp issue #20824).
F32 and F16 weights are not repacked.

**Decision.** Every model kvtrace loads itself (demo, experiment, tests, benchmarks) is loaded
with ``llama_model_params.use_extra_bufts = False``, on every CPU rather than only where AMX is
present: the same kernels then run on every kind of machine, so numbers from AMX and non-AMX
machines compare, and the AMX crash cannot happen.  The instrumentation records the setting the
engine actually loaded with (numerics settings, ``weight_repack``), for kvtrace's engines and
users' alike.  A user's engine is never changed.

**How.** llama-cpp-python (written against 0.3.36) has no ``Llama(...)`` argument for
``use_extra_bufts``.  ``Llama.__init__`` fills ``self.model_params`` and hands that same struct
to ``llama_cpp._internals.LlamaModel``, which loads the weights.  :func:`load_llama` sets a
context variable while it constructs the ``Llama``; a wrapper on ``LlamaModel.__init__``
(installed on first use, a pass-through whenever the variable is unset) clears
``use_extra_bufts`` in the params it receives.  Since those are the ``Llama``'s own
``model_params``, ``llm.model_params.use_extra_bufts`` tells afterwards how the weights were
loaded.  The hook is gated on the field existing in the ctypes struct and on
``LlamaModel.__init__`` taking ``params``; where either is missing, :func:`load_llama` loads with
llama.cpp's defaults and says so in the log.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import logging
import re
import threading
from pathlib import Path
from typing import Any, Optional

from kvtrace.patches.llama_cpp_log import llama_log_to_logging

log = logging.getLogger("kvtrace")

UPSTREAM_ISSUE = "llama.cpp #20824"
AMX_CPU_FLAGS = frozenset({"amx_int8", "amx_tile"})

_repack_off: contextvars.ContextVar[bool] = contextvars.ContextVar("kvtrace_repack_off", default=False)
_install_lock = threading.Lock()
_hook_installed: Optional[bool] = None  # None: not tried yet


# --- what this machine and this llama.cpp do -------------------------------------------------


@functools.lru_cache(maxsize=1)
def _proc_cpuinfo() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""  # not Linux: no flags to read, so no AMX claimed


def cpu_has_amx(cpuinfo: Optional[str] = None) -> bool:
    """Whether the CPU reports Intel AMX (``amx_int8`` or ``amx_tile`` among ``/proc/cpuinfo``'s flags).

    ``cpuinfo`` is the text to read instead of ``/proc/cpuinfo``.
    """
    text = _proc_cpuinfo() if cpuinfo is None else cpuinfo
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return not AMX_CPU_FLAGS.isdisjoint(value.split())
    return False


def llama_system_info() -> str:
    """llama.cpp's report of its CPU features and backends ("" without llama-cpp-python)."""
    try:
        import llama_cpp

        info = llama_cpp.llama_print_system_info()
        return (info.decode(errors="replace") if isinstance(info, bytes) else str(info)).strip()
    except Exception:
        return ""


def llama_repacks_for_amx(system_info: Optional[str] = None) -> bool:
    """Whether the installed llama.cpp has its AMX buffer type (``AMX_INT8 = 1`` in its system info)."""
    text = llama_system_info() if system_info is None else system_info
    return re.search(r"\bAMX_INT8\s*=\s*1\b", text) is not None


def amx_hint(cpuinfo: Optional[str] = None, system_info: Optional[str] = None) -> Optional[str]:
    """One line naming the AMX repack as the likely cause of a native crash or hang; ``None`` where
    it cannot be (no AMX in the CPU, or a llama.cpp without the AMX path)."""
    if not (cpu_has_amx(cpuinfo) and llama_repacks_for_amx(system_info)):
        return None
    return (f"this CPU has Intel AMX and the installed llama.cpp repacks quantized weights for it, a path "
            f"known to crash or hang in decode ({UPSTREAM_ISSUE}); load with the repack off "
            f"(model_params.use_extra_bufts = False: kvtrace's own commands and "
            f"kvtrace.patches.llama_cpp_repack.load_llama do; llama-server: --no-repack) or use an F16/F32 model")


def loaded_with_repack(llama: Any) -> Optional[bool]:
    """Whether ``llama``'s weights were loaded with the extra-buffer repack allowed (``None``: unknown)."""
    value = getattr(getattr(llama, "model_params", None), "use_extra_bufts", None)
    return None if value is None else bool(value)


# --- kvtrace's own loads -------------------------------------------------------------------


def load_llama(model_path: str | Path, *, weight_repack: bool = False, **llama_kwargs: Any):
    """A ``llama_cpp.Llama`` for kvtrace's own use: the weight repack off unless ``weight_repack``.

    ``llama_kwargs`` go to ``Llama`` unchanged (``verbose`` defaults to False); llama.cpp's log
    lines during the load go to the ``kvtrace.llama_cpp`` logger at DEBUG.
    """
    import llama_cpp

    llama_kwargs.setdefault("verbose", False)
    with llama_log_to_logging():
        if weight_repack or not _install_hook():
            llm = llama_cpp.Llama(model_path=str(model_path), **llama_kwargs)
        else:
            token = _repack_off.set(True)
            try:
                llm = llama_cpp.Llama(model_path=str(model_path), **llama_kwargs)
            finally:
                _repack_off.reset(token)
    if not weight_repack and _hook_installed and loaded_with_repack(llm):
        log.warning("kvtrace: %s was loaded with llama.cpp's weight repack on although kvtrace turned it off "
                    "(llama-cpp-python %s)", model_path, getattr(llama_cpp, "__version__", "?"))
    return llm


def _without_repack(wrapped, instance, args, kwargs):
    """``LlamaModel.__init__``: inside :func:`load_llama`, the params lose the extra buffer types."""
    if _repack_off.get():
        params = kwargs.get("params")
        if params is not None:
            params.use_extra_bufts = False
    return wrapped(*args, **kwargs)


def _hook_applicable() -> bool:
    import llama_cpp
    import llama_cpp._internals as internals

    fields = {field[0] for field in getattr(llama_cpp.llama_model_params, "_fields_", ())}
    model_class = getattr(internals, "LlamaModel", None)
    if "use_extra_bufts" not in fields or model_class is None:
        return False
    try:
        return "params" in inspect.signature(model_class.__init__).parameters
    except (TypeError, ValueError):
        return False


def _install_hook() -> bool:
    """Wrap ``LlamaModel.__init__`` once per process; whether the repack can be turned off."""
    global _hook_installed
    with _install_lock:
        if _hook_installed is None:
            _hook_installed = False
            try:
                if _hook_applicable():
                    import wrapt
                    import llama_cpp._internals as internals

                    wrapt.wrap_function_wrapper(internals, "LlamaModel.__init__", _without_repack)
                    _hook_installed = True
            except Exception:
                log.debug("kvtrace: cannot hook llama-cpp-python's model load", exc_info=True)
            if not _hook_installed:
                log.warning("kvtrace: this llama-cpp-python offers no way to turn off llama.cpp's weight repack; "
                            "kvtrace's models load with llama.cpp's defaults")
        return _hook_installed
