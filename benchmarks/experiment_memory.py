"""Peak memory of `kvtrace experiment` passes for 40 and 160 episodes: it must not grow with episodes.

    python benchmarks/experiment_memory.py [--episodes 40 160] [--cache-ram 256MiB] [--format Q8_0]

Runs each arm as its own pass (a child process, as the command does) on the generated tiny model,
few turns and tokens, and prints each pass's peak resident memory (the child's ``ru_maxrss``) next
to the bound it must stay under: the model file, the context (KV cache and logits buffer), the
prompt cache's capacity for the cache arms, and a constant for the Python runtime, llama.cpp and the
recorder. The prompt-cache arm holds states until ``--cache-ram`` is full, so its peak stops growing
once that many states exist; the other arms hold one state at most.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

from kvtrace.experiment import Plan, run_experiment
from kvtrace.experiment.models import generated_models
from kvtrace.experiment.plan import CACHE_ARMS, format_bytes, parse_bytes
from kvtrace.testmodels.llama_gguf import SIZES

CONSTANT = 400 << 20
"""Python, numpy, llama.cpp's runtime and compute buffers, the recorder: measured well below this."""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, nargs="+", default=[40, 160])
    parser.add_argument("--arms", nargs="+", default=["off", "reuse", "prompt-cache", "restore"])
    parser.add_argument("--cache-ram", type=parse_bytes, default=parse_bytes("256MiB"))
    parser.add_argument("--format", default="Q8_0")
    parser.add_argument("--size", default="tiny", choices=("tiny", "small"))
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=8)
    return parser.parse_args()


def context_bytes(size: str, n_ctx: int, n_batch: int) -> int:
    """KV cache (f16 K and V for every layer and position) plus the logits buffer llama-cpp-python keeps."""
    shape = SIZES[size]
    kv_width = shape.n_embd // shape.n_head * shape.n_head_kv
    return 2 * 2 * shape.n_layer * kv_width * n_ctx + 4 * n_batch * shape.n_vocab


def main() -> int:
    args = parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvtrace-memory-"))
    os.environ["KVTRACE_SPOOL_DIR"] = str(work / "spool")  # the passes record as usual, into a scratch spool
    os.environ.setdefault("XDG_DATA_HOME", str(work / "data"))

    models = generated_models(args.size, [args.format])
    model_size = models[args.format].stat().st_size
    print(f"{args.size} model as {args.format} ({model_size / 2**20:.1f} MiB), {args.turns} turns x {args.tokens} "
          f"tokens, cache arms at --cache-ram {format_bytes(args.cache_ram)}")
    print(f"{'arm':<14}{'episodes':>9}{'peak RSS':>11}{'bound':>11}{'seconds':>9}")
    worst = 0.0
    for arm in args.arms:
        for episodes in args.episodes:
            plan = Plan(formats=(args.format,), arms=(arm,), episodes=episodes, turns=args.turns, tokens=args.tokens,
                        cache_ram=(args.cache_ram,), prefix=f"memory-{arm}-{episodes}")
            started = time.monotonic()
            outcome = run_experiment(plan, models)
            if outcome.failure is not None:
                print(outcome.failure.describe(), file=sys.stderr)
                return 1
            settings = plan.engine_settings()[0]
            bound = model_size + context_bytes(args.size, plan.n_ctx, settings.n_batch) + CONSTANT
            bound += args.cache_ram if arm in CACHE_ARMS else 0
            worst = max(worst, outcome.peak_rss_bytes / bound)
            print(f"{arm:<14}{episodes:>9}{outcome.peak_rss_bytes / 2**20:>8.0f} MiB{bound / 2**20:>7.0f} MiB"
                  f"{time.monotonic() - started:>9.0f}")
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    print(f"largest child process (ru_maxrss of RUSAGE_CHILDREN): {children / 2**20:.0f} MiB; "
          f"highest peak / bound: {worst:.2f}")
    return 0 if worst <= 1 else 1


if __name__ == "__main__":
    sys.exit(main())
