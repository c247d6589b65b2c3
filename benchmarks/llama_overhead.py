"""What kvtrace costs per generated token in llama-cpp-python: CPU time, wall time, and the hooks' own CPU.

    python benchmarks/llama_overhead.py [--quants Q4_K_M F16] [--rounds 5] [--tokens 128]

Generates (once, cached under --model-dir) the ~100M-parameter random-weight Llama model in each
format and loads it the way kvtrace loads its own engines (the weight repack off).  Each round runs
four greedy streaming requests on the same ``Llama`` in ABBA order (untraced, traced, traced,
untraced; the next round BAAB), so drift on a shared machine hits both arms alike, then one
request with the timers around hooks that only call through (below).

Per request it measures:

* tokens: sampled tokens (decode steps), counted from the engine's context, not stream chunks
  (a chunk may carry several tokens, or none while a multi-byte character is incomplete);
* CPU time of the engine thread (the thread that iterates the stream) and of kvtrace's exporter
  thread, and the process's CPU time; the traced arm's span is flushed before the clocks stop;
* wall time;
* with tracing on, the hooks' own time: timers inside the per-token hooks (``Llama.sample``,
  ``Llama.eval`` where hooked) and the stream step, the engine's own time inside them subtracted.
  The timers are wrappers this benchmark installs around the hook table's wrappers; a normal
  ``patch()`` has none.  They read the monotonic clock (a vDSO read; the thread CPU clock is a
  system call that costs about as much as a hook) and leave out calls the scheduler interrupted
  (over 1 ms), so the figure is CPU time.  Right after a decode step every Python call is several
  times slower than warm, the timers' own included, so each round also times hooks that only call
  through: what the timers and the forwarding cost in place.  The hooks' cost lies between the
  timed figure and the timed figure less that.

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
from typing import Callable, ClassVar, Iterator, Optional

from kvtrace.patches import llama_cpp as patch
from kvtrace.patches.hooks import Hook, HookTable
from kvtrace.patches.llama_cpp import request
from kvtrace.patches.llama_cpp.repack import load_llama
from kvtrace.recording.recorder import get_recorder
from kvtrace.testmodels.llama_gguf import SIZES, make_model

PER_TOKEN_HOOKS = ("Llama.sample", "Llama.eval")
"""Hooks that run on every token; the benchmark times these."""
STREAM_STEP = "stream step"
REQUEST_END = "request end (recorder.finish)"

thread_cpu_ns = time.thread_time_ns


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
    path = model_dir / f"{size}-{quant}.gguf"
    if not path.exists():
        print(f"generating {path} ...", file=sys.stderr)
        make_model(path, quant, size, threads=2)
    return path


# --- timers inside the hooks ------------------------------------------------------------------

hook_clock_ns = time.perf_counter_ns
"""The hooks' timers read the monotonic clock: a vDSO read, where the thread CPU clock is a system
call that costs more (after a decode step, with cold caches) than what it would measure."""
PREEMPTED_NS = 1_000_000
"""A timed hook call longer than this (1 ms; a hook takes tens of µs) was interrupted by the
scheduler: it is left out, counted, and the hook's cost per call is the mean of the others."""


@dataclass
class HookTime:
    ns: int = 0
    calls: int = 0
    preempted: int = 0

    def add(self, ns: int) -> None:
        if ns > PREEMPTED_NS:
            self.preempted += 1
        else:
            self.ns += ns
            self.calls += 1

    def since(self, before: "HookTime") -> "HookTime":
        return HookTime(self.ns - before.ns, self.calls - before.calls, self.preempted - before.preempted)

    def total_ns(self) -> float:
        """Time of every call, those left out counted at the mean of the others."""
        return self.ns / self.calls * (self.calls + self.preempted) if self.calls else 0.0


@dataclass
class HookClock:
    """Time spent in kvtrace's per-token code, the engine's own time inside it excluded."""

    by_hook: dict[str, HookTime] = field(default_factory=dict)
    nested_ns: int = 0
    """Time of timed functions called inside a stream step (counted under their own name)."""

    def around_function(self, function: Callable, name: str) -> Callable:
        """``function`` with its time counted under ``name`` and left out of the stream step that calls it."""
        times = self.by_hook.setdefault(name, HookTime())

        def timed(*args, **kwargs):
            start = hook_clock_ns()
            try:
                return function(*args, **kwargs)
            finally:
                elapsed = hook_clock_ns() - start
                self.nested_ns += elapsed
                times.add(elapsed)

        return timed

    def around_hook(self, hook: Callable, name: str) -> Callable:
        """A wrapt wrapper that runs ``hook`` and counts its time minus the wrapped engine call's."""
        times = self.by_hook.setdefault(name, HookTime())

        def timed(wrapped, instance, args, kwargs):
            engine_ns = 0

            def engine(*a, **k):
                nonlocal engine_ns
                t = hook_clock_ns()
                try:
                    return wrapped(*a, **k)
                finally:
                    engine_ns += hook_clock_ns() - t

            start = hook_clock_ns()
            try:
                return hook(engine, instance, args, kwargs)
            finally:
                times.add(hook_clock_ns() - start - engine_ns)

        return timed

    def around_stream(self, traced_stream: Callable) -> Callable:
        """``request.traced_stream`` with the time of each step outside the engine's own step counted."""
        times = self.by_hook.setdefault(STREAM_STEP, HookTime())
        hook_clock = self

        class EngineSteps:
            def __init__(self, chunks: Iterator):
                self.chunks, self.ns = chunks, 0

            def __iter__(self):
                return self

            def __next__(self):
                t = hook_clock_ns()
                try:
                    return next(self.chunks)
                finally:
                    self.ns += hook_clock_ns() - t

            def close(self):
                close = getattr(self.chunks, "close", None)
                if close is not None:
                    close()

        def timed(state, chunks):
            engine = EngineSteps(chunks)
            outer = traced_stream(state, engine)
            try:
                while True:
                    before, nested, t = engine.ns, hook_clock.nested_ns, hook_clock_ns()
                    try:
                        chunk = next(outer)
                    except StopIteration:
                        return
                    finally:
                        times.add(hook_clock_ns() - t - (engine.ns - before) - (hook_clock.nested_ns - nested))
                    yield chunk
            finally:
                outer.close()

        return timed

    def snapshot(self) -> dict[str, HookTime]:
        return {name: HookTime(t.ns, t.calls, t.preempted) for name, t in self.by_hook.items()}

    @staticmethod
    def overhead_ns() -> float:
        """What one timed hook call adds by itself (the clock reads and the closure), measured warm."""
        probe = HookClock()
        timed = probe.around_hook(lambda wrapped, instance, args, kwargs: wrapped(*args, **kwargs), "probe")
        calls = 2000
        for _ in range(calls):
            timed(int, None, (), {})
        return probe.by_hook["probe"].ns / calls


def call_through_hooks(patch, hook_clock: HookClock):
    """A hook table with the per-token hooks and the stream step doing nothing but call through,
    timed like the real ones: what the timers and the forwarding cost by themselves, in place."""
    def call_through(wrapped, instance, args, kwargs):
        return wrapped(*args, **kwargs)

    def identity_stream(state, chunks):
        yield from chunks

    timed_stream = hook_clock.around_stream(identity_stream)

    def completion(wrapped, instance, args, kwargs):
        result = wrapped(*args, **kwargs)
        return timed_stream(None, result) if isinstance(result, Iterator) else result

    hooks = [Hook(hook.module, hook.target, hook_clock.around_hook(call_through, hook.target))
             for hook in patch.HOOKS.hooks if hook.target in PER_TOKEN_HOOKS]
    hooks.append(Hook("llama_cpp.llama", "Llama.create_completion", completion))
    return HookTable("call-through", hooks, patch.HOOKS.failures)


def install_hook_timers(patch, hook_clock: HookClock) -> list[str]:
    """Put timers around the per-token hooks of ``patch``'s table (before it is installed)."""
    timed = []
    hooks = []
    for hook in patch.HOOKS.hooks:
        if hook.target in PER_TOKEN_HOOKS:
            hook = Hook(hook.module, hook.target, hook_clock.around_hook(hook.wrapper, hook.target))
            timed.append(hook.target)
        hooks.append(hook)
    patch.HOOKS.hooks = tuple(hooks)
    request.traced_stream = hook_clock.around_stream(request.traced_stream)
    request.end = hook_clock.around_function(request.end, REQUEST_END)
    return timed + [STREAM_STEP, REQUEST_END]


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
    """Per-arm totals over a round's requests (vllm_overhead.py: over a round's blocks)."""

    APART: ClassVar[str] = REQUEST_END
    """The timer reported apart and left out of the hooks' sum: here the request's end (the recorder's)."""

    tokens: int = 0
    wall_ns: int = 0
    engine_ns: int = 0
    exporter_ns: int = 0
    process_ns: int = 0
    by_hook: dict[str, HookTime] = field(default_factory=dict)

    @property
    def hook_ns(self) -> float:
        """The hooks' own time, the timer reported apart left out."""
        return sum(t.total_ns() for name, t in self.by_hook.items() if name != self.APART)

    @property
    def hook_calls(self) -> int:
        return sum(t.calls + t.preempted for name, t in self.by_hook.items() if name != self.APART)

    def per_token_us(self, total_ns: float) -> float:
        return total_ns / self.tokens / 1e3 if self.tokens else 0.0


def run_request(llm, prompt: list[int], tokens: int, traced: bool, hook_clock: HookClock, into: Sample) -> None:
    """One greedy streaming request from an empty context, measured into ``into``."""
    llm.reset()
    exporter_before = exporter_cpu_ns() or 0
    hooks_before = hook_clock.snapshot()
    wall, engine, process = time.perf_counter_ns(), thread_cpu_ns(), time.process_time_ns()
    for _ in llm.create_completion(prompt, max_tokens=tokens, temperature=0.0, stream=True):
        pass
    engine = thread_cpu_ns() - engine
    wall = time.perf_counter_ns() - wall
    if traced:
        get_recorder().pipeline.force_flush()  # the exporter's work for this request lands in this request
    process = time.process_time_ns() - process
    into.tokens += llm.n_tokens - len(prompt) + 1  # every sampled token but the last was evaluated
    into.wall_ns += wall
    into.engine_ns += engine
    into.exporter_ns += (exporter_cpu_ns() or 0) - exporter_before
    into.process_ns += process
    for name, times in hook_clock.snapshot().items():
        this_request = times.since(hooks_before.get(name, HookTime()))
        total = into.by_hook.setdefault(name, HookTime())
        total.ns, total.calls = total.ns + this_request.ns, total.calls + this_request.calls
        total.preempted += this_request.preempted


# --- the comparison ----------------------------------------------------------------------------


@dataclass
class Rounds:
    untraced: list[Sample] = field(default_factory=list)
    traced: list[Sample] = field(default_factory=list)
    call_through: list[Sample] = field(default_factory=list)
    """One request per round with timed hooks that only call through (not traced)."""


def bench_format(path: Path, args: argparse.Namespace, patch, hook_clock: HookClock, null_clock: HookClock,
                 call_through) -> Rounds:
    llm = load_llama(path, n_ctx=max(512, args.tokens + 64), n_batch=64, n_ubatch=64, n_threads=args.threads,
                     n_threads_batch=args.threads, seed=1, verbose=False)
    prompt = llm.tokenize(b"Benchmark prompt:")
    rounds = Rounds()
    patch.patch()
    run_request(llm, prompt, 16, True, hook_clock, Sample())  # warm-up: page in the weights, start the exporter
    for index in range(args.rounds):
        untraced, traced, null = Sample(), Sample(), Sample()
        order = (False, True, True, False) if index % 2 == 0 else (True, False, False, True)
        for arm in order:
            patch.patch() if arm else patch.unpatch()
            run_request(llm, prompt, args.tokens, arm, hook_clock, traced if arm else untraced)
        patch.unpatch()
        call_through.install()
        run_request(llm, prompt, args.tokens, False, null_clock, null)
        call_through.restore()
        rounds.untraced.append(untraced)
        rounds.traced.append(traced)
        rounds.call_through.append(null)
        print(f"  round {index + 1}: {untraced.tokens // 2} tokens/request, engine CPU "
              f"{untraced.per_token_us(untraced.engine_ns):.0f} / {traced.per_token_us(traced.engine_ns):.0f} µs/token "
              f"(untraced / traced), hooks {traced.per_token_us(traced.hook_ns):.1f} µs/token", file=sys.stderr)
    patch.unpatch()
    llm.close()
    return rounds


def best_and_median(values: list[float]) -> str:
    return f"{min(values):9.1f} {statistics.median(values):9.1f}"


def report(quant: str, rounds: Rounds, timer_overhead_ns: float) -> None:
    def figure(name: str, arm: list[Sample], total: Callable[[Sample], float]) -> list[float]:
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
    for name in sorted({name for s in rounds.traced for name in s.by_hook} - {REQUEST_END}):
        figure(f"  of which {name}", rounds.traced,
               lambda s, name=name: s.by_hook[name].total_ns() if name in s.by_hook else 0)
    figure(f"traced: {REQUEST_END}", rounds.traced,
           lambda s: s.by_hook[REQUEST_END].total_ns() if REQUEST_END in s.by_hook else 0)
    timers = figure("call-through hooks, timed the same", rounds.call_through, lambda s: s.hook_ns)
    for name in sorted({name for s in rounds.call_through for name in s.by_hook}):
        figure(f"  of which {name}", rounds.call_through,
               lambda s, name=name: s.by_hook[name].total_ns() if name in s.by_hook else 0)
    net = [h - t for h, t in zip(hooks, timers)]
    print(f"  {'traced: hooks less that (their work)':34} {best_and_median(net)}")
    calls = sum(t.calls + t.preempted for s in rounds.traced for t in s.by_hook.values())
    preempted = sum(t.preempted for s in rounds.traced for t in s.by_hook.values())
    print(f"  (timed calls: {calls}, {preempted} interrupted by the scheduler and left out; warm, a timer adds "
          f"{timer_overhead_ns / 1e3:.2f} µs per call; in place, after a decode step, timers and forwarding "
          f"cost what the call-through line says)")

    def ratios(name: str, pairs: list[float]) -> None:
        print(f"  {name:34} {min(pairs):9.4f} {statistics.median(pairs):9.4f}")

    print(f"  {'ratios, per round':34} {'best':>9} {'median':>9}")
    ratios("traced/untraced engine CPU", [b / a for a, b in zip(engine_a, engine_b)])
    ratios("traced/untraced process CPU",
           [b.process_ns / b.tokens / (a.process_ns / a.tokens) for a, b in zip(rounds.untraced, rounds.traced)])
    ratios("traced/untraced wall",
           [b.wall_ns / b.tokens / (a.wall_ns / a.tokens) for a, b in zip(rounds.untraced, rounds.traced)])
    ratios("hooks / untraced engine CPU", [h / a for a, h in zip(engine_a, hooks)])
    ratios("hooks' work / untraced engine CPU", [h / a for a, h in zip(engine_a, net)])


def main() -> int:
    args = parse_args()
    spool = tempfile.mkdtemp(prefix="kvtrace-bench-spool-")
    os.environ.setdefault("KVTRACE_SPOOL_DIR", spool)
    hook_clock, null_clock = HookClock(), HookClock()
    call_through = call_through_hooks(patch, null_clock)
    timed = install_hook_timers(patch, hook_clock)
    timer_overhead = hook_clock.overhead_ns()
    print(f"model: {args.size} ({SIZES[args.size].n_params / 1e6:.0f}M params, vocab {SIZES[args.size].n_vocab}), "
          f"threads={args.threads}, {args.rounds} rounds x 4 requests x {args.tokens} tokens; "
          f"timed: {', '.join(timed)}")
    print("load average: %.2f %.2f %.2f on %d CPUs" % (*os.getloadavg(), os.cpu_count() or 0))
    for quant in args.quants:
        path = model_path(args.model_dir, args.size, quant)
        report(quant, bench_format(path, args, patch, hook_clock, null_clock, call_through), timer_overhead)
    print_closing_counts()
    return 0



def print_closing_counts() -> None:
    """The load at the end and the recorder's span counts: every span stored, spooled or counted."""
    print("\nload average: %.2f %.2f %.2f" % os.getloadavg())
    recorder = get_recorder()
    if recorder is not None:
        recorder.pipeline.force_flush()
        counters = recorder.pipeline.counters.snapshot()
        print(f"spans spooled: {counters['spans_spooled']}, stored: {counters['spans_stored']}, "
              f"dropped: {counters['spans_dropped_queue_full']}, "
              f"instrumentation errors: {counters['instrumentation_errors']}")


if __name__ == "__main__":
    sys.exit(main())
