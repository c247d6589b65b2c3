"""``kvtrace advise``: which llama.cpp settings make the cache path harmless on this model, and what
they cost — the experiment's off-vs-reuse (and prompt-cache) comparison under each candidate
setting, a paired speed probe against the baseline, and the cheapest setting with no fork."""

from __future__ import annotations

import argparse
import time

from kvtrace.advise import plot
from kvtrace.advise.candidates import DEFAULT_CHANGES, parse_candidates
from kvtrace.advise.report import build_advice, print_advice
from kvtrace.advise.runner import AdvicePlan, run_advice
from kvtrace.commands.arguments import comma_list, comma_list_of, count, input_file, output_file, seed
from kvtrace.commands.common import (add_pass_timeout_option, open_database_after_passes, progress_printer,
                                     write_report)
from kvtrace.error_report import one_line
from kvtrace.errors import ConfigError
from kvtrace.experiment.extras import require_llama, require_plot_extra
from kvtrace.experiment.plan import DEFAULT_CACHE_RAM, FLASH_ATTN, KV_TYPES, EngineSettings, Plan, parse_bytes
from kvtrace.patches.llama_cpp.config import weight_format
from kvtrace.testmodels.llama_gguf import QUANTS

ADVISE_PASS_TIMEOUT = 120.0
"""Seconds without progress before a pass counts as hung: a request of a model worth advising on
this way takes seconds, and a hang (the repack on an AMX CPU can hang) should not cost ten minutes."""


def add_arguments(p) -> None:
    p.description = ("Run the experiment's cache comparison (off vs reuse, prompt-cache) on MODEL under the baseline "
                     "settings and under each candidate setting, time every candidate against the baseline in pairs "
                     "(prefill and decode, wall and CPU time), and recommend the cheapest setting with no forked "
                     "episode, with the upper end of its 95% interval. A candidate is a change to the baseline: "
                     "ubN, bN, fa-on|off, kv-f16|f32|q8_0, repack-on|off, several joined with +.")
    p.add_argument("--model", type=input_file, required=True, metavar="PATH.gguf",
                   help="the GGUF model to advise on, as it is (F32, F16, Q8_0, Q4_0, Q4_K_M or Q3_K_M)")
    p.add_argument("--settings", type=comma_list, default=DEFAULT_CHANGES, metavar="CHANGE[+CHANGE],...",
                   help=f"candidates to try (default {','.join(DEFAULT_CHANGES)}; fa-flip: the attention path "
                        "the baseline does not use)")
    baseline = p.add_argument_group("baseline (what every speed is relative to)")
    baseline.add_argument("--n-batch", type=count, default=256, metavar="N", help="(default 256)")
    baseline.add_argument("--n-ubatch", type=count, default=256, metavar="N", help="(default 256)")
    baseline.add_argument("--flash-attn", choices=FLASH_ATTN, default="on",
                          help="(default on: llama.cpp's 'auto' turns it on where the backend has it)")
    baseline.add_argument("--kv-type", choices=KV_TYPES, default="f16", help="(default f16)")
    p.add_argument("--arms", type=comma_list, default=("off", "reuse", "prompt-cache"), metavar="off,reuse,...",
                   help="off and the cache arms to compare with it (default off,reuse,prompt-cache)")
    p.add_argument("--episodes", type=count, default=20, metavar="N",
                   help="episodes per arm: 0 forks in N bound the rate by about 3.8/N at 95%% (default 20)")
    p.add_argument("--turns", type=count, default=4, metavar="T")
    p.add_argument("--tokens", type=count, default=24, metavar="K", help="max tokens per turn")
    p.add_argument("--seed", type=seed, default=0, metavar="S")
    p.add_argument("--prefix", default=None, help="run id prefix (default advise-<seed>-<time>)")
    p.add_argument("--n-ctx", type=count, default=1024, metavar="TOKENS")
    p.add_argument("--threads", type=count, default=1, metavar="N")
    p.add_argument("--cache-ram", type=comma_list_of(parse_bytes), default=(DEFAULT_CACHE_RAM,), metavar="BYTES",
                   help="capacity of the prompt-cache arm (default 1GiB)")
    p.add_argument("--speed-rounds", type=count, default=5, metavar="R",
                   help="timed rounds per candidate, after one warm-up (default 5)")
    p.add_argument("--prompt-tokens", type=count, default=256, metavar="P", help="prefill size timed (default 256)")
    p.add_argument("--decode-tokens", type=count, default=32, metavar="D", help="decode steps timed (default 32)")
    add_pass_timeout_option(p, ADVISE_PASS_TIMEOUT)
    p.add_argument("--plot", type=output_file, metavar="FILE.png",
                   help="fork rate vs speed cost as a PNG (pip install 'kvtrace[plot]')")
    p.add_argument("--format", choices=("text", "json"), default="text")
    p.add_argument("--json", dest="format", action="store_const", const="json", help="same as --format json")
    p.set_defaults(func=run)


def weight_format_of(path) -> str:
    """The GGUF's weight format (``Q8_0``...); ConfigError for a file that is not a GGUF model."""
    try:
        from gguf import GGUFReader  # deferred, heavy (~0.3 s): only once a model is given

        field = GGUFReader(str(path)).fields.get("general.file_type")
        raw = None if field is None else int(field.parts[field.data[0]][0])
    except Exception as exc:
        raise ConfigError(f"--model {path}: not a GGUF model file ({one_line(exc)})") from None
    return weight_format({} if raw is None else {"general.file_type": str(raw)})


def advice_plan(args, weight_format: str):
    """The plan from the command line; ConfigError for settings llama.cpp cannot take."""
    if "off" not in args.arms or len(args.arms) < 2:
        raise ConfigError(f"--arms {','.join(args.arms)}: give off and at least one cache arm to compare with it")
    if len(args.cache_ram) != 1:
        raise ConfigError("--cache-ram: advise takes one prompt-cache size")
    baseline = EngineSettings(args.n_batch, args.n_ubatch, args.flash_attn, args.kv_type)
    try:  # the baseline's settings are checked as the experiment checks its knobs
        experiment = Plan(formats=(weight_format,), arms=args.arms, episodes=args.episodes, turns=args.turns,
                          tokens=args.tokens, seed=args.seed,
                          prefix=args.prefix or f"advise-{args.seed}-{time.strftime('%Y%m%dT%H%M%S')}",
                          n_ctx=args.n_ctx, n_threads=args.threads, n_batch=(args.n_batch,),
                          n_ubatch=(args.n_ubatch,), flash_attn=(args.flash_attn,), kv_type=(args.kv_type,),
                          cache_ram=args.cache_ram)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    try:
        candidates = parse_candidates(args.settings, baseline)
    except ValueError as exc:
        raise ConfigError(f"--settings: {exc}") from None
    plan = AdvicePlan(experiment, tuple(candidates), args.prompt_tokens, args.decode_tokens, args.speed_rounds)
    if args.prompt_tokens + args.decode_tokens > args.n_ctx:
        raise ConfigError(f"--prompt-tokens {args.prompt_tokens} + --decode-tokens {args.decode_tokens} do not fit "
                          f"in --n-ctx {args.n_ctx}")
    return plan


def run(args: argparse.Namespace) -> int:
    require_llama()
    if args.plot:
        require_plot_extra()
    fmt = weight_format_of(args.model)
    if fmt not in QUANTS:
        raise ConfigError(f"--model {args.model} holds {fmt} weights; advise runs {', '.join(QUANTS)} models")
    plan = advice_plan(args, fmt)
    progress = progress_printer(args)
    advice = run_advice(plan, args.model, progress, args.pass_timeout)
    report = build_advice(open_database_after_passes(args, progress), advice, args.model, fmt)
    write_report(report, args.format == "json", print_advice, args.plot, plot.write_plot,
                 "no setting has a rate and a cost")
    return 130 if advice.interrupted else 0
