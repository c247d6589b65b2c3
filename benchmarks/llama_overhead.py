"""Decode throughput of llama-cpp-python with and without kvtrace, side by side.

    python benchmarks/llama_overhead.py [--quants Q4_K_M F16] [--rounds 6] [--tokens 96]

Generates (once, cached under --model-dir) the ~100M-parameter random-weight
Llama model in each format, then alternates untraced and traced generations
on the same ``Llama`` (ABBA order, so drift on a shared machine hits both
arms alike) and prints median decode tokens/s per arm and their ratio.  The
traced arm uses the real pipeline (spool exporter in a temporary directory,
default hashed capture), so export cost on the background thread counts too.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quants", nargs="+", default=["Q4_K_M", "F16"])
    parser.add_argument("--size", default="base", choices=("tiny", "small", "base"))
    parser.add_argument("--rounds", type=int, default=6, help="ABBA rounds (each runs both arms twice)")
    parser.add_argument("--tokens", type=int, default=96, help="tokens generated per measurement")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model-dir", type=Path, default=Path(tempfile.gettempdir()) / "kvtrace-bench-models")
    return parser.parse_args()


def model_path(model_dir: Path, size: str, quant: str) -> Path:
    from kvtrace.testmodels.llama_gguf import make_model

    path = model_dir / f"{size}-{quant}.gguf"
    if not path.exists():
        print(f"generating {path} ...", file=sys.stderr)
        make_model(path, quant, size, threads=2)
    return path


def decode_rate(llm, prompt: list[int], tokens: int) -> float:
    """Generated tokens per second for one greedy completion from an empty context.

    The prompt is short (a few tokens), so the time is decode-dominated; the
    first token's latency (prefill + first sample) is excluded via streaming.
    """
    llm.reset()
    first = None
    count = 0
    for chunk in llm.create_completion(prompt, max_tokens=tokens, temperature=0.0, stream=True):
        if chunk["choices"][0]["finish_reason"] is not None:
            break
        count += 1
        if first is None:
            first = time.perf_counter()
    elapsed = time.perf_counter() - (first or time.perf_counter())
    return (count - 1) / elapsed if count > 1 and elapsed > 0 else float("nan")


def bench_format(path: Path, args: argparse.Namespace, patch) -> tuple[float, float]:
    from kvtrace.patches.llama_cpp.repack import load_llama

    # kvtrace's loader: the weight repack off, so AMX and non-AMX machines run the same kernels.
    llm = load_llama(path, n_ctx=512, n_batch=64, n_ubatch=64, n_threads=args.threads,
                     n_threads_batch=args.threads, seed=1, verbose=False)
    prompt = llm.tokenize(b"Benchmark prompt:")
    rates: dict[bool, list[float]] = {False: [], True: []}
    decode_rate(llm, prompt, 8)  # warm-up: page in the weights
    for round_index in range(args.rounds):
        order = (False, True, True, False) if round_index % 2 == 0 else (True, False, False, True)
        for traced in order:
            patch.patch() if traced else patch.unpatch()
            rates[traced].append(decode_rate(llm, prompt, args.tokens))
    patch.unpatch()
    llm.close()
    return statistics.median(rates[False]), statistics.median(rates[True])


def main() -> int:
    args = parse_args()
    spool = tempfile.mkdtemp(prefix="kvtrace-bench-spool-")
    os.environ.setdefault("KVTRACE_SPOOL_DIR", spool)
    from kvtrace.patches import llama_cpp as patch
    from kvtrace.recording.recorder import get_recorder
    from kvtrace.testmodels.llama_gguf import SIZES

    print(f"model: {args.size} ({SIZES[args.size].n_params / 1e6:.0f}M params, vocab {SIZES[args.size].n_vocab}), "
          f"threads={args.threads}, {args.rounds} ABBA rounds x {args.tokens} tokens")
    print(f"{'format':8} {'untraced tok/s':>15} {'traced tok/s':>13} {'traced/untraced':>16}")
    for quant in args.quants:
        path = model_path(args.model_dir, args.size, quant)
        untraced, traced = bench_format(path, args, patch)
        print(f"{quant:8} {untraced:15.2f} {traced:13.2f} {traced / untraced:16.4f}")
    recorder = get_recorder()
    if recorder is not None:
        recorder.pipeline.force_flush()
        counters = recorder.pipeline.counters
        print(f"spans spooled: {counters['spans_spooled']}, stored: {counters['spans_stored']}, dropped: {counters['spans_dropped_queue_full']}, "
              f"instrumentation errors: {counters['instrumentation_errors']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
