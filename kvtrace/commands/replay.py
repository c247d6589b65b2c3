"""``kvtrace replay RUN --episode E``: re-execute recorded requests on their recorded cache paths and
check every generated token (the reproduction control); ``kvtrace replay RUN_A RUN_B --episode E
--counterfactual``: switch only the cache path at the fork and say whether the fork follows it.
``--server URL``: a run recorded in front of llama-server is re-executed on that server; a run
recorded inside vLLM is re-executed in a vLLM process of its own."""

from __future__ import annotations

import json
import sys

from kvtrace.analysis.forks import diff_runs
from kvtrace.commands.arguments import http_url, model_path, positive_number
from kvtrace.commands.common import open_database, progress_printer
from kvtrace.errors import ConfigError
from kvtrace.experiment.isolation import DEFAULT_PASS_TIMEOUT
from kvtrace.replay import verdicts
from kvtrace.replay.backends import backend_for
from kvtrace.replay.recorded import ReplayRefused, read_run
from kvtrace.replay.reproduce import counterfactual, refuse_unless_replayable, replay_episodes


def add_arguments(p) -> None:
    p.description = ("Re-execute the recorded requests of an episode in order, on the same model and recorded engine "
                     "configuration, each on its recorded cache path (reuse of N tokens, a prompt-cache restore of a "
                     "named state, or recompute), and check every generated token against the record. With two runs "
                     "and --counterfactual: at the episode's fork, run each side's request on the other side's cache "
                     "path (at a batch_composition fork on vLLM: at the other side's recorded batch), everything else "
                     "fixed; the verdict (confirmed, not_cache, not_reproduced) is kept, and `kvtrace diff` shows it "
                     "next to the label. Needs runs recorded with KVTRACE_CAPTURE=ids: inside llama-cpp-python; "
                     "inside vLLM, offline LLM or `vllm serve` (re-executed in an offline LLM: recompute is a "
                     "prefix-cache reset, a reuse runs once the blocks of the requests it started from are cached); "
                     "or through `kvtrace proxy --llama-server-log` in front of llama-server, replayed with --server "
                     "on a llama-server started with the recorded model and command line (and --cache-ram 0). A "
                     "prompt-cache restore of a state another slot saved is refused.")
    p.add_argument("runs", nargs="+", metavar="RUN", help="one run (reproduce) or RUN_A RUN_B (--counterfactual)")
    p.add_argument("--episode", action="append", required=True, metavar="ID",
                   help="the episode to re-execute (repeatable without --counterfactual)")
    p.add_argument("--counterfactual", action="store_true",
                   help="with RUN_A RUN_B: switch the cache path (a batch_composition fork on vLLM: the batch) "
                        "of the forked request between the runs")
    engine = p.add_mutually_exclusive_group()
    engine.add_argument("--model", type=model_path, metavar="PATH.gguf|DIR",
                        help="the model the run used: a GGUF file, or a vLLM run's model directory (default: the "
                             "file in kvtrace's model cache with the recorded model fingerprint; for vLLM the "
                             "recorded directory, else one in the model cache with its fingerprint)")
    engine.add_argument("--server", type=http_url, metavar="URL",
                        help="a llama-server to re-execute a run recorded through kvtrace proxy on: token-id "
                             "prompts on /completion, slot 0, cache_prompt false for recompute")
    p.add_argument("--format", choices=("text", "json"), default="text")
    p.add_argument("--timeout", type=positive_number, default=DEFAULT_PASS_TIMEOUT, metavar="SECONDS",
                   help="end the replay when one request (or the model load) takes longer (default %(default)g)")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.counterfactual and (len(args.runs) != 2 or len(args.episode) != 1):
        raise ConfigError("--counterfactual takes two runs and one --episode: kvtrace replay RUN_A RUN_B "
                          "--episode E --counterfactual")
    if not args.counterfactual and len(args.runs) != 1:
        raise ConfigError("give one run to reproduce, or two runs with --counterfactual")
    client = open_database(args)
    try:
        fork = _fork(client, args) if args.counterfactual else None
        if fork is not None:
            refuse_unless_replayable(fork)  # before the runs are read and an engine is loaded
        runs = [read_run(client, run_id) for run_id in args.runs]
    finally:
        client.close()  # the embedded database is held by one process at a time; the engine needs none
    progress = progress_printer(args)
    backend = backend_for(runs, args.server, args.model, progress, args.timeout)
    if fork is not None:
        return _counterfactual(args, runs, fork, backend, progress)
    return _reproduce(args, runs[0], backend, progress)


def _fork(client, args):
    run_a, run_b = args.runs
    (episode,) = args.episode
    diff = diff_runs(client, run_a, run_b, episode=episode)
    if not diff.forks:
        if diff.episodes_compared == 0:
            raise ReplayRefused(f"runs {run_a!r} and {run_b!r} do not both have episode {episode!r}")
        raise ReplayRefused(f"runs {run_a!r} and {run_b!r} did not fork in episode {episode!r}: nothing to explain")
    return diff.forks[0]


def _reproduce(args, run, backend, progress) -> int:
    result = replay_episodes(run, args.episode, backend, progress)
    if args.format == "json":
        json.dump(result.to_json(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        _print_reproduction(result)
    return 0 if result.exact else 1


def _print_reproduction(result) -> None:
    episodes = ", ".join(result.episodes)
    print(f"replay of run {result.run_id}, episode {episodes}: {result.requests_reproduced}/{len(result.requests)} "
          f"requests and {result.tokens_reproduced}/{result.tokens} tokens reproduced exactly")
    if result.recorded_seconds > 0:
        print(f"  re-executed in {result.seconds:.1f} s, the engine's start included; recorded in "
              f"{result.recorded_seconds:.1f} s ({result.seconds / result.recorded_seconds:.2f}x)")
    if result.dependencies:
        print(f"  (first re-executed {len(result.dependencies)} request(s) of other episodes whose state it reused: "
              f"{sum(r.reproduced for r in result.dependencies)}/{len(result.dependencies)} reproduced)")
    for r in result.requests + result.dependencies:
        if not r.reproduced:
            why = (f"tokens differ from position {r.tokens_reproduced}" if r.path_reproduced
                   else "the engine did not reuse the recorded number of prompt tokens")
            print(f"  episode {r.episode_id} turn {r.turn} ({r.path}): {why}")


def _counterfactual(args, runs, fork, backend, progress) -> int:
    verdict = counterfactual(runs[0], runs[1], fork, backend, progress)
    try:
        verdicts.keep(verdict)
    except OSError as exc:  # a full disk, or a link where the file belongs: the verdict is still printed
        print(f"kvtrace: warning: the verdict could not be kept in {verdicts.verdicts_file()} "
              f"({exc.strerror or exc}); `kvtrace diff` will not show it", file=sys.stderr)
    if args.format == "json":
        json.dump(verdict.to_json(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(f"episode {verdict.episode}: forked at turn {verdict.turn}, token {verdict.position} "
              f"[{verdict.attribution}] -> counterfactual: {verdict.verdict}")
        print(f"  {verdict.explanation}")
    return 0
