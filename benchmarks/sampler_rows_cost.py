"""The sampler rows of one step on a GPU: host CPU and device time, torch's operations against the kernel.

    python benchmarks/sampler_rows_cost.py [--batch 1,32,256] [--steps 200] [--rounds 4]

``device_rows`` (patches/vllm/row_stats.py) runs each step on vLLM's stream: in torch about twenty
operations, each a launch paid in host CPU on the engine's thread, or one launch of the Triton kernel
(patches/vllm/row_kernel.py). On random bf16 logits of Llama 3's 128,256 ids, per batch size, the two
alternate in rounds (ABBA) of ``--steps`` calls; printed per step: the host CPU of the calling thread
(no synchronize inside the timed calls), the device time (CUDA events), the first launch's compile
time, and the largest difference between the two paths' rows. ``benchmarks/gpu_check.py`` runs it
after vLLM's table. ``--interpret`` runs it on CPU tensors in Triton's interpreter: a check of the
script, whose times mean nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from arguments import positive_integers  # noqa: E402

VOCAB = 128_256


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=positive_integers, default=(1, 32, 256))
    parser.add_argument("--steps", type=int, default=200, help="calls per timed block")
    parser.add_argument("--rounds", type=int, default=4, help="ABBA rounds per batch size")
    parser.add_argument("--interpret", action="store_true", help="CPU tensors, Triton's interpreter: a smoke test")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported
    import torch

    from kvtrace.patches.vllm import row_kernel, row_stats

    device = "cpu" if args.interpret else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run it on a GPU, or with --interpret for a check of the script", file=sys.stderr)
        return 2
    if row_kernel._kernel() is None:
        print("Triton is not installed: the kernel cannot run", file=sys.stderr)
        return 2
    row_stats.KERNEL_DEVICES.clear()  # each arm is called by name below
    paths = {"torch": row_stats.device_rows, "kernel": row_kernel.kernel_rows}
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    print(f"{'rows':>5} {'torch host µs':>14} {'kernel host µs':>15} {'torch device µs':>16} {'kernel device µs':>17} "
          f"{'first launch s':>15} {'max |row diff|':>15}")
    for rows in args.batch:
        generator = torch.Generator(device=device).manual_seed(rows)
        logits = torch.randn(rows, VOCAB, generator=generator, device=device).mul_(4).to(torch.bfloat16)
        chosen = logits.float().argmax(dim=1, keepdim=True)
        sync()
        started = time.perf_counter()
        kernel_out = row_kernel.kernel_rows(logits, chosen)
        sync()
        first_launch = time.perf_counter() - started
        diff = (kernel_out - row_stats.device_rows(logits, chosen)).abs()
        diff[:, 1:3] *= 0  # ids at an exact tie may differ: topk's order there is not defined on CUDA
        host = {name: [] for name in paths}
        device_time = {name: [] for name in paths}
        steps = 1 if args.interpret else args.steps
        for round_ in range(args.rounds):
            for name in (("torch", "kernel") if round_ % 2 == 0 else ("kernel", "torch")):
                call = paths[name]
                sync()
                if device == "cuda":
                    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    begin.record()
                cpu = time.thread_time()
                for _ in range(steps):
                    call(logits, chosen)
                host[name].append((time.thread_time() - cpu) / steps * 1e6)
                if device == "cuda":
                    end.record()
                    sync()
                    device_time[name].append(begin.elapsed_time(end) / steps * 1e3)
        median = {name: statistics.median(values) for name, values in host.items()}
        on_device = {name: (f"{statistics.median(values):.1f}" if values else "-")
                     for name, values in device_time.items()}
        print(f"{rows:5d} {median['torch']:14.1f} {median['kernel']:15.1f} {on_device['torch']:>16} "
              f"{on_device['kernel']:>17} {first_launch:15.2f} {diff.max().item():15.2e}")
    print("host µs: the engine thread's CPU a step, medians of the rounds; device µs: CUDA events around the block")
    return 0


if __name__ == "__main__":
    sys.exit(main())
