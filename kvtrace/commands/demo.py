"""``kvtrace demo``: the whole story on a fresh install, in a few minutes on two cores.

Generates a small random-weight model (cached in the per-user data dir), runs a short experiment
(cache off vs in-context prefix reuse, two weight formats that fork on small models), prints the
divergence table, explains one fork the way ``kvtrace diff`` does and writes its HTML fork view.
"""

from __future__ import annotations

import os
import sys
import time

from kvtrace.analysis.forks import diff_runs, gguf_detokenizer
from kvtrace.analysis.html_view import write_fork_view
from kvtrace.commands.arguments import count, seed
from kvtrace.commands.common import progress_printer
from kvtrace.commands.diff import describe_fork
from kvtrace.commands.experiment import add_pass_timeout_option, ingest_and_build_report, require_llama
from kvtrace.config import data_home
from kvtrace.experiment import Plan, run_experiment
from kvtrace.experiment.models import generated_models
from kvtrace.experiment.report import print_report

DEMO_FORMATS = ("Q4_0", "Q8_0")
DEMO_ARMS = ("off", "reuse")
DEMO_FLASH_ATTN = ("on",)
"""Flash attention takes another path for one token than for a batch: with the weight repack off
(how kvtrace loads models), that is what makes quantized formats fork on common CPUs."""


def add_arguments(p) -> None:
    p.description = "A self-contained demonstration on the embedded database: no model or server needed."
    p.add_argument("--episodes", type=count, default=120, metavar="N")
    p.add_argument("--turns", type=count, default=8, metavar="T")
    p.add_argument("--tokens", type=count, default=32, metavar="K")
    p.add_argument("--seed", type=seed, default=0, metavar="S")
    add_pass_timeout_option(p)
    p.set_defaults(func=run)


def run(args) -> int:
    started = time.monotonic()
    require_llama()
    # A research run on a generated model: token ids in the clear, so the fork shows real tokens.
    os.environ.setdefault("KVTRACE_CAPTURE", "ids")
    progress = progress_printer(args)
    plan = Plan(formats=DEMO_FORMATS, arms=DEMO_ARMS, episodes=args.episodes, turns=args.turns,
                tokens=args.tokens, seed=args.seed, flash_attn=DEMO_FLASH_ATTN,
                prefix=f"demo-{time.strftime('%Y%m%dT%H%M%S')}")
    models = generated_models("tiny", plan.formats, progress)
    print(f"kvtrace demo: {plan.episodes} episodes x {plan.turns} turns x {plan.tokens} tokens, greedy, serial; "
          f"arms {' vs '.join(plan.arms)}; formats {', '.join(plan.formats)}; flash attention on; "
          f"runs under {plan.prefix}/")
    outcome = run_experiment(plan, models, progress, args.pass_timeout)
    client, report = ingest_and_build_report(args, plan, outcome, progress)
    print_report(report, sys.stdout)

    for fmt in plan.formats:
        run_a, run_b = plan.run_id(plan.key(fmt, "reuse")), plan.run_id(plan.key(fmt, "off"))
        detokenize = gguf_detokenizer(models[fmt])
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
        print("\nno episode forked this time; try more episodes (--episodes) or another --seed")
    print(f"demo took {time.monotonic() - started:.0f} s")
    return 130 if outcome.interrupted else 0
