"""vLLM throughput traced vs untraced, side by side (a benchmark, not a test).

Runs the multi-turn workload of tests/vllm_workload.py in fresh single-process vLLM engines,
alternating untraced (KVTRACE_DISABLED=1: the plugin does not patch) and traced, and prints
generated tokens per second and the traced/untraced ratio.

    .venv-vllm/bin/python benchmarks/vllm_overhead.py [--size tiny|small] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from kvtrace.testmodels.hf_llama import make_model

WORKLOAD = str(Path(__file__).resolve().parent.parent / "tests" / "vllm_workload.py")


def run(model: Path, traced: bool, spool: str, episodes: int, turns: int, max_tokens: int) -> float:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", KVTRACE_SPOOL_DIR=spool)
    flags = [] if traced else ["--untraced"]
    done = subprocess.run([sys.executable, WORKLOAD, "--model", str(model), "--run-id", "bench", "--episodes",
                           str(episodes), "--turns", str(turns), "--max-tokens", str(max_tokens), *flags],
                          env=env, capture_output=True, text=True, check=True)
    result = json.loads(next(x for x in done.stdout.splitlines() if x.startswith("KVTRACE_WORKLOAD "))[17:])
    return result["generated"] / result["seconds"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", choices=("tiny", "small"))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--episodes", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(Path(tmp) / "model", args.size)
        rates: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.repeats):
            for traced in (False, True):
                rates[traced].append(run(model, traced, str(Path(tmp) / "spool"), args.episodes, args.turns,
                                         args.max_tokens))
    best = {traced: max(values) for traced, values in rates.items()}
    print(f"untraced {best[False]:.1f} tok/s   traced {best[True]:.1f} tok/s   "
          f"ratio traced/untraced {best[True] / best[False]:.3f}   (best of {args.repeats}, {args.size} model)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
