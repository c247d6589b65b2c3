"""What kvtrace costs per generated token in llama-cpp-python: CPU time, wall time, and the hooks' own CPU.

    python benchmarks/llama_overhead.py [--quants Q4_K_M F16] [--rounds 5] [--tokens 128]

Generates (once, cached under --model-dir) the ~100M-parameter random-weight Llama model in each
format and loads it the way kvtrace loads its own engines (the weight repack off).  Each round runs
four greedy streaming requests on the same ``Llama`` in ABBA order (untraced, traced, traced,
untraced; the next round BAAB), so drift on a shared machine hits both arms alike.

Per request it measures:

* tokens: sampled tokens (decode steps), counted from the engine's context, not stream chunks
  (a chunk may carry several tokens, or none while a multi-byte character is incomplete);
* CPU time of the engine thread (the thread that iterates the stream) and of kvtrace's exporter
  thread, and the process's CPU time; the traced arm's span is flushed before the clocks stop;
* wall time;
* with tracing on, the hooks' own CPU time: timers inside the per-token hooks (``Llama.sample``,
  ``Llama.eval`` where hooked) and the stream step, the engine's own time inside them subtracted.
  The timers are wrappers this benchmark installs around the hook table's wrappers; a normal
  ``patch()`` has none.

CPU time and the in-hook timers are the figures to trust on a shared machine; wall time is printed
beside them.  Each figure is per token, best and median over the rounds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional

PER_TOKEN_HOOKS = ("Llama.sample", "Llama.eval")
"""Hooks that run on every token; the benchmark times these."""

clock = time.thread_time_ns


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quants", nargs="+", default=["Q4_K_M"])
    parser.add_argument("--size", default="base", choices=("tiny", "small", "base"))
    parser.add_argument("--rounds", type=int, default=5, help="rounds of four requests (ABBA, then BAAB)")
    parser.add_argument("--tokens", type=int, default=128, help="tokens generated per request (at least)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model-dir", type=Path, default=Path(tempfile.gettempdir()) / "kvtrace-bench-models")
    args = parser.parse_args()
    if args.rounds < 1 or args.tokens < 2:
        parser.error("--rounds must be at least 1 and --tokens at least 2")
    return args


def model_path(model_dir: Path, size: str, quant: str) -> Path:
    from kvtrace.testmodels.llama_gguf import make_model

    path = model_dir / f"{size}-{quant}.gguf"
    if not path.exists():
        print(f"generating {path} ...", file=sys.stderr)
        make_model(path, quant, size, threads=2)
    return path


# --- timers inside the hooks ------------------------------------------------------------------


@dataclass
class HookClock:
    """CPU nanoseconds spent in kvtrace's per-token code, the engine's own time inside it excluded."""

    ns: int = 0

    def around_hook(self, hook: Callable) -> Callable:
        """A wrapt wrapper that runs ``hook`` and counts its time minus the wrapped engine call's."""

        def timed(wrapped, instance, args, kwargs):
            engine_ns = 0

            def engine(*a, **k):
                nonlocal engine_ns
                t = clock()
                try:
                    return wrapped(*a, **k)
                finally:
                    engine_ns += clock() - t

            start = clock()
            try:
                return hook(engine, instance, args, kwargs)
            finally:
                self.ns += clock() - start - engine_ns

        return timed

    def around_stream(self, traced_stream: Callable) -> Callable:
        """``request.traced_stream`` with the time of each step outside the engine's own step counted."""
        hook_clock = self

        class EngineSteps:
            def __init__(self, chunks: Iterator):
                self.chunks, self.ns = chunks, 0

            def __iter__(self):
                return self

            def __next__(self):
                t = clock()
                try:
                    return next(self.chunks)
                finally:
                    self.ns += clock() - t

            def close(self):
                close = getattr(self.chunks, "close", None)
                if close is not None:
                    close()

        def timed(state, chunks):
            engine = EngineSteps(chunks)
            outer = traced_stream(state, engine)
            try:
                while True:
                    before, t = engine.ns, clock()
                    try:
                        chunk = next(outer)
                    except StopIteration:
                        return
                    finally:
                        hook_clock.ns += clock() - t - (engine.ns - before)
                    yield chunk
            finally:
                outer.close()

        return timed

    def overhead_ns(self) -> float:
        """What one timed hook call adds by itself (the clock reads and the closure), measured warm."""
        probe = HookClock()
        timed = probe.around_hook(lambda wrapped, instance, args, kwargs: wrapped(*args, **kwargs))
        calls = 2000
        for _ in range(calls):
            timed(int, None, (), {})
        return probe.ns / calls


def install_hook_timers(patch, hook_clock: HookClock) -> list[str]:
    """Put timers around the per-token hooks of ``patch``'s table (before it is installed)."""
    from kvtrace.patches.hooks import Hook
    from kvtrace.patches.llama_cpp import request

    timed = []
    hooks = []
    for hook in patch.HOOKS.hooks:
        if hook.target in PER_TOKEN_HOOKS:
            hook = Hook(hook.module, hook.target, hook_clock.around_hook(hook.wrapper))
            timed.append(hook.target)
        hooks.append(hook)
    patch.HOOKS.hooks = tuple(hooks)
    request.traced_stream = hook_clock.around_stream(request.traced_stream)
    return timed + ["stream step"]


# --- one request --------------------------------------------------------------------------------


def exporter_cpu_ns() -> Optional[int]:
    """CPU time of kvtrace's exporter thread so far (``None`` before it starts, or off Linux)."""
    for thread in threading.enumerate():
        if thread.name == "kvtrace-exporter" and thread.ident is not None:
            try:
                return time.clock_gettime_ns(time.pthread_getcpuclockid(thread.ident))
            except (AttributeError, OSError):
                return None
    return None


@dataclass
class Sample:
    """Per-arm totals over a round's requests."""

    tokens: int = 0
    wall_ns: int = 0
    engine_ns: int = 0
    exporter_ns: int = 0
    process_ns: int = 0
    hook_ns: int = 0

    def per_token_us(self, total_ns: int) -> float:
        return total_ns / self.tokens / 1e3


def run_request(llm, prompt: list[int], tokens: int, traced: bool, hook_clock: HookClock, into: Sample) -> None:
    """One greedy streaming request from an empty context, measured into ``into``."""
    from kvtrace.recording.recorder import get_recorder

    llm.reset()
    exporter_before = exporter_cpu_ns() or 0
    hook_before = hook_clock.ns
    wall, engine, process = time.perf_counter_ns(), clock(), time.process_time_ns()
    for _ in llm.create_completion(prompt, max_tokens=tokens, temperature=0.0, stream=True):
        pass
    engine = clock() - engine
    wall = time.perf_counter_ns() - wall
    if traced:
        get_recorder().pipeline.force_flush()  # the exporter's work for this request lands in this request
    process = time.process_time_ns() - process
    into.tokens += llm.n_tokens - len(prompt) + 1  # every sampled token but the last was evaluated
    into.wall_ns += wall
    into.engine_ns += engine
    into.exporter_ns += (exporter_cpu_ns() or 0) - exporter_before
    into.process_ns += process
    into.hook_ns += hook_clock.ns - hook_before


# --- the comparison ----------------------------------------------------------------------------


@dataclass
class Rounds:
    untraced: list[Sample] = field(default_factory=list)
    traced: list[Sample] = field(default_factory=list)


def bench_format(path: Path, args: argparse.Namespace, patch, hook_clock: HookClock) -> Rounds:
    from kvtrace.patches.llama_cpp.repack import load_llama

    llm = load_llama(path, n_ctx=max(512, args.tokens + 64), n_batch=64, n_ubatch=64, n_threads=args.threads,
                     n_threads_batch=args.threads, seed=1, verbose=False)
    prompt = llm.tokenize(b"Benchmark prompt:")
    rounds = Rounds()
    patch.patch()
    run_request(llm, prompt, 16, True, hook_clock, Sample())  # warm-up: page in the weights, start the exporter
    for index in range(args.rounds):
        untraced, traced = Sample(), Sample()
        order = (False, True, True, False) if index % 2 == 0 else (True, False, False, True)
        for arm in order:
            patch.patch() if arm else patch.unpatch()
            run_request(llm, prompt, args.tokens, arm, hook_clock, traced if arm else untraced)
        rounds.untraced.append(untraced)
        rounds.traced.append(traced)
        print(f"  round {index + 1}: {untraced.tokens // 2} tokens/request, engine CPU "
              f"{untraced.per_token_us(untraced.engine_ns):.0f} / {traced.per_token_us(traced.engine_ns):.0f} µs/token "
              f"(untraced / traced), hooks {traced.per_token_us(traced.hook_ns):.1f} µs/token", file=sys.stderr)
    patch.unpatch()
    llm.close()
    return rounds


def best_and_median(values: list[float]) -> str:
    return f"{min(values):9.1f} {statistics.median(values):9.1f}"


def report(quant: str, rounds: Rounds, timer_overhead_ns: float) -> None:
    def figure(name: str, arm: list[Sample], total: Callable[[Sample], int]) -> list[float]:
        values = [s.per_token_us(total(s)) for s in arm]
        print(f"  {name:34} {best_and_median(values)}")
        return values

    tokens = sorted({s.tokens // 2 for s in rounds.traced + rounds.untraced})
    print(f"\n{quant}: {len(rounds.traced)} rounds, tokens per request {tokens}")
    print(f"  {'per generated token (µs)':34} {'best':>9} {'median':>9}")
    engine_a = figure("untraced: engine thread CPU", rounds.untraced, lambda s: s.engine_ns)
    figure("untraced: process CPU", rounds.untraced, lambda s: s.process_ns)
    figure("untraced: wall", rounds.untraced, lambda s: s.wall_ns)
    engine_b = figure("traced: engine thread CPU", rounds.traced, lambda s: s.engine_ns)
    figure("traced: exporter thread CPU", rounds.traced, lambda s: s.exporter_ns)
    figure("traced: process CPU", rounds.traced, lambda s: s.process_ns)
    figure("traced: wall", rounds.traced, lambda s: s.wall_ns)
    hooks = figure("traced: hooks' own CPU (timers)", rounds.traced, lambda s: s.hook_ns)
    per_call = timer_overhead_ns / 1e3
    print(f"  (the timers themselves add about {per_call:.2f} µs per timed call, included above)")

    def ratios(name: str, pairs: list[float]) -> None:
        print(f"  {name:34} {min(pairs):9.4f} {statistics.median(pairs):9.4f}")

    print(f"  {'ratios, per round':34} {'best':>9} {'median':>9}")
    ratios("traced/untraced engine CPU", [b / a for a, b in zip(engine_a, engine_b)])
    ratios("traced/untraced process CPU",
           [b.process_ns / b.tokens / (a.process_ns / a.tokens) for a, b in zip(rounds.untraced, rounds.traced)])
    ratios("traced/untraced wall",
           [b.wall_ns / b.tokens / (a.wall_ns / a.tokens) for a, b in zip(rounds.untraced, rounds.traced)])
    ratios("hooks / untraced engine CPU", [h / a for a, h in zip(engine_a, hooks)])


def main() -> int:
    args = parse_args()
    spool = tempfile.mkdtemp(prefix="kvtrace-bench-spool-")
    os.environ.setdefault("KVTRACE_SPOOL_DIR", spool)
    from kvtrace.patches import llama_cpp as patch
    from kvtrace.recording.recorder import get_recorder
    from kvtrace.testmodels.llama_gguf import SIZES

    hook_clock = HookClock()
    timed = install_hook_timers(patch, hook_clock)
    timer_overhead = hook_clock.overhead_ns()
    print(f"model: {args.size} ({SIZES[args.size].n_params / 1e6:.0f}M params, vocab {SIZES[args.size].n_vocab}), "
          f"threads={args.threads}, {args.rounds} rounds x 4 requests x {args.tokens} tokens; "
          f"timed: {', '.join(timed)}")
    print("load average: %.2f %.2f %.2f on %d CPUs" % (*os.getloadavg(), os.cpu_count() or 0))
    for quant in args.quants:
        path = model_path(args.model_dir, args.size, quant)
        report(quant, bench_format(path, args, patch, hook_clock), timer_overhead)
    print("\nload average: %.2f %.2f %.2f" % os.getloadavg())
    recorder = get_recorder()
    if recorder is not None:
        recorder.pipeline.force_flush()
        counters = recorder.pipeline.counters
        print(f"spans spooled: {counters['spans_spooled']}, stored: {counters['spans_stored']}, "
              f"dropped: {counters['spans_dropped_queue_full']}, "
              f"instrumentation errors: {counters['instrumentation_errors']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
