"""Whatever folder a user runs kvtrace from, the installed kvtrace is what runs, in the CLI and in every
Python child it starts: a clone's root (whose kvtrace/ folder lacks the patches, collectors and queries
an install maps in) and a folder with a planted module alike."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvtrace import child_python
from kvtrace.child_python import python_module_command

ROOT = Path(__file__).resolve().parent.parent
KVTRACE = str(Path(sys.executable).parent / "kvtrace")


@pytest.fixture
def planted(tmp_path):
    """A working directory whose ``kvtrace`` package, if anything imported it, would leave a mark and fail."""
    folder = tmp_path / "planted"
    (folder / "kvtrace").mkdir(parents=True)
    mark = tmp_path / "planted-kvtrace-ran"
    (folder / "kvtrace" / "__init__.py").write_text(
        f"open({str(mark)!r}, 'w').close()\nraise SystemExit('the planted kvtrace ran')\n")
    return folder, mark


def kvtrace(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([KVTRACE, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["clone-root", "planted"])
def test_an_experiment_started_from_the_clones_root_or_a_planted_folder_runs_the_installed_kvtrace(
        where, planted):
    pytest.importorskip("llama_cpp")
    cwd, mark = (ROOT, None) if where == "clone-root" else planted
    done = kvtrace("experiment", "--generate", "tiny", "--formats", "F32", "--arms", "off,reuse", "--episodes", "2",
                   "--turns", "2", "--tokens", "4", "--prefix", "cwd", cwd=cwd)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "episodes that forked" in done.stdout
    assert mark is None or not mark.exists()


def test_alert_watch_evaluates_in_a_child_that_ignores_the_working_directory(planted, tmp_path):
    cwd, mark = planted
    rules = tmp_path / "rules.yaml"
    rules.write_text("rules:\n  - name: margin-shift\n    metric: margin_shift_mean_abs\n    threshold: 0.5\n")
    done = kvtrace("alert", "--rules", str(rules), "--watch", "0.1", "--cycles", "1", cwd=cwd)
    assert not mark.exists(), done.stderr
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]  # 0: evaluated, all clear (2: could not)


def test_a_command_under_kvtrace_run_imports_the_installed_kvtrace_from_a_planted_folder(planted):
    cwd, mark = planted
    done = kvtrace("run", "--", sys.executable, "-c", "import kvtrace; print(kvtrace.__file__)", cwd=cwd)
    assert done.returncode == 0, done.stderr
    assert not mark.exists()
    assert Path(done.stdout.strip()).resolve() != (cwd / "kvtrace" / "__init__.py").resolve()


def test_python_in_a_clones_root_says_in_one_line_that_it_found_the_source_folder(tmp_path):
    clone = tmp_path / "clone"
    shutil.copytree(ROOT / "kvtrace", clone / "kvtrace", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    shutil.copytree(ROOT / "patches", clone / "patches", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    # -S: no site-packages, so no editable install's finder maps the clone's patches/ in either.
    done = subprocess.run([sys.executable, "-S", "-c", "import kvtrace"], cwd=clone, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: kvtrace was imported from the source folder")
    assert str(clone / "kvtrace") in last and "pip install -e ." in last


@pytest.mark.parametrize("form", ["-P", "3.10"])
def test_a_python_child_runs_its_module_from_the_install_with_a_planted_kvtrace_in_its_working_directory(
        form, planted):
    cwd, mark = planted
    command = python_module_command("kvtrace.cli", "--help")
    if form == "3.10":  # what Python 3.10, which has no -P, is given: the same module run without '' on sys.path
        command = [sys.executable, "-c", child_python._RUN_MODULE_WITHOUT_WORKING_DIRECTORY, "kvtrace.cli", "--help"]
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "usage: kvtrace" in done.stdout and not mark.exists()
