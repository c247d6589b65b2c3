"""The HTML fork view in a real headless Chromium: the fork is marked in the DOM, the page
renders (non-blank screenshot) and fetches nothing from the network."""

from __future__ import annotations

import math
import re
import shutil
import subprocess
import tempfile
import zlib
from pathlib import Path

import pytest

from diff_scenarios import CachePath, ScenarioBook
from kvtrace import semconv as sc
from kvtrace.cli import main
from readme_commands import readme_kvtrace_args

A, B = "html-A", "html-B"
PROMPT = list(range(1, 25))
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def stream(n: int, fork_at: int, other: bool) -> tuple[list[int], list[float]]:
    tokens = [100 + i for i in range(n)]
    margins = [abs(math.sin(i * 0.7)) * 2.5 + 0.02 for i in range(n)]
    margins[fork_at] = 0.03 if other else 0.02
    if other:
        tokens[fork_at:] = [300 + i for i in range(fork_at, n)]
        margins[fork_at + 1:] = [m * 0.8 for m in margins[fork_at + 1:]]
    return tokens, margins


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> Path:
    from kvtrace.collectors.schema import init_schema
    from kvtrace.db import connect

    root = tmp_path_factory.mktemp("html")
    book = ScenarioBook(root / "spool")
    for run in (A, B):
        book.turn(run, "agent-<1>", 0, PROMPT, [7, 8, 9])
    stored = book.records[(A, "agent-<1>", 0)].origin()
    for turn in (1, 2):
        for run in (A, B):
            cache = (CachePath(sc.LAYER_PROMPT_CACHE, 26, "key", stored, sc.EVENT_CACHE_RESTORE)
                     if run == A else CachePath())
            tokens, margins = stream(30, 12, other=(run == B and turn == 1))
            book.turn(run, "agent-<1>", turn, PROMPT + [7, 8, 9, turn], tokens, margins, cache=cache)
    url = f"chdb://{root / 'db'}"
    client = connect(url)
    init_schema(client)
    book.ingest(client)
    out = root / "fork.html"
    diff = readme_kvtrace_args("kvtrace diff RUN_A RUN_B --html fork.html",
                               {"RUN_A": A, "RUN_B": B, "fork.html": str(out)})
    assert main(["--db", url, "--spool-dir", str(root / "spool"), "-q", *diff]) == 0
    client.close()
    return out


def test_page_is_self_contained(page):
    text = page.read_text()
    assert 'id="fork"' in text
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", text)
    assert "@import" not in text and "url(" not in text
    assert "agent-&lt;1&gt;" in text  # episode ids are escaped


def _png_has_content(png: bytes) -> bool:
    """Rough check without an imaging library: a blank page's scanlines hold almost no distinct bytes."""
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    data, pos = b"", 8
    while pos < len(png):
        length = int.from_bytes(png[pos:pos + 4], "big")
        kind = png[pos + 4:pos + 8]
        if kind == b"IDAT":
            data += png[pos + 8:pos + 8 + length]
        pos += 12 + length
    return len(set(zlib.decompress(data))) > 40


@pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (apt-get install -y chromium)")
def test_chromium_renders_the_fork(page):
    shot = page.with_suffix(".png")
    flags = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--hide-scrollbars", "--window-size=1280,1400"]
    with tempfile.TemporaryDirectory() as profile:
        dom = subprocess.run(flags + [f"--user-data-dir={profile}", "--dump-dom", page.as_uri()],
                             capture_output=True, text=True, timeout=90)
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert re.search(r'<div class="pos fork" id="fork" data-position="12">', dom.stdout)
    assert dom.stdout.count('class="pos fork"') == 1
    assert 'class="badge hit_vs_recompute"' in dom.stdout
    with tempfile.TemporaryDirectory() as profile:
        run = subprocess.run(flags + [f"--user-data-dir={profile}", f"--screenshot={shot}", page.as_uri()],
                             capture_output=True, text=True, timeout=90)
    assert run.returncode == 0, run.stderr[-2000:]
    assert _png_has_content(shot.read_bytes())
