"""The same prompts sent to vLLM all in one batch and one at a time: the workload of
tests/test_vllm_batch_composition.py.

Every episode is one seeded random prompt (tests/vllm_fork_workload.py's), greedy with ``ignore_eos``,
prefix caching on and reset before each request (before the batch in a batched pass), so every prompt
is computed whole on both sides: the passes differ only in which requests share the engine's steps.
A pass is a mode and a run id:

    batched  every prompt in one ``llm.generate`` call: prefilled together in one step, then decoded together
    alone    one ``llm.generate`` call per prompt

Requests are tagged with run / episode / turn / arm through ``kvtrace.correlate``; kvtrace comes in
through vLLM's plugin entry point.  Prints one JSON line: per request, what the harness saw.

    python tests/vllm_batch_workload.py --model DIR --pass batched:RUN_A --pass alone:RUN_B [...] [--multiprocess]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from vllm_fork_workload import parse_passes, pass_parser, random_prompts

MODES = ("batched", "alone")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = pass_parser(MODES, episodes=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--multiprocess", action="store_true",
                        help="engine core and worker in processes of their own (the mp executor)")
    return parse_passes(parser, MODES, argv)


def run_pass(llm, mode: str, run_id: str, prompts: dict[str, list[int]], max_tokens: int) -> list[dict]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvtrace import correlate

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    groups = [list(prompts)] if mode == "batched" else [[episode] for episode in prompts]
    seen = []
    for episodes in groups:
        if not llm.reset_prefix_cache():
            raise SystemExit("vLLM refused to reset its prefix cache (requests still running?)")
        for episode in episodes:
            with correlate(run_id=run_id, episode_id=episode, turn=0, arm=mode):
                llm.enqueue(TokensPrompt(prompt_token_ids=prompts[episode]), params, use_tqdm=False)
        episode_of = {tuple(prompts[episode]): episode for episode in episodes}
        for out in llm.wait_for_completion(use_tqdm=False):
            seen.append({"episode": episode_of[tuple(out.prompt_token_ids)], "prompt_tokens": len(out.prompt_token_ids),
                         "output": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens})
    return seen


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if args.multiprocess else "0"
    from vllm import LLM

    from vllm_fork_workload import BLOCK_SIZE, PROMPT_TOKENS

    # Room for every prompt in one step and every request at once: the batched pass prefills all
    # prompts together, then decodes them together, step for step.
    budget = max(2048, args.episodes * PROMPT_TOKENS)
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=256, block_size=BLOCK_SIZE, enforce_eager=True,
              enable_prefix_caching=True, distributed_executor_backend="mp" if args.multiprocess else "uni", seed=0,
              max_num_batched_tokens=budget, max_num_seqs=max(args.episodes, 8))
    prompts = random_prompts(llm.get_tokenizer(), args.episodes, args.seed)
    passes = []
    for spec in args.passes:
        mode, _, run_id = spec.partition(":")
        passes.append({"mode": mode, "run_id": run_id,
                       "requests": run_pass(llm, mode, run_id, prompts, args.max_tokens)})
    print("KVTRACE_BATCH_WORKLOAD " + json.dumps({"passes": passes}))
    return 0


if __name__ == "__main__":  # vLLM may spawn processes: the guard keeps them from re-running the workload
    sys.exit(main(sys.argv[1:]))
