"""The prompt caches of the cache arms, with a capacity that bounds the memory they really use.

llama-cpp-python's ``LlamaRAMCache`` counts only the llama.cpp state of each entry against its
capacity, but every ``LlamaState`` also carries a copy of the logits buffer (``n_batch × n_vocab``
floats: 32 MiB for a 32k vocabulary at ``n_batch`` 256) and the ``n_ctx`` input ids. A "1 GiB" cache
of small states therefore grew to many GiB resident. Here the capacity counts every byte an entry
holds, so a pass's peak memory is the model, the context and ``--cache-ram`` plus a constant.
Lookup, restore, store and LRU eviction stay llama-cpp-python's own (and instrumented as such).

This module imports llama-cpp-python: only an engine pass (the child process) imports it.
"""

from __future__ import annotations

import contextlib
import io
import tempfile
from pathlib import Path
from typing import Any, Optional

import llama_cpp


def state_bytes(state: Any) -> int:
    """Resident bytes of one cached ``LlamaState``: llama.cpp state, logits copy and input ids."""
    return int(state.llama_state_size) + int(state.scores.nbytes) + int(state.input_ids.nbytes)


class BoundedRAMCache(llama_cpp.LlamaRAMCache):
    """``LlamaRAMCache`` whose ``capacity_bytes`` counts every byte of every stored state."""

    @property
    def cache_size(self) -> int:
        return sum(state_bytes(state) for state in self.cache_state.values())


class QuietDiskCache(llama_cpp.LlamaDiskCache):
    """``LlamaDiskCache`` without the lines its store prints to stderr on every request.

    Its capacity counts the bytes on disk (``diskcache``'s volume); a lookup pops the entry it
    returns, so a restored state is stored again only by the request that used it.
    """

    def __setitem__(self, key, value) -> None:
        with contextlib.redirect_stderr(io.StringIO()):
            super().__setitem__(key, value)


def open_cache(arm: str, capacity: int, directory: Optional[Path] = None):
    """The prompt cache of a cache arm (``prompt-cache``: RAM, ``disk-cache``: a directory)."""
    if arm == "prompt-cache":
        return BoundedRAMCache(capacity_bytes=capacity)
    if arm == "disk-cache":
        return QuietDiskCache(cache_dir=str(directory or tempfile.mkdtemp(prefix="kvtrace-disk-cache-")),
                              capacity_bytes=capacity)
    raise ValueError(f"{arm!r} is not a cache arm")
