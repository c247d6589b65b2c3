"""The child side of a speed probe: ``python -m kvtrace.advise.speed_process FD SPEC_JSON``.

Loads the model with the baseline's and the candidate's settings (the experiment's ``open_llama``,
so both load exactly as the divergence passes did), times them round by round in alternating order
and writes the rounds to FD, with a progress message before every timing (the parent's stall clock).
Nothing is instrumented here: the probe measures the engine alone.
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from typing import Callable, Optional

from kvtrace.advise.speed import SpeedResult, SpeedSpec
from kvtrace.experiment.isolation import serve_child
from kvtrace.experiment.plan import Plan
from kvtrace.experiment.runner import open_llama
from kvtrace.experiment.workload import make_episodes


def _clocks() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()  # process CPU time: llama.cpp's threads included


def time_request(llm, prompt: list[int], decode_tokens: int) -> dict[str, float]:
    """Seconds of a prefill of ``prompt`` from an empty context and of ``decode_tokens`` single-token
    steps after it, on both clocks. The decoded ids are fixed (speed does not depend on them)."""
    llm.reset()
    wall, cpu = _clocks()
    llm.eval(prompt)
    mid_wall, mid_cpu = _clocks()
    for i in range(decode_tokens):
        llm.eval([prompt[i % len(prompt)]])
    end_wall, end_cpu = _clocks()
    return {"prefill_wall": mid_wall - wall, "prefill_cpu": mid_cpu - cpu,
            "decode_wall": end_wall - mid_wall, "decode_cpu": end_cpu - mid_cpu}


def probe_prompt(llm, length: int) -> list[int]:
    """``length`` tokens of the workload's own text (its first episode's opening, repeated)."""
    text = "".join(e.opening() for e in make_episodes(4, 0))
    tokens = llm.tokenize(text.encode())
    return (tokens * (length // len(tokens) + 1))[:length]


def run_probe(spec: SpeedSpec, result: SpeedResult, progress: Callable[[str], None]) -> None:
    base = Plan(n_ctx=spec.n_ctx, n_threads=spec.n_threads)
    engines = {}
    try:
        for side, settings in (("baseline", spec.baseline), ("candidate", spec.candidate)):
            progress(f"loading the {side} ({settings.label})")
            engines[side] = open_llama(spec.model, replace(
                base, n_batch=(settings.n_batch,), n_ubatch=(settings.n_ubatch,), flash_attn=(settings.flash_attn,),
                kv_type=(settings.kv_type,), weight_repack=(settings.weight_repack,)))
        prompt = probe_prompt(engines["baseline"], spec.prompt_tokens)
        for round_index in range(spec.rounds + 1):  # round 0 warms up and is not kept
            order = ("baseline", "candidate") if round_index % 2 == 0 else ("candidate", "baseline")
            timings = {}
            for side in order:
                progress(f"timing {spec.candidate.label} against {spec.baseline.label}: round {round_index}, {side}")
                timings[side] = time_request(engines[side], prompt, spec.decode_tokens)
                result.requests += 1
            if round_index:
                result.rounds.append(timings)
    finally:
        for llm in engines.values():
            llm.close()


def main(argv: Optional[list[str]] = None) -> int:
    result = SpeedResult()
    return serve_child(sys.argv[1:] if argv is None else argv, result,
                       lambda spec_json, progress: run_probe(SpeedSpec.from_json(spec_json), result, progress))


if __name__ == "__main__":
    sys.exit(main())
