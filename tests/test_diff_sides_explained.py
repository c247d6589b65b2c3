"""A side of a fork with no margin or no token there: ``kvtrace diff`` says why instead of a bare "n/a"
or "?". Its per-token arrays were cut before the fork (its sampler row was not the output token, its last
rows came late, the server left out a token's log-probabilities), or its output had ended there while
the other side's went on."""

from __future__ import annotations

import json

from diff_scenarios import CachePath, ScenarioBook
from kvtrace import semconv as sc
from kvtrace.cli import main

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]
NEXT = PROMPT + [10, 11, 12, 20]


def stored(book: ScenarioBook, tmp_path) -> str:
    """The book's spans ingested into a new embedded database; its URL."""
    from kvtrace.collectors.schema import init_schema
    from kvtrace.db import connect

    url = f"chdb://{tmp_path / 'db'}"
    client = connect(url)
    try:
        init_schema(client)
        book.ingest(client)
    finally:
        client.close()
    return url


def test_a_side_without_a_margin_at_the_fork_says_where_its_rows_stop_and_why(tmp_path, capsys):
    book = ScenarioBook(tmp_path / "spool")
    for run in ("cut-A", "cut-B"):
        book.turn(run, "e", 0, PROMPT, [10, 11, 12])
    # They part at token 1. A's rows stop there (a discarded sample); B's only after the fork.
    book.turn("cut-A", "e", 1, NEXT, [40, 41, 42, 43], [1.0, 0.5, 1.0, 1.0], rows_cut=(1, sc.ROWS_MISALIGNED))
    book.turn("cut-B", "e", 1, NEXT, [40, 44, 42, 43], [1.0, 0.02, 1.0, 1.0], rows_cut=(3, sc.ROWS_LATE))
    url = stored(book, tmp_path)

    def diff(*args: str) -> str:
        assert main(["--db", url, "--spool-dir", str(tmp_path / "spool"), "-q", "diff", "cut-A", "cut-B", *args]) == 0
        return capsys.readouterr().out

    (fork,) = json.loads(diff("--format", "json"))
    assert (fork["turn"], fork["position"], fork["a"]["token"], fork["b"]["token"]) == (1, 1, 41, 44)
    assert fork["a"]["margin"] is None and fork["b"]["margin"] == 0.02  # NaN is JSON's null
    assert (fork["a"]["rows_cut_at"], fork["a"]["rows_cut_reason"]) == (1, sc.ROWS_MISALIGNED)
    assert (fork["b"]["rows_cut_at"], fork["b"]["rows_cut_reason"]) == (3, sc.ROWS_LATE)
    text = diff()
    assert ("A has no margin at the fork: its rows stop at token 1, where the sampler's row was not the output token"
            in text)
    assert "B has no margin" not in text  # B has its row at the fork
    page = tmp_path / "fork.html"
    diff("--html", str(page))
    assert page.read_text().count("its rows stop at token") == 1


def test_a_side_whose_output_ended_before_the_fork_says_so_and_why(tmp_path, capsys):
    book = ScenarioBook(tmp_path / "spool")
    for run in ("end-A", "end-B"):
        book.turn(run, "e", 0, PROMPT, [10, 11, 12])
    reuse = CachePath(sc.LAYER_KV_REUSE, 11, event=sc.EVENT_CACHE_REUSE)
    book.turn("end-A", "e", 1, NEXT, [40, 41, 42, 43], cache=reuse)
    book.turn("end-B", "e", 1, NEXT, [40, 41], finish_reason=sc.FINISH_CANCELLED)  # its client went away
    url = stored(book, tmp_path)
    argv = ["--db", url, "--spool-dir", str(tmp_path / "spool"), "-q", "diff", "end-A", "end-B"]
    assert main([*argv, "--format", "json"]) == 0
    (fork,) = json.loads(capsys.readouterr().out)
    assert (fork["turn"], fork["position"], fork["a"]["token"], fork["b"]["token"]) == (1, 2, 42, -1)
    assert (fork["a"]["finish_reason"], fork["b"]["finish_reason"]) == ("length", sc.FINISH_CANCELLED)
    # No token was decided there: not blamed on the cache (A reused, B recomputed), nothing to replay.
    assert (fork["attribution"], fork["culprit"]) == (sc.ATTRIBUTION_OUTPUT_CANCELLED, None)
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "chose nothing: its output ended (cancelled)" in text and "chose 42 " in text
    assert "side B's request was cancelled after 2 tokens" in text and "prove it" not in text
    assert main(["--db", url, "--spool-dir", str(tmp_path / "spool"), "-q", "replay", "end-A", "end-B",
                 "--episode", "e", "--counterfactual"]) == 2
    err = capsys.readouterr().err.strip()
    assert "cancelled there" in err and err.count("\n") == 0 and "Traceback" not in err
