"""README.md is a front page that tells the truth: every command it shows is run, by a test or by
.ci/run; its first block is the setup-and-demo line CI runs from a fresh clone; it stays short; and
every relative link in it and in docs/ leads to a file (and a heading) that exists."""

from __future__ import annotations

import ast
import re
import shlex
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, metadata, requires, version
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from readme_commands import README, ROOT, readme_command, sh_blocks

FIRST_BLOCK = 'python3 -m venv .venv && .venv/bin/pip install ".[llama]" && .venv/bin/kvtrace demo'
FULL_TESTS = "bash .ci/run"
FAST_TESTS = ".venv/bin/pytest -q tests/unit"
RUNNERS = {"readme_command", "readme_kvtrace_args"}
"""tests/readme_commands.py's functions: a line passed to one of them is a line a test runs."""


def blocks() -> list[list[str]]:
    return sh_blocks(README.read_text(encoding="utf-8"))


def is_install(line: str) -> bool:
    return shlex.split(line)[:2] == [".venv/bin/pip", "install"]


def lines_tests_run() -> set[str]:
    """Every string a test passes to readme_command / readme_kvtrace_args, directly or as a module constant."""
    found = set()
    for path in (ROOT / "tests").rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        constants = {target.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
                     and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
                     for target in node.targets if isinstance(target, ast.Name)}
        for node in ast.walk(tree):
            name = getattr(node, "func", None)
            if not (isinstance(node, ast.Call) and node.args
                    and getattr(name, "id", getattr(name, "attr", None)) in RUNNERS):
                continue
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                found.add(first.value)
            elif isinstance(first, ast.Name) and first.id in constants:
                found.add(constants[first.id])
    return found


def test_the_first_block_is_the_setup_and_demo_line():
    assert blocks()[0] == [FIRST_BLOCK]


def test_ci_runs_the_first_block_from_a_fresh_clone():
    steps = [line for line in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
             if line.startswith("run_step ")]
    (step,) = [line for line in steps if "README.md" in line and "first" in line]
    script = ROOT / shlex.split(step)[-1]
    assert script.is_file() and "README.md" in script.read_text(encoding="utf-8")


def test_every_command_readme_shows_is_run_by_a_test_or_by_ci():
    run_by_tests = lines_tests_run()
    shown = [line for block in blocks()[1:] for line in block]
    assert FULL_TESTS in shown and (ROOT / ".ci" / "run").is_file()
    not_run = [line for line in shown if line != FULL_TESTS and not is_install(line) and line not in run_by_tests]
    assert not_run == [], "README commands no test runs (through tests/readme_commands.py)"


def test_the_install_lines_name_extras_and_packages_this_project_provides():
    """`pip install` cannot run in a test; what it names can be checked: the project's own extras,
    and packages the test extra requires (so .ci/run installs them) that are installed here."""
    extras = set(metadata("kvtrace").get_all("Provides-Extra") or ())
    test_extra = {canonicalize_name(Requirement(r).name) for r in requires("kvtrace") or ()
                  if Requirement(r).marker and Requirement(r).marker.evaluate({"extra": "test"})}
    installs = [part.strip() for part in FIRST_BLOCK.split("&&") if is_install(part)]
    installs += [line for block in blocks()[1:] for line in block if is_install(line)]
    assert len(installs) == 2
    for line in installs:
        for word in shlex.split(line)[2:]:
            if word.startswith("-"):
                continue
            if word == "." or word.startswith(".["):
                named = set(word[2:-1].split(",")) if word != "." else set()
                assert named <= extras, f"{line}: no extra {sorted(named - extras)} in pyproject.toml"
                continue
            assert canonicalize_name(word) in test_extra, f"{line}: .ci/run does not install {word}"
            try:
                version(word)
            except PackageNotFoundError:
                pytest.fail(f"{line}: {word} is not installed in this environment")


def test_the_fast_test_command_runs_the_engine_free_suite():
    script = Path(sys.executable).parent / "pytest"
    if not script.is_file():
        pytest.skip(f"no pytest script beside {sys.executable}")
    argv = readme_command(FAST_TESTS, {".venv/bin/pytest": str(script)})
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert re.search(r"^\d+ passed", done.stdout.splitlines()[-1]), done.stdout[-2000:]


def test_readme_stays_a_front_page():
    assert len(README.read_text(encoding="utf-8").splitlines()) < 200


FENCED = re.compile(r"^```.*?^```", re.S | re.M)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(markdown: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, blanks as hyphens."""
    headings = re.findall(r"^#+\s+(.*)$", FENCED.sub("", markdown.read_text(encoding="utf-8")), re.M)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


@pytest.mark.parametrize("page", [README, *sorted((ROOT / "docs").glob("*.md"))], ids=lambda p: p.name)
def test_every_relative_link_leads_to_a_file_and_heading_that_exist(page):
    broken = []
    for target in LINK.findall(FENCED.sub("", page.read_text(encoding="utf-8"))):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(target)
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(target)
    assert broken == []
