"""The commands README.md shows, for the tests that run them.

A test that runs a README command takes it from here by its exact text: the line must still be in
one of README's ```sh blocks, so README and the tests cannot drift apart, and tests/test_readme.py
finds every README line a test runs by looking for these calls. Upper-case words (MODEL, RUN_A …)
and addresses such as ``http://127.0.0.1:8080`` are placeholders a test gives its own values; a
test may append settings that size the run (ports, threads, context) but drops no word README shows.
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path
from typing import Mapping

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
SH_BLOCK = re.compile(r"^```sh\n(.*?)^```", re.S | re.M)
PROGRAMS = {"kvtrace": str(Path(sys.executable).parent / "kvtrace"), "python": sys.executable}
"""Programs README names, as this test environment has them: its own kvtrace script and interpreter."""


def without_comment(line: str) -> str:
    """The line up to a ``#`` that starts a shell comment (outside quotes, after a blank)."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def sh_blocks(text: str) -> list[list[str]]:
    """Each ```sh block of a Markdown text as its command lines: continuations joined, comments dropped."""
    blocks = []
    for body in SH_BLOCK.findall(text):
        lines, pending = [], ""
        for raw in body.splitlines():
            line = without_comment(raw.strip())
            if line.endswith("\\"):
                pending += line[:-1].rstrip() + " "
                continue
            line, pending = (pending + line).strip(), ""
            if line:
                lines.append(line)
        blocks.append(lines)
    return blocks


def readme_lines() -> list[str]:
    return [line for block in sh_blocks(README.read_text(encoding="utf-8")) for line in block]


def readme_command(line: str, values: Mapping[str, str] = {}) -> list[str]:
    """The argv of a command line README shows, its placeholders given ``values`` (whole words)."""
    assert line in readme_lines(), f"README.md no longer shows {line!r}: update the test with it"
    words = shlex.split(line)
    unused = set(values) - set(words)
    assert not unused, f"{sorted(unused)} are not words of {line!r}"
    argv = [values.get(word, word) for word in words]
    for i in [0] + [i + 1 for i, word in enumerate(words[:-1]) if word == "--"]:
        if words[i] not in values:
            argv[i] = PROGRAMS.get(words[i], argv[i])
    return argv


def readme_kvtrace_args(line: str, values: Mapping[str, str] = {}) -> list[str]:
    """A ``kvtrace ...`` line README shows, as the arguments of an in-process ``kvtrace.cli.main``."""
    assert line.startswith("kvtrace "), line
    return readme_command(line, values)[1:]
