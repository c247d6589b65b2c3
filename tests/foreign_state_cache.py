"""Fault injection for cache integrity: a llama-cpp-python RAM prompt cache that mixes up its entries.

For the lookups it is told to spoil, :class:`ForeignStateCache` hands out the state another prompt
stored, labelled with this prompt's tokens: the KV data, logits and seed are the other prompt's, the
``input_ids`` say they are this prompt's.  llama-cpp-python trusts the labels (it keeps the longest
prefix of ``input_ids`` the prompt shares), so the engine continues from the other conversation,
as a server's RAM prompt cache that restores the wrong entry into a slot does.
"""

from __future__ import annotations

from typing import Callable, Sequence

import llama_cpp
from llama_cpp.llama import LlamaState


class ForeignStateCache(llama_cpp.LlamaRAMCache):
    def __init__(self, spoil: Callable[[tuple[int, ...]], bool], capacity_bytes: int = 256 << 20):
        super().__init__(capacity_bytes=capacity_bytes)
        self.spoil = spoil
        """Whether the lookup of this prompt gets another prompt's state."""
        self.handed_out: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
        """(prompt looked up, key of the foreign state handed out instead), per spoiled lookup."""

    def __getitem__(self, key: Sequence[int]) -> LlamaState:
        key = tuple(key)
        own = self._find_longest_prefix_key(key)
        others = [k for k in self.cache_state if k != own]
        foreign = min(others, key=lambda k: llama_cpp.Llama.longest_token_prefix(k, key), default=None)
        if own is None or foreign is None or not self.spoil(key):
            return super().__getitem__(key)
        other = self.cache_state[foreign]
        n = min(int(other.n_tokens), len(key) - 1)
        input_ids = other.input_ids.copy()
        input_ids[:n] = key[:n]
        self.handed_out.append((key, foreign))
        return LlamaState(input_ids=input_ids, scores=other.scores[:n].copy(), n_tokens=n,
                          llama_state=other.llama_state, llama_state_size=other.llama_state_size, seed=other.seed)
