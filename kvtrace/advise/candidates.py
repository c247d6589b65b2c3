"""The engine settings ``kvtrace advise`` tries: each a change to the baseline, spelled like the
parts of an experiment run id (``ub1``, ``b64``, ``fa-off``, ``kv-f32``, ``repack-on``), several
joined with ``+`` (``ub32+kv-f32``).

Why these: a cache hit computes the uncached suffix of a prompt as one batch, a full recompute
computes the whole prompt as another, and decode computes one token at a time. Wherever llama.cpp
picks a kernel by the number of tokens in a micro-batch, the same position can be reduced in a
different order on each path, and a near tie flips. The candidates remove such choices:

- ``ub1``: every micro-batch is one token, so prefill runs decode's kernels (slowest prefill).
- ``ub32``: micro-batches below ``GGML_FA_TILE_Q`` (64 query rows, ggml-cpu ``common.h``): ggml's
  CPU flash attention takes its tiled path only for ``neq1 >= GGML_FA_TILE_Q``, so every prefill
  chunk takes the one-chunk path a decoded token takes, at a fraction of ``ub1``'s cost.
- ``b64``: a small logical batch (``n_ubatch`` follows it down).
- ``kv-f32``: the KV cache in f32 (no f16 rounding of cached keys and values).
- ``fa-on`` / ``fa-off``: the other attention path.
- ``repack-on``: llama.cpp's default weight repack, which kvtrace turns off; it crashes quantized
  models on AMX CPUs (llama.cpp #20824), so its passes run in their own processes and a crash is a
  result.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from kvtrace.experiment.plan import FLASH_ATTN, KV_TYPES, WEIGHT_REPACK, EngineSettings

BASELINE = "defaults"
"""The name of the baseline setting (the one every speed is relative to)."""

FA_TILE_Q = 64
"""ggml-cpu's ``GGML_FA_TILE_Q``: flash attention tiles a micro-batch of at least this many queries."""

DEFAULT_CHANGES = ("ub1", f"ub{FA_TILE_Q // 2}", "b64", "kv-f32", "fa-flip", "repack-on")
"""Tried when ``--settings`` is not given; ``fa-flip`` is the attention path the baseline does not use."""

_CHANGE = re.compile(r"(ub|b)(\d+)|(fa|kv|repack)-(\w+)")


@dataclass(frozen=True)
class Candidate:
    """One setting to try: its name as given and the engine settings it stands for."""

    name: str
    settings: EngineSettings


def _apply(settings: EngineSettings, change: str) -> EngineSettings:
    m = _CHANGE.fullmatch(change)
    if not m:
        raise ValueError(f"{change!r} is not a setting change; write ubN, bN, fa-on|off, kv-{'|'.join(KV_TYPES)} "
                         f"or repack-on|off, several joined with +")
    if m.group(1):
        n = int(m.group(2))
        if n < 1:
            raise ValueError(f"{change!r}: batch sizes are at least 1")
        if m.group(1) == "ub":
            return replace(settings, n_ubatch=n)
        return replace(settings, n_batch=n, n_ubatch=min(settings.n_ubatch, n))
    knob, value = m.group(3), m.group(4)
    allowed = {"fa": FLASH_ATTN, "kv": KV_TYPES, "repack": WEIGHT_REPACK}[knob]
    if value not in allowed:
        raise ValueError(f"{change!r}: {knob} takes {', '.join(allowed)}")
    field = {"fa": "flash_attn", "kv": "kv_type", "repack": "weight_repack"}[knob]
    return replace(settings, **{field: value})


def parse_candidate(name: str, baseline: EngineSettings) -> Candidate:
    """``ub32+kv-f32`` → the baseline with those changes (ValueError for a change it cannot read)."""
    settings = baseline
    for change in name.split("+"):
        change = change.strip()
        if change == "fa-flip":
            change = "fa-off" if baseline.flash_attn == "on" else "fa-on"
        settings = _apply(settings, change)
    if settings.n_ubatch > settings.n_batch:
        raise ValueError(f"{name!r}: n_ubatch {settings.n_ubatch} is larger than n_batch {settings.n_batch}")
    if settings.kv_type == "q8_0" and settings.flash_attn != "on":
        raise ValueError(f"{name!r}: a q8_0 KV cache needs flash attention on")
    return Candidate(name.replace("fa-flip", f"fa-{settings.flash_attn}"), settings)


def parse_candidates(names: tuple[str, ...], baseline: EngineSettings) -> list[Candidate]:
    """The baseline first, then each named candidate; ValueError for an unreadable name, a setting
    named twice or one that is the baseline itself."""
    if not names:
        raise ValueError("give at least one setting to try")
    found = [Candidate(BASELINE, baseline)]
    for name in names:
        candidate = parse_candidate(name, baseline)
        twin = next((c for c in found if c.settings == candidate.settings), None)
        if twin is not None:
            raise ValueError(f"{name!r} is the same engine setting as {twin.name!r} ({candidate.settings.label})")
        found.append(candidate)
    return found
