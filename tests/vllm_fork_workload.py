"""Prefix-cache hit against recompute on vLLM's offline API: the workload of tests/test_vllm_forks.py.

Every episode is one seeded random prompt of 100 token ids and two requests, greedy with
``ignore_eos``: turn 0 sends the first 96 tokens (three 32-token blocks) for one token, which
stores those blocks; turn 1 sends the whole prompt for 32 tokens.  One engine serves every pass,
with prefix caching on.  A pass is an arm and a run id:

    off     ``reset_prefix_cache()`` before every request: turn 1 recomputes all 100 tokens
    prefix  the cache is reset only before turn 0: turn 1 reuses turn 0's 96 tokens, computes 4

So both arms send the same requests in the same order to the same engine, and differ only in the
cache state turn 1 meets.  (Prefix caching switched off gives bit-identical outputs to ``off``
here, but a second engine, and spans without vLLM's block hashes to compare.)  All episodes'
requests of a turn go to the engine together, as a batch job or a fleet of agents would send
them: 100 episodes then cost about as many engine steps as one.

Requests are tagged with run / episode / turn / arm through ``kvtrace.correlate``; kvtrace itself
comes in through vLLM's plugin entry point, as for any vLLM user.  Prints one JSON line: what the
harness saw (per request: ids, prompt, output, cached tokens) and each prompt's block hashes
computed with vLLM's own ``hash_block_tokens``.

    python tests/vllm_fork_workload.py --model DIR --pass off:RUN_A --pass prefix:RUN_B [...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

PROMPT_TOKENS = 100
BLOCK_SIZE = 32
PREFIX_TOKENS = 96
"""Turn 0's prompt: three full blocks, so turn 1 reuses 96 tokens and recomputes 4."""
MAX_TOKENS = 32
ARMS = ("off", "prefix")


def pass_parser(modes: tuple[str, ...], episodes: int) -> argparse.ArgumentParser:
    """The options every vLLM workload script takes: the model, its passes (MODE:RUN_ID, one of ``modes``),
    episodes, seed and dtype; ``parse_passes`` checks the passes."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--pass", dest="passes", action="append", required=True, metavar="MODE:RUN_ID",
                        help=f"mode ({' or '.join(modes)}) and run id of one pass; repeat, run in order")
    parser.add_argument("--episodes", type=int, default=episodes)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="bfloat16")
    return parser


def parse_passes(parser: argparse.ArgumentParser, modes: tuple[str, ...], argv: list[str]) -> argparse.Namespace:
    args = parser.parse_args(argv)
    for spec in args.passes:
        mode, _, run_id = spec.partition(":")
        if mode not in modes or not run_id:
            parser.error(f"--pass {spec!r}: expected MODE:RUN_ID with MODE one of {', '.join(modes)}")
    return args


def parse_args(argv: list[str]) -> argparse.Namespace:
    return parse_passes(pass_parser(ARMS, episodes=100), ARMS, argv)


def random_prompts(tokenizer, episodes: int, seed: int) -> dict[str, list[int]]:
    """Seeded prompts of ordinary token ids (the special ids come last in the test tokenizer)."""
    import numpy as np

    ordinary = min(tokenizer.all_special_ids)
    rng = np.random.default_rng(seed)
    return {f"p{e:03d}": [int(t) for t in rng.integers(0, ordinary, size=PROMPT_TOKENS)] for e in range(episodes)}


def vllm_block_hashes(llm, token_ids: list[int]) -> list[str]:
    """The prompt's chained block hashes as vLLM computes them (hex of the bare hash), computed
    independently of kvtrace with vLLM's own ``hash_block_tokens`` and the engine's block size."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    cache_config = llm.llm_engine.vllm_config.cache_config
    hash_fn, block = get_hash_fn_by_name(cache_config.prefix_caching_hash_algo), cache_config.block_size
    parent, hashes = None, []
    for start in range(0, len(token_ids) - block + 1, block):
        parent = kv_cache_utils.hash_block_tokens(hash_fn, parent, token_ids[start:start + block], None)
        hashes.append(bytes(parent).hex())
    return hashes


def run_pass(llm, arm: str, run_id: str, prompts: dict[str, list[int]]) -> list[dict]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvtrace import correlate

    turns = ((PREFIX_TOKENS, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)),
             (PROMPT_TOKENS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)))
    seen = []
    for turn, (length, params) in enumerate(turns):
        if arm == "off" or turn == 0:
            if not llm.reset_prefix_cache():
                raise SystemExit("vLLM refused to reset its prefix cache (requests still running?)")
        episode_of = {}  # the random prompts are distinct: a prompt names its episode
        for episode, prompt in prompts.items():
            with correlate(run_id=run_id, episode_id=episode, turn=turn, arm=arm):
                llm.enqueue(TokensPrompt(prompt_token_ids=prompt[:length]), params, use_tqdm=False)
            episode_of[tuple(prompt[:length])] = episode
        for out in llm.wait_for_completion(use_tqdm=False):
            seen.append({"episode": episode_of[tuple(out.prompt_token_ids)], "turn": turn, "request_id": out.request_id,
                         "prompt": list(out.prompt_token_ids), "output": list(out.outputs[0].token_ids),
                         "cached": out.num_cached_tokens})
    return seen


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM

    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=256, block_size=BLOCK_SIZE, enforce_eager=True,
              enable_prefix_caching=True, distributed_executor_backend="uni", seed=0)
    prompts = random_prompts(llm.get_tokenizer(), args.episodes, args.seed)
    started = time.perf_counter()
    passes = []
    for spec in args.passes:
        arm, _, run_id = spec.partition(":")
        passes.append({"arm": arm, "run_id": run_id, "requests": run_pass(llm, arm, run_id, prompts)})
    report = {"passes": passes, "seconds": time.perf_counter() - started,
              "block_hashes": {e: vllm_block_hashes(llm, p) for e, p in prompts.items()}}
    print("KVTRACE_FORK_WORKLOAD " + json.dumps(report))
    return 0


if __name__ == "__main__":  # vLLM may spawn processes: the guard keeps them from re-running the workload
    sys.exit(main(sys.argv[1:]))
