"""A small stand-in for llama-cpp-python's ``Llama`` and ``LlamaRAMCache``, and the package's hooks on it.

It keeps llama-cpp-python 0.3.36's bookkeeping where the hooks read it — ``_input_ids`` /
``n_tokens`` (the live context), ``generate``'s prefix match with its one-token replay, ``eval``,
``sample(…, idx)`` over a logits row that ``_ctx.get_logits_ith`` points to, the prompt cache's
lookup / ``load_state`` / store in ``create_completion`` — and nothing else: the "model" is a
fixed table of logits per previous token, so greedy decoding is deterministic.
"""

from __future__ import annotations

import ctypes
import itertools
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import numpy as np
import wrapt

from kvtrace.patches.llama_cpp import HOOKS


def lcp(a: Sequence[int], b: Sequence[int]) -> int:
    """Longest common prefix, the way llama-cpp-python counts it."""
    return sum(1 for _ in itertools.takewhile(lambda pair: pair[0] == pair[1], zip(a, b)))


@dataclass
class FakeState:
    """``LlamaState``: the whole ``n_ctx`` id buffer (as llama-cpp-python keeps it) and ``n_tokens``."""

    input_ids: np.ndarray
    n_tokens: int
    llama_state_size: int


class FakeContext:
    def __init__(self, llama: "FakeLlama"):
        self.llama = llama

    def get_logits_ith(self, ridx: int):
        """A pointer to the logits row ``ridx`` (negative: from the end), NULL where there is none."""
        llama = self.llama
        position = llama.n_tokens + ridx
        if llama.no_logits or not 0 <= position < llama.n_tokens:
            return ctypes.POINTER(ctypes.c_float)()
        return llama.logits[position].ctypes.data_as(ctypes.POINTER(ctypes.c_float))


class FakeLlama:
    def __init__(self, n_vocab: int = 64, n_ctx: int = 128, seed: int = 0, state_size: int = 100):
        self._n_vocab = n_vocab
        self._input_ids = np.zeros(n_ctx, dtype=np.intc)
        self.n_tokens = 0
        self.logits = np.zeros((n_ctx, n_vocab), dtype=np.float32)
        self.table = np.random.default_rng(seed).standard_normal((n_vocab, n_vocab)).astype(np.float32)
        self._ctx = FakeContext(self)
        self._seed = 1234
        self.last_n_tokens_size = 64
        self.model_path = "/models/fake-F32.gguf"
        self.cache: Any = None
        self.state_size = state_size
        self.no_logits = False
        self.sampled_offset = 0
        """Added to every sampled id (an engine whose sampler picks what the raw logits do not show)."""
        # What the config module computes once from GGUF metadata and ctypes params and caches on the
        # instance: preset, so requests on this stand-in need neither (the config tests compute it).
        self._kvtrace_static_config: dict = {}

    @property
    def input_ids(self) -> np.ndarray:
        return self._input_ids[: self.n_tokens]

    def eval(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            self._input_ids[self.n_tokens] = token
            self.logits[self.n_tokens] = self.table[token]
            self.n_tokens += 1

    def sample(self, top_k=40, top_p=0.95, min_p=0.05, typical_p=1.0, temp=0.80, repeat_penalty=1.0,
               frequency_penalty=0.0, presence_penalty=0.0, tfs_z=1.0, mirostat_mode=0, mirostat_eta=0.1,
               mirostat_tau=5.0, penalize_nl=True, logits_processor=None, grammar=None, idx=None):
        row = self.logits[idx if idx is not None else self.n_tokens - 1]
        return int(row.argmax()) + self.sampled_offset

    def generate(self, tokens, top_k=40, top_p=0.95, min_p=0.05, typical_p=1.0, temp=0.80, repeat_penalty=1.0,
                 reset=True, frequency_penalty=0.0, presence_penalty=0.0, tfs_z=1.0, mirostat_mode=0,
                 mirostat_tau=5.0, mirostat_eta=0.1, penalize_nl=True, logits_processor=None,
                 stopping_criteria=None, grammar=None) -> Iterator[int]:
        tokens = list(tokens)
        if reset and self.n_tokens > 0:
            prefix = lcp(self.input_ids, tokens)
            keep = prefix - 1 if prefix == len(tokens) else prefix  # nothing left to decode: replay one
            if keep > 0:
                reset, tokens, self.n_tokens = False, tokens[keep:], keep
        if reset:
            self.n_tokens = 0
        while True:
            self.eval(tokens)
            token = self.sample(temp=temp, top_k=top_k, top_p=top_p, idx=self.n_tokens - 1)
            yield token
            tokens = [token]

    def save_state(self) -> FakeState:
        return FakeState(self._input_ids.copy(), self.n_tokens, self.state_size)

    def load_state(self, state: FakeState) -> None:
        self._input_ids[:] = state.input_ids
        self.n_tokens = state.n_tokens

    def reset(self) -> None:
        self.n_tokens = 0

    def create_completion(self, prompt: Sequence[int], max_tokens: int = 4, stream: bool = False,
                          temperature: float = 0.0, fail_after: Optional[int] = None):
        steps = self._completion(list(prompt), max_tokens, temperature, fail_after)
        if stream:
            return steps
        tokens = [chunk["choices"][0]["token"] for chunk in steps]
        return {"choices": [{"tokens": tokens, "finish_reason": "length"}]}

    def create_chat_completion(self, messages: Sequence[Sequence[int]], max_tokens: int = 4):
        prompt = [token for message in messages for token in message]
        return self.create_completion(prompt, max_tokens=max_tokens)  # a nested call, as the real one is

    def _completion(self, prompt: list[int], max_tokens: int, temperature: float,
                    fail_after: Optional[int]) -> Iterator[dict]:
        if self.cache is not None:
            try:
                item = self.cache[prompt]
                if lcp(item.input_ids[: item.n_tokens].tolist(), prompt) > lcp(self.input_ids.tolist(), prompt):
                    self.load_state(item)
            except KeyError:
                pass  # a miss
        completion: list[int] = []
        for token in self.generate(prompt, temp=temperature):
            completion.append(token)
            if len(completion) == fail_after:
                raise RuntimeError("decode failed")
            last = len(completion) == max_tokens
            yield {"choices": [{"token": token, "finish_reason": "length" if last else None}]}
            if last:
                break
        if self.cache is not None:
            self.cache[prompt + completion] = self.save_state()


class FakeRAMCache:
    """``LlamaRAMCache``: an LRU of states by token tuple, evicting in ``__setitem__``."""

    def __init__(self, capacity_bytes: int = 1000):
        self.capacity_bytes = capacity_bytes
        self.cache_state: OrderedDict[tuple, FakeState] = OrderedDict()

    def _find_longest_prefix_key(self, key: tuple) -> Optional[tuple]:
        best, best_len = None, 0
        for k in self.cache_state:
            n = lcp(k, key)
            if n > best_len:
                best, best_len = k, n
        return best

    def __getitem__(self, key: Sequence[int]) -> FakeState:
        found = self._find_longest_prefix_key(tuple(key))
        if found is None:
            raise KeyError("Key not found")
        self.cache_state.move_to_end(found)
        return self.cache_state[found]

    def __setitem__(self, key: Sequence[int], value: FakeState) -> None:
        key = tuple(key)
        self.cache_state.pop(key, None)
        self.cache_state[key] = value
        while self.cache_state and sum(v.llama_state_size for v in self.cache_state.values()) > self.capacity_bytes:
            self.cache_state.popitem(last=False)


class FakeDiskStore(dict):
    def iterkeys(self):
        return iter(list(self))


class FakeDiskCache(FakeRAMCache):
    """``LlamaDiskCache``: keys listed through ``cache.iterkeys()``, and a lookup pops its entry."""

    def __init__(self, capacity_bytes: int = 1000):
        super().__init__(capacity_bytes)
        self.cache = FakeDiskStore()
        del self.cache_state

    def _find_longest_prefix_key(self, key: tuple) -> Optional[tuple]:
        return max(self.cache.iterkeys(), key=lambda k: lcp(k, key), default=None)

    def __getitem__(self, key: Sequence[int]) -> FakeState:
        found = self._find_longest_prefix_key(tuple(key))
        if found is None:
            raise KeyError("Key not found")
        return self.cache.pop(found)

    def __setitem__(self, key: Sequence[int], value: FakeState) -> None:
        self.cache[tuple(key)] = value


def with_hooks(cls: type, engine_class: str) -> type:
    """A subclass of ``cls`` carrying the package's hooks on ``engine_class``, wrapped as ``patch()`` would.

    The wrappers come from the package's own hook table, so what is tested is what it installs.
    """
    methods = {}
    for hook in HOOKS.hooks:
        owner, _, name = hook.target.rpartition(".")
        if owner == engine_class:
            methods[name] = wrapt.FunctionWrapper(getattr(cls, name), hook.wrapper)
    assert methods, f"the hook table has no hooks on {engine_class}"
    return type(cls.__name__, (cls,), methods)


Llama = with_hooks(FakeLlama, "Llama")
RAMCache = with_hooks(FakeRAMCache, "LlamaRAMCache")
DiskCache = with_hooks(FakeDiskCache, "LlamaDiskCache")
