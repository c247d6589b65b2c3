"""What a ``Llama`` is configured with: model identity, weight format, numerics, cache settings.

Everything here is static for the life of a ``Llama`` except the cache settings, so the rest is
computed once per instance (cached on it) and copied into each request's record.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from kvtrace import semconv as sc
from kvtrace.patches.llama_cpp.engine import VERSION
from kvtrace.patches.llama_cpp.repack import cpu_has_amx, llama_system_info, loaded_with_repack

FINGERPRINT_TAIL_BYTES = 65536
SYSTEM_INFO_CHARS = 200


def model_name(llama: Any, kwargs: dict) -> str:
    """The request's ``model`` argument, else the model file's name."""
    name = kwargs.get("model")
    if name:
        return str(name)
    return os.path.basename(str(getattr(llama, "model_path", "") or ""))


def static_config(llama: Any) -> dict[str, Any]:
    """Per-``Llama`` configuration (computed once, cached on the instance); a copy for one record."""
    cached = getattr(llama, "_kvtrace_static_config", None)
    if cached is None:
        cached = _compute_static_config(llama)
        try:
            llama._kvtrace_static_config = cached
        except Exception:
            pass
    return dict(cached)


def _compute_static_config(llama: Any) -> dict[str, Any]:
    metadata = dict(getattr(llama, "metadata", {}) or {})
    params = llama.context_params
    type_k, type_v = _ggml_type_name(params.type_k), _ggml_type_name(params.type_v)
    numerics = {
        "n_ctx": int(llama.n_ctx()),
        "n_batch": int(llama.n_batch),
        "n_ubatch": int(params.n_ubatch),
        "n_threads": int(params.n_threads),
        "n_threads_batch": int(params.n_threads_batch),
        "flash_attn": _flash_attn(params.flash_attn_type),
        "type_k": type_k,
        "type_v": type_v,
        "logits_all": bool(getattr(llama, "_logits_all", False)),
        "offload_kqv": bool(params.offload_kqv),
        "n_gpu_layers": int(llama.model_params.n_gpu_layers),
        # Repacked weights (AMX and other extra buffer types) run other kernels, hence other numerics.
        "weight_repack": loaded_with_repack(llama),
        "cpu_amx": cpu_has_amx(),
    }
    config: dict[str, Any] = {
        sc.ENGINE_VERSION: VERSION.installed(),
        sc.MODEL_FINGERPRINT: fingerprint(str(getattr(llama, "model_path", "")), metadata),
        sc.MODEL_WEIGHT_FORMAT: weight_format(metadata),
        sc.KV_CACHE_TYPE: type_k if type_k == type_v else f"{type_k}/{type_v}",
        sc.NUMERICS_SETTINGS: numerics,
    }
    system_info = llama_system_info()[:SYSTEM_INFO_CHARS]
    if system_info:
        numerics["system_info"] = system_info  # CPU features pick the kernels, hence the numerics
    return config


def cache_settings(llama: Any) -> dict[str, Any]:
    """The caches this ``Llama`` has now (the prompt cache can be set between requests)."""
    cache = getattr(llama, "cache", None)
    settings: dict[str, Any] = {"kv_reuse": True, "prompt_cache": None}
    if cache is not None:
        settings["prompt_cache"] = type(cache).__name__
        settings["capacity_bytes"] = getattr(cache, "capacity_bytes", None)
    return settings


def fingerprint(path: str, metadata: dict[str, str]) -> str:
    """Cheap identity of the weights: GGUF metadata, file size and the file's last 64 KiB.

    The tail lies inside the tensor data, so two random-weight files with
    identical metadata still differ; nothing near the file's full size is read.
    """
    digest = hashlib.blake2b(digest_size=16)
    digest.update(json.dumps(metadata, sort_keys=True).encode())
    try:
        size = os.path.getsize(path)
        digest.update(str(size).encode())
        with open(path, "rb") as f:
            f.seek(max(0, size - FINGERPRINT_TAIL_BYTES))
            digest.update(f.read(FINGERPRINT_TAIL_BYTES))
    except OSError:
        pass
    return digest.hexdigest()


def weight_format(metadata: dict[str, str]) -> str:
    """``Q8_0``, ``F16``, … from GGUF's ``general.file_type`` (``unknown`` when absent)."""
    raw = metadata.get("general.file_type")
    if raw is None:
        return "unknown"
    try:
        from gguf import LlamaFileType  # optional heavy import, only for a model that names its type

        name = LlamaFileType(int(raw)).name
        return name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except Exception:
        return f"file_type_{raw}"


def _ggml_type_name(value: int) -> str:
    try:
        from gguf import GGMLQuantizationType  # optional heavy import, as in weight_format

        return GGMLQuantizationType(int(value)).name.lower()
    except Exception:
        return str(value)


def _flash_attn(value: int) -> str:
    return {-1: "auto", 0: "disabled", 1: "enabled"}.get(int(value), str(value))
