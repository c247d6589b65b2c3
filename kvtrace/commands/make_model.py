"""``kvtrace make-model``: write a random-weight Llama GGUF for tests and benchmarks."""

from __future__ import annotations

import argparse
import sys

from kvtrace.commands.arguments import output_file, seed
from kvtrace.testmodels.llama_gguf import QUANTS, SEED, SIZES, make_model


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = "Write a self-contained random-weight Llama GGUF model. Same arguments, same bytes."
    parser.add_argument("--out", required=True, type=output_file, metavar="PATH", help="GGUF file to write")
    parser.add_argument("--quant", default="F32", choices=QUANTS, help="weight format (default F32)")
    parser.add_argument("--size", default="tiny", choices=list(SIZES),
                        help="tiny (~1M params, tests), small (~20M), base (~100M, benchmarks)")
    parser.add_argument("--seed", type=seed, default=None, help="weight seed (default: the fixed built-in seed)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    path = make_model(args.out, args.quant, args.size, SEED if args.seed is None else args.seed)
    if not args.quiet:
        print(f"wrote {path} ({args.size}, {args.quant}, {SIZES[args.size].n_params / 1e6:.1f}M params)",
              file=sys.stderr)
    return 0
