"""The weight-format grid: one base model, quantized to each format with llama.cpp's quantizer (for vLLM:
one Hugging Face directory, loaded in each dtype).

Quantized files are cached in the per-user data dir, keyed by the base model's identity, so
re-running an experiment (or the demo) does not quantize again.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Callable

from kvtrace.config import data_home
from kvtrace.errors import ConfigError
from kvtrace.testmodels.llama_gguf import make_model, quantize, shape_key


def model_cache_dir() -> Path:
    return data_home() / "models"


def generated_models(size: str, formats, progress: Callable[[str], None] = lambda m: None) -> dict[str, Path]:
    """A generated random-weight model of ``size`` in each format (made once, then cached)."""
    paths = {}
    for fmt in formats:
        path = model_cache_dir() / f"generated-{size}-{fmt}-{shape_key(size)}.gguf"
        if not path.is_file():
            progress(f"generating {size} model as {fmt}")
            make_model(path, fmt, size)
        paths[fmt] = path
    return paths


def quantized_models(base: Path, formats, progress: Callable[[str], None] = lambda m: None,
                     threads: int = 1) -> dict[str, Path]:
    """``base`` (an F32/F16/BF16 GGUF) quantized to each format, cached by the base file's identity."""
    base = Path(base)
    if not base.is_file():
        raise ConfigError(f"--model {base}: no such file")
    stat = base.stat()
    key = hashlib.sha256(f"{base.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    folder = model_cache_dir() / f"{base.stem}-{key}"
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for fmt in formats:
        path = folder / f"{fmt}.gguf"
        if not path.is_file():
            progress(f"quantizing {base.name} to {fmt}")
            tmp = folder / f".{fmt}.gguf.partial"
            try:
                quantize(base, tmp, fmt, threads)
            except (RuntimeError, ValueError) as exc:
                raise ConfigError(f"cannot make {fmt} from {base}: {exc} (the base must be an unquantized "
                                  f"F32/F16/BF16 GGUF)") from None
            tmp.replace(path)
        paths[fmt] = path
    return paths



def generated_hf_model(size: str, progress: Callable[[str], None] = lambda m: None) -> Path:
    """A generated random-weight Hugging Face Llama directory of ``size`` for vLLM (made once, then
    cached; vLLM loads it in whichever dtype a pass asks for)."""
    from kvtrace.testmodels.hf_llama import SIZES, make_model

    shape = hashlib.sha256(repr(SIZES[size]).encode()).hexdigest()[:12]
    path = model_cache_dir() / f"generated-hf-{size}-{shape}"
    if not (path / "config.json").is_file():
        progress(f"generating {size} model for vLLM")
        partial = path.with_name(path.name + ".partial")
        make_model(partial, size)
        partial.replace(path)
    return path


def hf_model_directory(path: Path) -> Path:
    """``--model`` for vLLM: a Hugging Face model directory (its ``config.json`` says what to load)."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ConfigError(f"--model {path}: not a Hugging Face model directory (no config.json); vLLM loads "
                          "a directory with config.json, weights and tokenizer")
    return path.resolve()
