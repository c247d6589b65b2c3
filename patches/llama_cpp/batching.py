"""The batch composition of a llama-cpp-python request (docs/batching.md), filled in when it finishes.

``Llama`` decodes one sequence: ``eval`` hands llama.cpp the computed prompt tokens in chunks of
``n_batch``, which llama.cpp splits into micro-batches of ``n_ubatch`` (the steps whose kernels decide
the numerics), then one sampled token per step.  So the arrays follow from the settings and the
prompt's computed length, with nothing to watch per token: the first generated token's logits come
from the prompt's last micro-batch, every later one from a one-token step.  A draft model (speculative
decoding) evaluates several tokens per step, which is not seen here: its requests say ``unknown``.
"""

from __future__ import annotations

from typing import Any

from kvtrace import semconv as sc
from kvtrace.recording.records import RequestRecord


def prefill_split(computed: int, n_batch: int, n_ubatch: int) -> list[int]:
    """The micro-batches ``computed`` prompt tokens go through: ``n_batch`` chunks, each split by ``n_ubatch``."""
    step = max(1, min(n_batch, n_ubatch))  # llama-cpp-python and llama.cpp both cap n_ubatch at n_batch
    split = []
    for start in range(0, computed, max(1, n_batch)):
        chunk = min(n_batch, computed - start)
        split += [min(step, chunk - i) for i in range(0, chunk, step)]
    return split


def record_batch_composition(record: RequestRecord, llama: Any) -> None:
    """Fill the record's step arrays from its settings, or say ``unknown`` where they cannot tell."""
    numerics = record.config.get(sc.NUMERICS_SETTINGS) or {}
    n_batch, n_ubatch = numerics.get("n_batch"), numerics.get("n_ubatch")
    if getattr(llama, "draft_model", None) is not None or not (isinstance(n_batch, int) and isinstance(n_ubatch, int)):
        record.batch_composition = sc.BATCH_UNKNOWN
        return
    split = prefill_split(record.recomputed_tokens, n_batch, n_ubatch)
    generated = len(record.margins) or len(record.output_token_ids)
    record.prefill_steps = split
    record.step_rows = [1] * generated
    record.step_tokens = ([split[-1]] + [1] * (generated - 1))[:generated] if split else [1] * generated
    record.batch_composition = sc.BATCH_RECORDED
