"""The engine side of a vLLM replay: start the recorded configuration, refuse a different one, execute steps.

Runs in the replay's engine process (``vllm_child``). vLLM's offline ``LLM`` is started on the model
directory with the recorded settings (dtype, block size, prefix caching and its hash, the batch
bounds, chunked prefill), unrecorded (``KVTRACE_ENABLED=0``); the configuration it then reports, read
by the same code that recorded it (``patches.vllm.config.EngineSettings``), must equal the recorded
one, or nothing runs.

The prefix cache is the only state a request finds: a recompute step runs right after
``reset_prefix_cache()``; a step that starts from a request's end state runs once the cache holds
exactly the blocks of that request and the ones it started from, rebuilt by resetting and
re-running them whenever it holds anything else. vLLM's own count of cached prompt tokens
(``RequestOutput.num_cached_tokens``, what the hooks recorded) is the reused count. A step with
companions (``batch``) sends them in the request's own ``generate`` call; their blocks are not a
request's, so the cache is reset before the next step.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Optional

from kvtrace import semconv as sc
from kvtrace.experiment.vllm_pass import ENGINE_ENVIRONMENT_DEFAULTS
from kvtrace.patches.vllm.config import EngineSettings
from kvtrace.replay.recorded import VLLM, VLLM_RUNTIME_CACHE_SETTINGS, EngineConfiguration

REPLAY_ENVIRONMENT = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine core in this process: one process to watch
    "KVTRACE_ENABLED": "0",  # a replay re-executes a record; it makes none
}


def load_engine(model: Path, recorded: EngineConfiguration, max_model_len: int):
    """vLLM's ``LLM`` on ``model`` with the recorded settings (what is not recorded is left to vLLM)."""
    for name, value in REPLAY_ENVIRONMENT.items():
        os.environ[name] = value
    for name, value in ENGINE_ENVIRONMENT_DEFAULTS.items():
        os.environ.setdefault(name, value)
    numerics, cache = recorded.numerics, recorded.cache
    if numerics.get("batch_invariant") is not None:  # read by vLLM when it is imported
        os.environ["VLLM_BATCH_INVARIANT"] = "1" if numerics["batch_invariant"] else "0"
    from vllm import LLM

    settings = {"dtype": numerics.get("dtype"), "quantization": numerics.get("quantization"),
                "enforce_eager": numerics.get("enforce_eager"),
                "tensor_parallel_size": numerics.get("tensor_parallel_size"),
                "max_num_seqs": numerics.get("max_num_seqs"),
                "max_num_batched_tokens": numerics.get("max_num_batched_tokens"),
                "enable_chunked_prefill": numerics.get("chunked_prefill"),
                "block_size": cache.get("block_size") or None,
                "enable_prefix_caching": cache.get("prefix_caching"),
                "prefix_caching_hash_algo": cache.get("hash_algorithm") or None}
    settings = {k: v for k, v in settings.items() if v is not None}
    return LLM(model=str(model), max_model_len=max_model_len, distributed_executor_backend="uni", seed=0,
               **settings)


def configuration_of(llm, recorded: EngineConfiguration) -> EngineConfiguration:
    """This engine as a recorded request would describe it, in the settings the recording holds (a
    setting recorded only by later kvtrace versions is not asked of an older recording)."""
    settings = EngineSettings()
    settings.read(llm.llm_engine.vllm_config)
    attributes = settings.attributes
    numerics = json.loads(attributes[sc.NUMERICS_SETTINGS])
    cache = json.loads(attributes[sc.CACHE_SETTINGS])
    return EngineConfiguration(
        VLLM, attributes[sc.ENGINE_VERSION], recorded.model, attributes.get(sc.MODEL_FINGERPRINT) or "",
        {k: v for k, v in numerics.items() if k in recorded.numerics},
        {k: v for k, v in cache.items() if k in recorded.cache and k not in VLLM_RUNTIME_CACHE_SETTINGS})


def refusal(recorded: EngineConfiguration, here: EngineConfiguration) -> str:
    """Why this engine cannot replay the recording ('' when it can)."""
    differences = recorded.differences(here)
    if not differences:
        return ""
    return ("the vLLM engine started here differs from the recorded one in " + "; ".join(differences)
            + " (recorded vs here); replay needs the same model directory, vLLM version and engine settings")


def max_model_len(steps: list[dict[str, Any]]) -> int:
    """The longest step's prompt and output: the context the engine must allow."""
    return max(len(s["prompt"]) + max(1, s["max_tokens"]) for s in steps)


def execute(llm, steps: list[dict[str, Any]], progress: Callable[[int, dict], None]) -> dict[str, dict[str, Any]]:
    """Run every step; per step key: the generated ids and how many prompt tokens vLLM found cached."""
    by_span = {s["span_id"]: s for s in steps if s["key"] == s["span_id"]}
    # The keys of the steps run since the last reset, in order (None: not known yet, so the first step resets too)
    holding: Optional[list[str]] = None

    def chain(span: Optional[str]) -> list[str]:
        """The steps whose blocks a step starting from ``span`` finds cached, oldest first."""
        keys: list[str] = []
        while span is not None:
            keys.insert(0, span)
            span = by_span[span]["starts_from"]
        return keys

    def run(step: dict[str, Any]) -> dict[str, Any]:
        nonlocal holding
        source = step["starts_from"]
        if holding != chain(source):
            _reset(llm)
            holding = []
            if source is not None:
                run(by_span[source])  # rebuild the blocks this step starts from
        outcome = _generate(llm, step)
        if step.get("companions"):
            holding = None  # companions leave blocks of their own: the cache is known again after a reset
        elif holding is not None:
            holding.append(step["key"])
        return outcome

    outcomes = {}
    for done, step in enumerate(steps):
        progress(done, step)
        outcomes[step["key"]] = run(step)
    return outcomes


def _reset(llm) -> None:
    if not llm.reset_prefix_cache():
        raise RuntimeError("vLLM refused to reset its prefix cache (a request still running?)")


def _generate(llm, step: dict[str, Any]) -> dict[str, Any]:
    """One greedy request of the recorded length: ``ignore_eos``, so a recorded end token is generated, and
    nothing past the recorded tokens; its companions (``batch.companions``) sent in the same call, after it."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompt = [int(t) for t in step["prompt"]]
    requests = [(prompt, max(1, step["max_tokens"]))]
    requests += [(filler_prompt(prompt, k, length), generated)
                 for k, (length, generated) in enumerate(step.get("companions") or (), start=1)]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in requests]
    out = llm.generate([TokensPrompt(prompt_token_ids=p) for p, _ in requests], params, use_tqdm=False)[0]
    return {"token_ids": [int(t) for t in out.outputs[0].token_ids], "reused": int(out.num_cached_tokens or 0)}


def filler_prompt(prompt: list[int], k: int, length: int) -> list[int]:
    """Companion ``k``'s prompt: the request's own ids from offset ``k`` on, cycled to ``length``; ordinary ids
    whose first block no other prompt of the call shares, so no companion finds another's blocks."""
    return [prompt[(k + i) % len(prompt)] for i in range(length)]
