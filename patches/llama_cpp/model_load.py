"""``Llama.__init__``: a user's model load — ``KVTRACE_LLAMA_REPACK=off``, and the Intel AMX warning.

On some Intel AMX Xeons a quantized model loaded with llama.cpp's weight repack on (its default)
crashes or hangs in its first decode (:mod:`.repack`).  kvtrace leaves a user's load as the user wrote
it, so the engine's numerics stay the user's; instead it warns, once per model file and process,
right after such a load and before any decode, naming the two ways out: kvtrace's ``load_llama`` and
``KVTRACE_LLAMA_REPACK=off``.  With that variable every instrumented ``Llama`` loads with the repack
off, the way ``load_llama`` loads.  Either way each request's ``weight_repack`` says how the weights
were loaded.  Loads by kvtrace's own ``load_llama`` are left as it chose.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Optional

from kvtrace.config import LLAMA_REPACK_VARIABLE, llama_repack
from kvtrace.errors import BadSetting
from kvtrace.patches.llama_cpp.config import weight_format
from kvtrace.patches.llama_cpp.engine import FAILURES
from kvtrace.patches.llama_cpp.repack import REPACK, UPSTREAM_ISSUE, cpu_has_amx, loaded_with_repack

log = logging.getLogger("kvtrace")


class Notices:
    """What this process has said once already: one AMX warning per model file, one per bad setting."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._said: set[tuple[str, str]] = set()

    def first(self, kind: str, subject: str) -> bool:
        """Whether ``(kind, subject)`` is new; from now on it is not."""
        with self._lock:
            if (kind, subject) in self._said:
                return False
            self._said.add((kind, subject))
            return True

    def forget(self) -> None:
        """Say everything again (tests)."""
        with self._lock:
            self._said.clear()


NOTICES = Notices()


def init_wrapper(wrapped, instance, args, kwargs):
    """``Llama.__init__``: without the repack where ``KVTRACE_LLAMA_REPACK=off`` asks; then the AMX warning."""
    if REPACK.chosen is not None:  # kvtrace's own load_llama: the repack is as it chose
        return wrapped(*args, **kwargs)
    try:
        turn_off = repack_off_requested() and REPACK.install()
    except Exception:
        FAILURES.count("Llama.__init__ (KVTRACE_LLAMA_REPACK)")
        turn_off = False
    if turn_off:
        with REPACK.off():
            result = wrapped(*args, **kwargs)
    else:
        result = wrapped(*args, **kwargs)
    try:
        warn_if_amx_may_crash(instance)
    except Exception:
        FAILURES.count("Llama.__init__")
    return result


def repack_off_requested() -> bool:
    """``KVTRACE_LLAMA_REPACK=off``; a bad value is said once and loads as the code asks."""
    try:
        return llama_repack() == "off"
    except BadSetting as exc:
        if NOTICES.first("setting", str(exc)):
            log.warning("kvtrace: %s; models load as the code asks", exc)
        return False


def warn_if_amx_may_crash(llama: Any) -> bool:
    """Warn when ``llama`` holds quantized weights loaded with the repack on, on an AMX CPU; whether it warned.

    Once per model file and process.  The CPU is read through :func:`.repack.cpu_has_amx`.
    """
    params = getattr(llama, "model_params", None)
    if not loaded_with_repack(llama) or getattr(params, "vocab_only", False):
        return False  # no weights repacked (vocab_only loads none), or a load that says nothing
    if not cpu_has_amx():
        return False
    quantized = quantized_format(llama)
    model_path = str(getattr(llama, "model_path", "") or "")
    if quantized is None or not NOTICES.first("amx", model_path):
        return False
    log.warning("kvtrace: %s is quantized (%s) and was loaded with llama.cpp's weight repack on, on a CPU with "
                "Intel AMX: its first decode may crash (SIGSEGV) or hang (%s). Load it with "
                "kvtrace.patches.llama_cpp.repack.load_llama(...) or set %s=off (docs/tracing.md, "
                "\"Intel AMX machines\"); said once per model file", model_path, quantized, UPSTREAM_ISSUE,
                LLAMA_REPACK_VARIABLE)
    return True


def quantized_format(llama: Any) -> Optional[str]:
    """The weight format of a quantized model (``Q4_0``, ``Q4_K_M``…); ``None`` for F32 / F16 / BF16 weights,
    which llama.cpp does not repack, or when the format cannot be read."""
    metadata = dict(getattr(llama, "metadata", None) or {})
    raw = metadata.get("general.file_type")
    if raw is None:
        return quantized_tensor_type(str(getattr(llama, "model_path", "") or ""))
    from gguf import LlamaFileType  # as config.weight_format: the import only once a model is loaded

    try:
        file_type = int(raw)
    except ValueError:
        return None
    if file_type in (LlamaFileType.ALL_F32, LlamaFileType.MOSTLY_F16, LlamaFileType.MOSTLY_BF16):
        return None
    return weight_format(metadata)


def quantized_tensor_type(model_path: str) -> Optional[str]:
    """The first quantized tensor type in a GGUF that names no file type (``None``: none, or unreadable)."""
    try:
        from gguf import GGMLQuantizationType, GGUFReader

        unquantized = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16,
                       GGMLQuantizationType.F64, GGMLQuantizationType.I8, GGMLQuantizationType.I16,
                       GGMLQuantizationType.I32, GGMLQuantizationType.I64}
        for tensor in GGUFReader(model_path, "r").tensors:
            if tensor.tensor_type not in unquantized:
                return tensor.tensor_type.name
    except Exception:
        return None
    return None
