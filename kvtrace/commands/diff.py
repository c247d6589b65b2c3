"""``kvtrace diff RUN_A RUN_B``: where two runs forked, and which cache event caused it."""

from __future__ import annotations

import json
import sys
from typing import TextIO

from kvtrace import semconv as sc
from kvtrace.analysis.fork_text import describe_fork
from kvtrace.analysis.forks import DEFAULT_NEAR_TIE, CachePath, Diff, TurnPair, diff_runs, gguf_detokenizer
from kvtrace.analysis.html_view import write_fork_view
from kvtrace.commands.arguments import input_file, non_negative_number, output_file, turn_pair
from kvtrace.commands.common import open_database
from kvtrace.error_report import one_line
from kvtrace.errors import ConfigError, KvtraceError
from kvtrace.replay import verdicts


def add_arguments(p) -> None:
    p.description = ("Compare two runs episode by episode: the first turn and token where they differ, each "
                     "side's cache path there, the attribution and the culprit cache event with its provenance.")
    p.add_argument("run_a", metavar="RUN_A")
    p.add_argument("run_b", metavar="RUN_B")
    p.add_argument("--episode", metavar="ID", help="only this episode")
    p.add_argument("--turns", type=turn_pair, metavar="A,B",
                   help="compare turn A of RUN_A with turn B of RUN_B in each episode, and show both cache paths; "
                        "RUN_A and RUN_B may be one run (a probe's cold turn 0 against warm turn B)")
    p.add_argument("--format", choices=("text", "json"), default="text")
    p.add_argument("--html", metavar="FILE", type=output_file, help="also write a self-contained HTML fork view")
    p.add_argument("--model", metavar="PATH.gguf", type=input_file,
                   help="GGUF model whose vocabulary turns captured token ids into text")
    p.add_argument("--near-tie", type=non_negative_number, default=DEFAULT_NEAR_TIE, metavar="LOGITS",
                   help=f"margin below which a fork is a near tie (default {DEFAULT_NEAR_TIE})")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.turns and args.html:
        raise ConfigError("--html draws both runs' whole episodes side by side; it cannot be combined with --turns")
    turns = TurnPair(*args.turns) if args.turns else None
    detokenize = model_detokenizer(args.model) if args.model else None
    client = open_database(args)
    diff = diff_runs(client, args.run_a, args.run_b, episode=args.episode, near_tie=args.near_tie,
                     detokenize=detokenize, turns=turns)
    verdicts.attach(diff.forks)  # what `kvtrace replay --counterfactual` found for these forks
    if args.format == "json":
        json.dump([f.to_json() for f in diff.forks], sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print_diff(diff, sys.stdout)
    if args.html:
        write_fork_view(client, diff, args.html, detokenize)
        if not args.quiet:
            print(f"kvtrace: wrote {args.html}", file=sys.stderr)
    return 0


def model_detokenizer(path):
    """The vocabulary of ``--model``, refused before any database work when llama.cpp cannot read it."""
    try:
        return gguf_detokenizer(path)
    except KvtraceError:
        raise
    except Exception as exc:  # llama.cpp says ValueError / RuntimeError in its own words
        raise ConfigError(f"--model {path}: not a GGUF vocabulary llama.cpp can load ({one_line(exc)})") from None


def print_diff(diff: Diff, out: TextIO) -> None:
    how = "token ids" if diff.compared_by == sc.COMPARED_BY_TOKEN_IDS else "output hashes (no token ids captured)"
    sides = (f"{diff.run_a} turn {diff.turns.a} vs {diff.run_b} turn {diff.turns.b}" if diff.turns
             else f"{diff.run_a} vs {diff.run_b}")
    out.write(f"{sides}: {len(diff.forks)} of {diff.episodes_compared} episode(s) "
              f"forked (outputs compared by {how})\n")
    for fork in diff.forks:
        out.write("\n" + describe_fork(fork))
    if diff.unforked and diff.paths:
        out.write(f"\nnot forked ({len(diff.unforked)}):\n")
        for episode in diff.unforked:
            a, b = diff.paths.get(episode, (None, None))
            out.write(f"  episode {episode}: A {_path(a)} | B {_path(b)}\n")
    elif diff.unforked:
        shown = ", ".join(diff.unforked[:20]) + (" ..." if len(diff.unforked) > 20 else "")
        out.write(f"\nnot forked ({len(diff.unforked)}): {shown}\n")


def _path(path: CachePath | None) -> str:
    return path.describe() if path is not None else "?"
