"""A step's sampler rows on a CUDA device in one Triton kernel launch (docs/tracing.md, "vLLM on a GPU").

:func:`~.row_stats.device_rows` in torch takes about twenty operations a step, each a kernel launch
paid in host CPU on the engine's thread; this kernel is one. One program per logits row walks the
vocabulary in blocks of :data:`BLOCK` in the logits' own dtype, keeping the top two (the lower id
first at a tie, greedy's choice) and a running log-sum-exp in float32, then writes the row's
:class:`~.row_stats.SampledRow` with the same tie rule as the torch path: no temporary beyond the
[rows, 6] output. Triton comes with vLLM's CUDA builds; where it is missing, or a launch fails
(counted, once), the torch path runs instead.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

BLOCK = 4096
"""Logits read per iteration of a row's program (16 KiB of float32, 8 KiB of bf16)."""
COMPILE_OPTIONS = {"num_warps": 8, "enable_fp_fusion": False}
"""No multiply-add contraction: the same arithmetic as the interpreter the tests run it in (and Triton 3.9
warns at every first compile that leaves the choice to its default)."""


@functools.cache
def _kernel() -> Any:
    """The compiled-on-first-launch kernel (``None`` without Triton); built on first use so that importing
    this module loads neither torch nor Triton, and so that ``TRITON_INTERPRET=1`` set before that use runs
    it in Triton's interpreter, on CPU tensors (the tests)."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def sampled_rows(logits, row_stride, n, ids, ids_stride, sampled, out,
                     HAS_SAMPLED: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        base = logits + row.to(tl.int64) * row_stride
        lanes = tl.arange(0, BLOCK)
        chosen = tl.minimum(tl.maximum(tl.load(ids + row.to(tl.int64) * ids_stride).to(tl.int32), 0), n - 1)
        first = tl.full([], float("-inf"), tl.float32)
        second = tl.full([], float("-inf"), tl.float32)
        first_id = tl.zeros([], tl.int32)
        second_id = tl.zeros([], tl.int32)
        top = tl.full([], float("-inf"), tl.float32)  # the log-sum-exp's running maximum and sum below it
        total = tl.zeros([], tl.float32)
        for start in range(0, n, BLOCK):
            at = start + lanes
            x = tl.load(base + at, mask=at < n, other=float("-inf")).to(tl.float32)  # exact from bf16/f16
            b1, j1 = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
            b2, j2 = tl.max(tl.where(lanes == j1, float("-inf"), x), axis=0, return_indices=True,
                            return_indices_tie_break_left=True)
            # This block's ids are above every id kept so far: at a tie the kept one stays.
            new_first = b1 > first
            other, other_id = tl.where(new_first, first, second), tl.where(new_first, first_id, second_id)
            rival, rival_id = tl.where(new_first, b2, b1), tl.where(new_first, j2, j1) + start
            take = rival > other
            second, second_id = tl.where(take, rival, other), tl.where(take, rival_id, other_id)
            first, first_id = tl.where(new_first, b1, first), tl.where(new_first, j1 + start, first_id)
            new_top = tl.maximum(top, b1)
            shift = tl.where(new_top == float("-inf"), 0.0, new_top)
            total = total * tl.exp(top - shift) + tl.sum(tl.exp(x - shift), axis=0)
            top = new_top
        chosen_logit = tl.load(base + chosen).to(tl.float32)
        # As the torch path: a chosen token tied with the top is the top-1, the runner-up the other.
        tied = chosen_logit == first
        top1 = tl.where(tied, chosen, first_id)
        runner_up = tl.where(tied & (first_id != chosen), first_id, second_id)
        log_normalizer = tl.where(top == float("-inf"), top, top + tl.log(total))
        flag = (tl.load(sampled + row) > 0).to(tl.float32) if HAS_SAMPLED else 1.0  # a mask or counts
        row_out = out + row * 6
        tl.store(row_out, chosen.to(tl.float32))
        tl.store(row_out + 1, top1.to(tl.float32))
        tl.store(row_out + 2, runner_up.to(tl.float32))
        tl.store(row_out + 3, first - second)
        tl.store(row_out + 4, chosen_logit - log_normalizer)
        tl.store(row_out + 5, flag)

    return sampled_rows


def kernel_rows(logits: Any, chosen: Any, sampled: Optional[Any] = None) -> Optional[Any]:
    """``device_rows``' [rows, 6] float32 tensor from one launch on ``logits``' device and stream, or
    ``None`` where the kernel cannot run them (no Triton; logits whose columns are not adjacent). Reads
    only shapes and strides on the host."""
    kernel = _kernel()
    if kernel is None or logits.dim() != 2 or logits.stride(1) != 1:
        return None
    import torch

    rows, n = logits.shape
    ids = chosen.reshape(rows, -1)  # a view: [rows] or [rows, k], the first column read
    out = torch.empty((rows, 6), dtype=torch.float32, device=logits.device)
    if rows:
        mask = sampled if sampled is not None else logits  # an unread pointer without a mask
        kernel[(rows,)](logits, logits.stride(0), n, ids, ids.stride(0), mask, out, HAS_SAMPLED=sampled is not None,
                        BLOCK=BLOCK, **COMPILE_OPTIONS)
    return out
