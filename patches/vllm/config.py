"""What vLLM's configuration says, recorded on every request.

The engine configuration is read once, when the engine core makes its scheduler
(``Scheduler.__init__``); the sampling settings are read per request at its admission.
"""

from __future__ import annotations

import functools
import hashlib
import operator
import os
from pathlib import Path
from typing import Any, Optional

from kvtrace import semconv as sc
from kvtrace.patches.hooks import observing
from kvtrace.patches.vllm.common import FAILURES, VERSION, arg
from kvtrace.patches.vllm.worker import receive_rows
from kvtrace.recording.recorder import get_recorder, settings_text

_SAMPLING_SETTINGS = ("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "presence_penalty",
                      "frequency_penalty", "repetition_penalty", "ignore_eos", "logprobs")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
"""The files a model directory's weights are in: part of its fingerprint."""
FINGERPRINT_TAIL_BYTES = 64 * 1024
_GEN_AI_REQUEST = ((sc.GEN_AI_REQUEST_TEMPERATURE, "temperature"), (sc.GEN_AI_REQUEST_TOP_P, "top_p"),
                   (sc.GEN_AI_REQUEST_TOP_K, "top_k"), (sc.GEN_AI_REQUEST_SEED, "seed"),
                   (sc.GEN_AI_REQUEST_MAX_TOKENS, "max_tokens"))


class EngineSettings:
    """The engine core's configuration as span attributes, and the two values hooks need from it."""

    def __init__(self) -> None:
        self.attributes: dict[str, Any] = {}
        """Keyed by ``semconv`` names; copied into every request's configuration (settings objects as
        their JSON text already: made once here, not once per request)."""
        self.model = ""
        """The served model name."""

    @property
    def block_size(self) -> int:
        """Tokens per KV-cache block (0 until the scheduler is made)."""
        return int(self.attributes.get(sc.PROMPT_BLOCK_SIZE) or 0)

    def read(self, vllm_config: Any) -> None:
        self.attributes, self.model = {}, ""
        model = getattr(vllm_config, "model_config", None)
        cache = getattr(vllm_config, "cache_config", None)
        scheduler = getattr(vllm_config, "scheduler_config", None)
        dtype = str(getattr(model, "dtype", "")).replace("torch.", "")
        quantization = getattr(model, "quantization", None)
        block_size = int(getattr(cache, "block_size", 0) or 0)
        attributes: dict[str, Any] = {
            sc.ENGINE_VERSION: VERSION.installed(),
            sc.MODEL_WEIGHT_FORMAT: str(quantization or dtype),
            sc.KV_CACHE_TYPE: str(getattr(cache, "cache_dtype", "auto")),
            sc.CACHE_SETTINGS: settings_text({
                "prefix_caching": bool(getattr(cache, "enable_prefix_caching", False)),
                "block_size": block_size,
                "hash_algorithm": str(getattr(cache, "prefix_caching_hash_algo", "")),
                "num_blocks": getattr(cache, "num_gpu_blocks", None),
            }),
            sc.MODEL_FINGERPRINT: model_fingerprint(str(getattr(model, "model", "") or "")) or "",
            sc.NUMERICS_SETTINGS: settings_text({
                "dtype": dtype,
                "quantization": quantization,
                "batch_invariant": os.environ.get("VLLM_BATCH_INVARIANT", "0") not in ("", "0"),
                "enforce_eager": bool(getattr(model, "enforce_eager", False)),
                "tensor_parallel_size": getattr(getattr(vllm_config, "parallel_config", None),
                                                "tensor_parallel_size", 1),
                # The bounds of a step's batch: how many rows and tokens it may hold (docs/batching.md).
                "max_num_seqs": getattr(scheduler, "max_num_seqs", None),
                "max_num_batched_tokens": getattr(scheduler, "max_num_batched_tokens", None),
                "chunked_prefill": bool(getattr(scheduler, "enable_chunked_prefill", False)),
            }),
        }
        if block_size:
            attributes[sc.PROMPT_BLOCK_SIZE] = block_size
        served = getattr(model, "served_model_name", None) or getattr(model, "model", "")
        self.attributes = attributes
        self.model = served[0] if isinstance(served, (list, tuple)) and served else str(served or "")


SETTINGS = EngineSettings()


def model_fingerprint(model: str) -> Optional[str]:
    """Cheap identity of a local model directory: its ``config.json``, and each weight file's name, size and
    last 64 KiB (inside the tensor data, so two random-weight models of one shape differ), read once at
    engine start. None for a model that is not a local directory (a hub name: its files are vLLM's to find)."""
    folder = Path(model)
    try:
        digest = hashlib.blake2b((folder / "config.json").read_bytes(), digest_size=16)
        weights = sorted(f for f in folder.iterdir() if f.is_file() and f.name.endswith(WEIGHT_SUFFIXES))
        for weight in weights:
            size = weight.stat().st_size
            digest.update(f"{weight.name}:{size}".encode())
            with open(weight, "rb") as f:
                f.seek(max(0, size - FINGERPRINT_TAIL_BYTES))
                digest.update(f.read(FINGERPRINT_TAIL_BYTES))
    except OSError:
        return None
    return digest.hexdigest()


def _on_scheduler_init(result: Any, scheduler: Any, args: tuple, kwargs: dict) -> None:
    """``Scheduler.__init__(vllm_config, ...)``: also makes this engine core's recorder now, while vLLM
    starts up, rather than inside the first request's admission (tens of ms: the SDK resource, the
    exporter thread, the spool file), and lets the scheduler of an ``mp`` executor take the rows its
    worker ships (:func:`~kvtrace.patches.vllm.worker.receive_rows`)."""
    vllm_config = arg(args, kwargs, 0, "vllm_config")
    SETTINGS.read(vllm_config)
    get_recorder()
    receive_rows(scheduler, vllm_config)


scheduler_init = observing(FAILURES, "scheduler init", _on_scheduler_init)


_read_sampling_settings = operator.attrgetter(*_SAMPLING_SETTINGS)


def sampling_attributes(params: Any) -> dict[str, Any]:
    """A request's ``SamplingParams`` as span attributes (a dict shared by every request with the same
    settings: read, never changed)."""
    if params is None:
        return {}
    try:
        values = _read_sampling_settings(params)  # one call for every setting: this runs at each admission
    except AttributeError:  # a vLLM without one of them
        values = tuple(getattr(params, name, None) for name in _SAMPLING_SETTINGS)
    try:
        return _sampling_attributes(values, tuple(map(type, values)))
    except TypeError:  # a value that cannot be a cache key (a list, in some future vLLM)
        return _sampling_attributes.__wrapped__(values, ())


@functools.lru_cache(maxsize=256)
def _sampling_attributes(values: tuple, types: tuple) -> dict[str, Any]:
    """Once per distinct settings (``types`` is part of the key: 1 and 1.0 are equal, their texts are not)."""
    settings = dict(zip(_SAMPLING_SETTINGS, values))
    attributes: dict[str, Any] = {
        sc.SAMPLING_SETTINGS: settings_text({name: value for name, value in settings.items() if value is not None})}
    for key, name in _GEN_AI_REQUEST:
        if settings[name] is not None:
            attributes[key] = settings[name]
    return attributes
