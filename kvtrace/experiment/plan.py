"""What one experiment runs: the grid of formats × engine settings × arms × cache sizes × repeats ×
orders, and the run id of each pass.

Every dimension that can change what the engine computes is part of the run id, so two passes never
share one, and the engine records the same settings on every request (numerics and cache settings),
which is what the saved queries group by.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, replace
from typing import Iterator, Optional

from kvtrace.testmodels.llama_gguf import QUANTS

ARMS = ("off", "reuse", "prompt-cache", "disk-cache", "restore")
"""off: ``reset()`` before every request (full recompute); reuse: in-context KV prefix reuse;
prompt-cache: ``reset()`` then a RAM prompt-cache restore (capacity ``--cache-ram``); disk-cache: the
same with llama-cpp-python's disk cache; restore: reuse, plus a control that snapshots the state
before each request and replays it (must reproduce the request exactly)."""

CACHE_ARMS = ("prompt-cache", "disk-cache")
"""Arms that restore stored states: they run once per ``--cache-ram`` value."""

RESET_ARMS = ("off", "prompt-cache", "disk-cache")
"""Arms that clear the in-context KV before every request (nothing reused unless a cache restores it)."""

CONTROL_ARM = "restore-replay"
"""The arm label of the restore control's replays: a check that each path is deterministic, reported
as reproduced / checked, never as an arm of the comparison."""

VLLM_ARMS = ("off", "prefix")
"""The arms of ``--engine vllm``. off: ``reset_prefix_cache()`` before every request, so every prompt
is computed in full by an engine configured exactly like the ``prefix`` arm's (why not
``enable_prefix_caching=False``: see ``kvtrace.experiment.vllm_pass``); prefix: vLLM's automatic
prefix caching, blocks kept between requests."""

ENGINES = ("llama_cpp", "vllm")
"""The engines an experiment runs in-process (``--server`` runs llama-server instead)."""

VLLM_DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
               "half": "float16", "fp32": "float32", "float32": "float32", "float": "float32"}
"""``--dtype`` spellings → the dtype vLLM loads the weights in, spelled as vLLM records it (the
weight format of its requests), which is how a vLLM plan names its formats."""

VLLM_BLOCK_SIZE = 32
"""Tokens per KV-cache block: vLLM's CPU attention needs a multiple of 32, and the smallest block
makes the most prefix reusable."""

ORDERS = ("canonical", "shuffled")

CONVERSATIONS = ("text", "tokens")
"""text: the agent keeps the conversation as text and each turn's prompt is that text tokenized
again, as an agent talking to a server's completion API does (the default: re-tokenization decides
how much of the cached prefix matches, which is where partial reuse and one-token replays come
from); tokens: the prompt is the previous prompt + every generated token id + the observation's
tokens, so the prefix always matches exactly (an idealized harness)."""

SCHEDULES = ("sequential", "interleaved")
"""sequential: each episode runs all its turns before the next starts; interleaved: turn t of every
episode, then turn t+1 of every episode, as one server serving several agents one request at a time
(a prompt cache then holds other episodes' states between an episode's turns)."""

KV_TYPES = ("f16", "q8_0", "f32")
FLASH_ATTN = ("off", "on")
WEIGHT_REPACK = ("off", "on")
"""off: kvtrace's way of loading (``load_llama``); on: llama.cpp's default extra-buffer repack, which
crashes quantized models on AMX CPUs (llama.cpp #20824) — a pass that dies is reported as such."""

DEFAULT_CACHE_RAM = 1 << 30
"""Bytes the prompt cache may hold when ``--cache-ram`` is not given."""

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30,
          "kb": 1000, "mb": 1000 ** 2, "gb": 1000 ** 3}


def parse_bytes(text: str) -> int:
    """``0``, ``1048576``, ``256MiB``, ``1GiB``, ``500MB`` → bytes (ValueError otherwise)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{text!r} is not a size in bytes; write e.g. 0, 256MiB or 1GiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_bytes(n: int) -> str:
    """The shortest exact binary spelling: 0, 512KiB, 256MiB, 1GiB; plain bytes otherwise."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


@dataclass(frozen=True)
class EngineSettings:
    """The llama.cpp context settings of one pass that change numerics."""

    n_batch: int = 256
    n_ubatch: int = 256
    flash_attn: str = "off"
    kv_type: str = "f16"
    weight_repack: str = "off"

    @property
    def label(self) -> str:
        """Its part of the run id, e.g. ``b256.ub1.fa-off.kv-f16`` (``.repack-on`` only when on, so the
        ids of runs made with kvtrace's usual repack-off load keep their spelling)."""
        repack = ".repack-on" if self.weight_repack == "on" else ""
        return f"b{self.n_batch}.ub{self.n_ubatch}.fa-{self.flash_attn}.kv-{self.kv_type}{repack}"


@dataclass(frozen=True)
class VllmSettings:
    """The vLLM settings of one pass that change numerics: eager mode (no graph capture) and how many
    requests the engine runs together (``batch``, its ``max_num_seqs``; docs/batching.md)."""

    enforce_eager: bool = True
    batch: int = 1
    """1: one request at a time, as an agent waiting for its reply sends them; N: each turn's requests of
    every episode sent together, the engine running up to N of them in one step."""

    @property
    def label(self) -> str:
        """Its part of the run id: ``eager``, ``eager.batch-8``."""
        mode = "eager" if self.enforce_eager else "graphs"
        return mode if self.batch == 1 else f"{mode}.batch-{self.batch}"


@dataclass(frozen=True)
class PassKey:
    """One pass of the grid: one fresh engine running every episode once."""

    format: str
    settings: "EngineSettings | VllmSettings"
    arm: str
    cache_ram: Optional[int]
    """Prompt-cache capacity in bytes for the cache arms; None for the others."""
    repeat: int
    order: str

    @property
    def arm_label(self) -> str:
        return self.arm if self.cache_ram is None else f"{self.arm}-{format_bytes(self.cache_ram)}"


@dataclass(frozen=True)
class Plan:
    formats: tuple[str, ...] = ("Q4_0", "Q8_0")
    arms: tuple[str, ...] = ("off", "reuse")
    episodes: int = 16
    turns: int = 4
    tokens: int = 24
    repeats: int = 1
    orders: tuple[str, ...] = ("canonical",)
    seed: int = 0
    prefix: str = "exp"
    n_ctx: int = 1024
    n_threads: int = 1
    n_batch: tuple[int, ...] = (256,)
    n_ubatch: tuple[int, ...] = (256,)
    flash_attn: tuple[str, ...] = ("off",)
    kv_type: tuple[str, ...] = ("f16",)
    weight_repack: tuple[str, ...] = ("off",)
    cache_ram: tuple[int, ...] = (DEFAULT_CACHE_RAM,)
    conversation: str = "text"
    schedule: str = "sequential"
    engine: str = "llama_cpp"
    """llama_cpp: formats are GGUF weight formats; vllm: formats are the dtypes vLLM loads the model
    in (``VLLM_DTYPES`` values), arms ``VLLM_ARMS``, and the llama.cpp knobs do not apply."""
    vllm_batch: tuple[int, ...] = (1,)
    """``--batch`` of ``--engine vllm``: ``VllmSettings.batch`` values, one pass each."""

    def __post_init__(self):
        if self.engine not in ENGINES:
            raise ValueError(f"unknown engine {self.engine!r}; choose from {', '.join(ENGINES)}")
        vllm = self.engine == "vllm"
        formats = sorted(set(VLLM_DTYPES.values())) if vllm else QUANTS
        for values, allowed, what in ((self.formats, formats, "dtype" if vllm else "weight format"),
                                      (self.arms, VLLM_ARMS if vllm else ARMS, "arm"),
                                      (self.orders, ORDERS, "order"),
                                      (self.flash_attn, FLASH_ATTN, "--flash-attn value"),
                                      (self.kv_type, KV_TYPES, "--kv-type"),
                                      (self.weight_repack, WEIGHT_REPACK, "--weight-repack value"),
                                      ((self.conversation,), CONVERSATIONS, "--conversation"),
                                      ((self.schedule,), SCHEDULES, "--schedule")):
            for value in values:
                if value not in allowed:
                    raise ValueError(f"unknown {what} {value!r}; choose from {', '.join(allowed)}")
        if not self.vllm_batch or min(self.vllm_batch) < 1:
            raise ValueError("--batch: give numbers of requests of at least 1")
        if not vllm and self.vllm_batch != (1,):
            raise ValueError("--batch is for --engine vllm; llama.cpp serves one request at a time")
        if min(self.episodes, self.turns, self.tokens, self.repeats, self.n_ctx, self.n_threads) < 1:
            raise ValueError("episodes, turns, tokens, repeats, n_ctx and threads must be at least 1")
        for name in ("formats", "arms", "orders", "n_batch", "n_ubatch", "flash_attn", "kv_type", "weight_repack",
                     "cache_ram"):
            if not getattr(self, name):
                raise ValueError(f"{name.replace('_', '-')}: give at least one value")
        if min(self.n_batch + self.n_ubatch) < 1 or min(self.cache_ram) < 0:
            raise ValueError("--n-batch and --n-ubatch must be at least 1, --cache-ram at least 0")
        for settings in ([] if vllm else self.engine_settings()):
            if settings.n_ubatch > settings.n_batch:
                raise ValueError(f"--n-ubatch {settings.n_ubatch} is larger than --n-batch {settings.n_batch}: "
                                 "llama.cpp splits each batch into micro-batches of at most n_batch tokens")
            if settings.kv_type == "q8_0" and settings.flash_attn != "on":
                raise ValueError("--kv-type q8_0 needs --flash-attn on (llama.cpp quantizes the V cache only "
                                 "with flash attention)")

    def engine_settings(self) -> list:
        """Every combination of the engine knobs, in the order passes run them."""
        if self.engine == "vllm":
            return [VllmSettings(batch=batch) for batch in self.vllm_batch]
        return [EngineSettings(b, ub, fa, kv, repack) for b, ub, fa, kv, repack in
                itertools.product(self.n_batch, self.n_ubatch, self.flash_attn, self.kv_type, self.weight_repack)]

    @property
    def pass_settings(self) -> EngineSettings:
        """The one engine setting of a single pass's plan (``for_pass``)."""
        (settings,) = self.engine_settings()
        return settings

    def for_pass(self, key: PassKey) -> "Plan":
        """This plan narrowed to one pass: its format, engine settings, arm, cache size and order."""
        s = key.settings
        if self.engine == "vllm":
            return replace(self, formats=(key.format,), arms=(key.arm,), orders=(key.order,), repeats=1,
                           vllm_batch=(s.batch,))
        return replace(self, formats=(key.format,), arms=(key.arm,), orders=(key.order,), repeats=1,
                       n_batch=(s.n_batch,), n_ubatch=(s.n_ubatch,), flash_attn=(s.flash_attn,), kv_type=(s.kv_type,),
                       weight_repack=(s.weight_repack,),
                       cache_ram=(key.cache_ram,) if key.cache_ram is not None else self.cache_ram[:1])

    def passes(self) -> Iterator[PassKey]:
        """Every pass, in execution order."""
        for fmt in self.formats:
            for settings in self.engine_settings():
                for repeat in range(self.repeats):
                    for order in self.orders:
                        for arm in self.arms:
                            for ram in (self.cache_ram if arm in CACHE_ARMS else (None,)):
                                yield PassKey(fmt, settings, arm, ram, repeat, order)

    def key(self, fmt: str, arm: str, repeat: int = 0, order: str = "canonical",
            settings: Optional[EngineSettings] = None, cache_ram: Optional[int] = None) -> PassKey:
        """A pass's key; engine settings and cache size default to the first of the grid."""
        if arm in CACHE_ARMS and cache_ram is None:
            cache_ram = self.cache_ram[0]
        return PassKey(fmt, settings or self.engine_settings()[0], arm, cache_ram if arm in CACHE_ARMS else None,
                       repeat, order)

    def run_id(self, key: PassKey) -> str:
        """``PREFIX/FORMAT/SETTINGS/ARM[-CACHE]/rREPEAT/ORDER``, e.g.
        ``exp/Q8_0/b256.ub256.fa-off.kv-f16/prompt-cache-1GiB/r0/canonical``."""
        return f"{self.prefix}/{key.format}/{key.settings.label}/{key.arm_label}/r{key.repeat}/{key.order}"
