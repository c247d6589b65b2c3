"""A multi-turn workload on vLLM's offline API, run as a script by the vLLM tests and the benchmark.

Each episode's turn prompt is the previous prompt + its completion + a fixed
observation (token ids, so nothing is re-tokenized), greedy, one request per
call, every call tagged with run / episode / turn baggage.  Prints one JSON
line with what the harness saw, so tests compare it with the recorded spans.

    python tests/vllm_workload.py --model DIR --run-id R [--no-prefix-caching] [--multiprocess]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--episodes", type=int, default=6)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--multiprocess", action="store_true", help="engine core in its own process")
    parser.add_argument("--blocks", type=int, default=0, help="KV cache blocks (0: vLLM's choice)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--untraced", action="store_true", help="KVTRACE_DISABLED=1 (plugin off)")
    return parser.parse_args(argv)


def build_llm(args: argparse.Namespace):
    from vllm import LLM

    options = dict(model=args.model, dtype=args.dtype, max_model_len=256, block_size=32, enforce_eager=True,
                   enable_prefix_caching=not args.no_prefix_caching, seed=0)
    if not args.multiprocess:
        options["distributed_executor_backend"] = "uni"
    if args.blocks:
        options["num_gpu_blocks_override"] = args.blocks
    return LLM(**options)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if args.multiprocess else "0"
    if args.untraced:
        os.environ["KVTRACE_DISABLED"] = "1"
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvtrace import correlate

    llm = build_llm(args)
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    prompts = {e: tokenizer.encode(f"Episode {e}: the agent opens the file and reads the first line")
               for e in range(args.episodes)}
    seen = []
    started = time.perf_counter()
    generated = 0
    for turn in range(args.turns):
        for e in range(args.episodes):
            with correlate(run_id=args.run_id, episode_id=f"e{e}", turn=turn):
                out = llm.generate([TokensPrompt(prompt_token_ids=prompts[e])], params, use_tqdm=False)[0]
            completion = list(out.outputs[0].token_ids)
            generated += len(completion)
            seen.append({"episode": f"e{e}", "turn": turn, "prompt": list(prompts[e]), "output": completion,
                         "cached": out.num_cached_tokens})
            observation = tokenizer.encode(f" obs {turn}.", add_special_tokens=False)
            prompts[e] = list(prompts[e]) + completion + observation
    elapsed = time.perf_counter() - started
    print("KVTRACE_WORKLOAD " + json.dumps({"seen": seen, "seconds": elapsed, "generated": generated}))
    return 0


if __name__ == "__main__":  # vLLM spawns its engine core: the guard keeps it from re-running the workload
    sys.exit(main(sys.argv[1:]))
