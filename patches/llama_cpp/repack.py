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
users' alike.  A user's engine is not changed unless the user opts in with ``KVTRACE_LLAMA_REPACK=off``
(:mod:`.model_load`, which also warns about a quantized model loaded with the repack on an AMX CPU).

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

import contextlib
import contextvars
import functools
import inspect
import logging
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import wrapt

from kvtrace.patches.llama_cpp.log import llama_log_to_logging

log = logging.getLogger("kvtrace")

UPSTREAM_ISSUE = "llama.cpp #20824"
AMX_CPU_FLAGS = frozenset({"amx_int8", "amx_tile"})


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
        import llama_cpp  # optional heavy engine import

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
            f"kvtrace.patches.llama_cpp.repack.load_llama do; an instrumented Llama(...) with KVTRACE_LLAMA_REPACK=off; "
            f"llama-server: --no-repack) or use an F16/F32 model")


def loaded_with_repack(llama: Any) -> Optional[bool]:
    """Whether ``llama``'s weights were loaded with the extra-buffer repack allowed (``None``: unknown)."""
    value = getattr(getattr(llama, "model_params", None), "use_extra_bufts", None)
    return None if value is None else bool(value)


# --- kvtrace's own loads -------------------------------------------------------------------


class RepackSwitch:
    """The wrapper on ``LlamaModel.__init__`` that turns the repack off inside :func:`load_llama`.

    Installed on first use, once per process, and never removed: it is a pass-through whenever no
    :func:`load_llama` of this context (nor a load that ``KVTRACE_LLAMA_REPACK=off`` turns off) is
    constructing a ``Llama``.
    """

    def __init__(self) -> None:
        self._choice: contextvars.ContextVar[Optional[bool]] = contextvars.ContextVar("kvtrace_weight_repack",
                                                                                      default=None)
        self._lock = threading.Lock()
        self.installed: Optional[bool] = None
        """Whether the wrapper is in place (``None``: not tried yet)."""

    @contextlib.contextmanager
    def choose(self, weight_repack: bool) -> Iterator[None]:
        """Models loaded in this block (in this context) load with the repack on or off, as kvtrace chose."""
        token = self._choice.set(bool(weight_repack))
        try:
            yield
        finally:
            self._choice.reset(token)

    def off(self) -> contextlib.AbstractContextManager[None]:
        """Models loaded in this block (in this context) load without the repack."""
        return self.choose(False)

    @property
    def chosen(self) -> Optional[bool]:
        """What kvtrace chose for the load in progress in this context (``None``: nothing, the user's load)."""
        return self._choice.get()

    def without_repack(self, wrapped, instance, args, kwargs):
        """``LlamaModel.__init__``: inside :meth:`off`, the params lose the extra buffer types."""
        if self._choice.get() is False:
            params = kwargs.get("params")
            if params is not None:
                params.use_extra_bufts = False
        return wrapped(*args, **kwargs)

    def install(self) -> bool:
        """Wrap ``LlamaModel.__init__`` once per process; whether the repack can be turned off."""
        with self._lock:
            if self.installed is None:
                self.installed = False
                try:
                    if _hook_applicable():
                        import llama_cpp._internals as internals  # optional heavy engine import

                        wrapt.wrap_function_wrapper(internals, "LlamaModel.__init__", self.without_repack)
                        self.installed = True
                except Exception:
                    log.debug("kvtrace: cannot hook llama-cpp-python's model load", exc_info=True)
                if not self.installed:
                    log.warning("kvtrace: this llama-cpp-python offers no way to turn off llama.cpp's weight "
                                "repack; kvtrace's models load with llama.cpp's defaults")
            return self.installed


REPACK = RepackSwitch()


def load_llama(model_path: str | Path, *, weight_repack: bool = False, **llama_kwargs: Any):
    """A ``llama_cpp.Llama`` for kvtrace's own use: the weight repack off unless ``weight_repack``.

    ``llama_kwargs`` go to ``Llama`` unchanged (``verbose`` defaults to False); llama.cpp's log
    lines during the load go to the ``kvtrace.llama_cpp`` logger at DEBUG.
    """
    import llama_cpp  # optional heavy engine import: kvtrace runs without llama-cpp-python

    llama_kwargs.setdefault("verbose", False)
    if not weight_repack:
        REPACK.install()
    # The choice is set either way: the instrumented Llama (.model_load) leaves kvtrace's own loads alone.
    with llama_log_to_logging(), REPACK.choose(weight_repack):
        llm = llama_cpp.Llama(model_path=str(model_path), **llama_kwargs)
    if not weight_repack and REPACK.installed and loaded_with_repack(llm):
        log.warning("kvtrace: %s was loaded with llama.cpp's weight repack on although kvtrace turned it off "
                    "(llama-cpp-python %s)", model_path, getattr(llama_cpp, "__version__", "?"))
    return llm


def _hook_applicable() -> bool:
    """Whether this llama-cpp-python has the ``use_extra_bufts`` field and a ``LlamaModel(params=…)``."""
    import llama_cpp  # optional heavy engine import
    import llama_cpp._internals as internals

    fields = {field[0] for field in getattr(llama_cpp.llama_model_params, "_fields_", ())}
    model_class = getattr(internals, "LlamaModel", None)
    if "use_extra_bufts" not in fields or model_class is None:
        return False
    try:
        return "params" in inspect.signature(model_class.__init__).parameters
    except (TypeError, ValueError):
        return False
