"""``kvtrace experiment``: a seeded multi-turn agentic workload under several cache arms and
weight formats, recorded through the real instrumentation and reported with the saved queries."""

from __future__ import annotations

import argparse
import json
import sys
import time

from kvtrace.commands.arguments import count, input_file, output_file, positive_number, seed
from kvtrace.commands.common import open_database, progress_printer
from kvtrace.errors import ConfigError, EngineFailed
from kvtrace.experiment import Plan, models, plot, run_experiment
from kvtrace.experiment.isolation import DEFAULT_PASS_TIMEOUT
from kvtrace.experiment.plan import CONVERSATIONS, DEFAULT_CACHE_RAM, SCHEDULES, parse_bytes
from kvtrace.experiment.report import build_report, print_report


def add_pass_timeout_option(parser) -> None:
    """Shared with ``kvtrace demo``: each engine pass runs in its own process, watched for stalls."""
    parser.add_argument("--pass-timeout", type=positive_number, default=DEFAULT_PASS_TIMEOUT, metavar="SECONDS",
                        help="end the command when one request (or model load) of a pass takes longer than "
                             "this: the engine hangs (default %(default)g)")


def _list(text: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in text.split(",") if item.strip())


def _count_list(text: str) -> tuple[int, ...]:
    """``256`` or ``256,1``: one or more whole numbers >= 1."""
    values = tuple(count(item) for item in _list(text))
    if not values:
        raise argparse.ArgumentTypeError(f"{text!r}: give at least one whole number >= 1")
    return values


def _bytes_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(parse_bytes(item) for item in _list(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_arguments(p) -> None:
    p.description = ("Run N episodes x T turns of a deterministic tool-using workload, serial and greedy, under "
                     "each cache arm, weight format and engine setting (every comma-separated value of a knob is "
                     "a dimension of the grid); report divergence rates over distinct episodes with 95% intervals, "
                     "fork turns, cached tokens, margin shift, flip rate by margin and fork attribution. Run ids: "
                     "PREFIX/FORMAT/SETTINGS/ARM[-CACHE]/rREPEAT/ORDER.")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", type=input_file, metavar="PATH.gguf",
                        help="an unquantized (F32/F16/BF16) GGUF; quantized to each --formats entry")
    source.add_argument("--generate", metavar="SIZE", choices=("tiny", "small", "base"),
                        help="use a generated random-weight model of this size (tiny, small, base)")
    source.add_argument("--server", metavar="COMMAND|URL",
                        help="run against llama-server instead, through kvtrace's proxy: its command line "
                             "(started fresh for every pass, arms off, reuse, prompt-cache) or a running "
                             "server's URL (see kvtrace/experiment/server.py)")
    p.add_argument("--formats", type=_list, default=("Q4_0", "Q8_0"), metavar="F16,Q4_0,...")
    p.add_argument("--arms", type=_list, default=("off", "reuse", "prompt-cache"),
                   metavar="off,reuse,prompt-cache,disk-cache,restore")
    p.add_argument("--episodes", type=count, default=16, metavar="N")
    p.add_argument("--turns", type=count, default=4, metavar="T")
    p.add_argument("--tokens", type=count, default=24, metavar="K", help="max tokens per turn")
    p.add_argument("--repeats", type=count, default=1, metavar="R", help="passes per arm, each with a fresh engine")
    p.add_argument("--orders", type=_list, default=("canonical",), metavar="canonical,shuffled")
    p.add_argument("--seed", type=seed, default=0, metavar="S")
    p.add_argument("--prefix", default=None, help="run id prefix (default exp-<seed>-<time>)")
    p.add_argument("--n-ctx", type=count, default=1024, metavar="TOKENS")
    p.add_argument("--threads", type=count, default=1, metavar="N")
    p.add_argument("--n-batch", type=_count_list, default=(256,), metavar="N[,N...]",
                   help="llama.cpp logical batch size(s) (default 256)")
    p.add_argument("--n-ubatch", type=_count_list, default=(256,), metavar="N[,N...]",
                   help="llama.cpp micro-batch size(s); 1 makes prefill and decode use the same kernels (default 256)")
    p.add_argument("--flash-attn", type=_list, default=("off",), metavar="off,on", help="flash attention (default off)")
    p.add_argument("--kv-type", type=_list, default=("f16",), metavar="f16,q8_0,f32",
                   help="KV cache type for K and V (q8_0 needs --flash-attn on; default f16)")
    p.add_argument("--weight-repack", type=_list, default=("off",), metavar="off,on",
                   help="llama.cpp's extra-buffer weight repack (default off; on crashes quantized models on "
                        "AMX CPUs, llama.cpp #20824)")
    p.add_argument("--cache-ram", type=_bytes_list, default=(DEFAULT_CACHE_RAM,), metavar="BYTES[,BYTES...]",
                   help="capacity of the prompt-cache / disk-cache arms, every byte of a stored state counted, "
                        "e.g. 0,256MiB,1GiB (default 1GiB)")
    p.add_argument("--conversation", choices=CONVERSATIONS, default="text",
                   help="text: each turn re-tokenizes the conversation's text, as an agent calling a server does "
                        "(default); tokens: prompts grow by the exact generated token ids")
    p.add_argument("--schedule", choices=SCHEDULES, default="sequential",
                   help="sequential: one episode after another; interleaved: turn by turn across all episodes, "
                        "as one server serving many agents (default sequential)")
    add_pass_timeout_option(p)
    p.add_argument("--plot", type=output_file, metavar="FILE.png",
                   help="divergence rates as a PNG, one panel per compared pair (pip install 'kvtrace[plot]')")
    p.add_argument("--format", choices=("text", "json"), default="text")
    p.set_defaults(func=run)


def plan_from_args(args) -> Plan:
    try:
        return Plan(formats=args.formats, arms=args.arms, episodes=args.episodes, turns=args.turns,
                    tokens=args.tokens, repeats=args.repeats, orders=args.orders, seed=args.seed,
                    prefix=args.prefix or f"exp-{args.seed}-{time.strftime('%Y%m%dT%H%M%S')}",
                    n_ctx=args.n_ctx, n_threads=args.threads, n_batch=args.n_batch, n_ubatch=args.n_ubatch,
                    flash_attn=args.flash_attn, kv_type=args.kv_type,
                    weight_repack=args.weight_repack, cache_ram=args.cache_ram,
                    conversation=args.conversation, schedule=args.schedule)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def prepare_models(args, plan, progress):
    if args.model:
        return models.quantized_models(args.model, plan.formats, progress, plan.n_threads)
    return models.generated_models(args.generate, plan.formats, progress)


def run(args) -> int:
    if args.server:
        # Deferred: the server experiment needs httpx and h11, the optional `proxy` extra.
        from kvtrace.commands.experiment_server import run_against_server

        return run_against_server(args)
    require_llama()
    if args.plot:
        require_plot_extra()
    plan = plan_from_args(args)
    progress = progress_printer(args)
    models = prepare_models(args, plan, progress)
    outcome = run_experiment(plan, models, progress, args.pass_timeout)
    return report_outcome(args, plan, outcome, progress)


def ingest_and_build_report(args, plan, outcome, progress):
    """After the passes (experiment, server experiment, demo): ingest what they recorded, fail on a dead
    pass, and build the report; the open database and the report."""
    progress("ingesting")
    client = open_database(args)
    progress("")
    if outcome.failure is not None:
        raise EngineFailed(outcome.failure.describe())
    return client, build_report(client, plan, outcome)


def report_outcome(args, plan, outcome, progress) -> int:
    """After the passes (in-process or against a server): ingest, fail on a dead pass, print the report
    (text or JSON) and the plot; the exit code (130 when interrupted)."""
    _, report = ingest_and_build_report(args, plan, outcome, progress)
    write_report(args, report, print_report, plot, "no compared pair has a rate")
    return 130 if outcome.interrupted else 0


def write_report(args, report: dict, print_text, plot_module, nothing_to_plot: str) -> None:
    """A report (experiment, advise) on stdout as JSON or text, and its plot when --plot asked for one."""
    if args.format == "json":
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print_text(report, sys.stdout)
    if args.plot:
        written = plot_module.write_plot(report, args.plot)
        print(f"kvtrace: wrote {written}" if written else f"kvtrace: no plot written: {nothing_to_plot}",
              file=sys.stderr)


def require_plot_extra() -> None:
    """Checked before any pass runs: a plot asked for must not be found missing after an hour's run."""
    try:
        import matplotlib  # noqa: F401  (deferred, optional: only whether the `plot` extra is installed)
    except ImportError:
        raise ConfigError(f"--plot needs matplotlib ({plot.INSTALL_HINT}), or leave --plot out") from None


def require_llama() -> None:
    try:
        import llama_cpp  # noqa: F401  (deferred, optional engine: only whether it is installed)
    except ImportError:
        raise ConfigError("the experiment needs llama-cpp-python (pip install 'kvtrace[llama]')") from None
