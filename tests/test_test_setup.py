"""The test set-up itself: a hanging test fails under the time limit instead of stalling the run,
and under CI (`CI=true`) a test that would skip for a missing engine fails instead.

Each story runs a child pytest on a throwaway project that carries this suite's own settings
(pyproject.toml) and conftest.py, so what is checked is the configuration CI runs with; the last
ones run .ci/run's vLLM step where vLLM is missing, and .ci/run itself.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from kvtrace.child_python import python_module_command

ROOT = Path(__file__).resolve().parent.parent
# Only a hang of the child could reach this; the child's own limit is a few seconds.
CHILD_BOUND_S = 180


def run_child_pytest(cwd: Path, *args: str, ci: bool, **env: str) -> subprocess.CompletedProcess:
    """``python -m pytest ARGS`` in ``cwd``, the working directory kept off ``sys.path`` as kvtrace's own
    children keep it (so ``cwd`` may be the clone), with ``CI=true`` or without CI in its environment."""
    child_env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_TIMEOUT", "PYTEST_ADDOPTS")}
    if ci:
        child_env["CI"] = "true"
    child_env.update(env)
    return subprocess.run(python_module_command("pytest", "-p", "no:cacheprovider", *args),
                          cwd=cwd, env=child_env, capture_output=True, text=True, timeout=CHILD_BOUND_S)


@pytest.fixture
def project(tmp_path):
    """A throwaway test project with this suite's pytest settings and conftest."""
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    shutil.copy(ROOT / "tests" / "conftest.py", tmp_path / "conftest.py")
    return tmp_path


HANGS_IN_PYTHON = """
import time

def test_waits_for_an_answer_that_never_comes():
    time.sleep(3600)
"""

# A native call that never returns to Python, as llama.cpp's decode does when it sleeps in ggml's
# thread pool: a second lock of a default (non-recursive) pthread mutex waits forever, and no
# signal wakes it. ctypes releases the GIL around the call, as llama-cpp-python's bindings do.
HANGS_IN_NATIVE_CODE = """
import ctypes

def test_waits_in_native_code_on_a_lock_it_already_holds():
    libc = ctypes.CDLL(None)
    mutex = ctypes.create_string_buffer(64)  # all zeros: PTHREAD_MUTEX_INITIALIZER
    assert libc.pthread_mutex_lock(mutex) == 0
    libc.pthread_mutex_lock(mutex)
"""


@pytest.mark.parametrize("source, hanging_line", [
    (HANGS_IN_PYTHON, "time.sleep(3600)"),
    (HANGS_IN_NATIVE_CODE, "libc.pthread_mutex_lock(mutex)"),
], ids=["python", "native"])
def test_a_hanging_test_fails_under_the_time_limit_with_its_stack(project, source, hanging_line):
    (project / "test_hangs.py").write_text(source)
    # The suite's own method (pyproject.toml), with a limit short enough for this story.
    done = run_child_pytest(project, "-o", "timeout=3", "test_hangs.py", ci=False)
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    assert "Timeout" in output
    assert hanging_line in output  # the dumped stack shows where it hung


ENGINE = "kvtrace_engine_that_is_not_installed"

MISSING_ENGINE_AT_MODULE_LEVEL = f"""
import pytest

pytest.importorskip("{ENGINE}")

def test_generates_with_the_engine():
    pass
"""

MISSING_ENGINE_IN_A_FIXTURE = f"""
import pytest

@pytest.fixture
def engine():
    return pytest.importorskip("{ENGINE}")

def test_generates_with_the_engine(engine):
    pass

@pytest.mark.skipif(True, reason="chromium not installed")
def test_renders_in_a_browser():
    pass
"""


@pytest.mark.parametrize("source, reasons", [
    (MISSING_ENGINE_AT_MODULE_LEVEL, [f"could not import '{ENGINE}'"]),
    (MISSING_ENGINE_IN_A_FIXTURE, [f"could not import '{ENGINE}'", "chromium not installed"]),
], ids=["module-level", "per-test"])
def test_a_missing_engine_skips_locally_and_fails_under_ci(project, source, reasons):
    (project / "test_engine.py").write_text(source)
    (project / "test_without_engines.py").write_text("def test_reads_the_config():\n    pass\n")
    files = ("test_engine.py", "test_without_engines.py")

    local = run_child_pytest(project, *files, ci=False)
    assert local.returncode == 0, local.stdout + local.stderr
    assert f"1 passed, {len(reasons)} skipped" in local.stdout

    in_ci = run_child_pytest(project, *files, ci=True)
    assert in_ci.returncode != 0, in_ci.stdout + in_ci.stderr
    assert "skipped" not in in_ci.stdout.splitlines()[-1]
    for reason in reasons:
        assert f"skipped under CI=true, where every engine and extra must be installed: {reason}" in in_ci.stdout


def test_the_vllm_step_fails_under_ci_where_vllm_is_missing(tmp_path):
    # .ci/run's second step, as it runs it ...
    vllm_step = "pytest -q tests/test_vllm_*.py"
    assert vllm_step in (ROOT / ".ci" / "run").read_text()
    # ... in an environment where `import vllm` fails as it does where vLLM is not installed (here a
    # shadowing package, so that the story holds in a venv that has vLLM too).
    missing = tmp_path / "without-vllm" / "vllm"
    missing.mkdir(parents=True)
    (missing / "__init__.py").write_text('raise ModuleNotFoundError("No module named \'vllm\'", name="vllm")\n')
    vllm_tests = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_vllm_*.py"))
    assert vllm_tests
    path = os.pathsep.join(filter(None, [str(missing.parent), os.environ.get("PYTHONPATH")]))
    done = run_child_pytest(ROOT, "-q", *vllm_tests, ci=True, PYTHONPATH=path)
    assert done.returncode != 0, done.stdout + done.stderr
    assert "skipped under CI=true" in done.stdout and "No module named 'vllm'" in done.stdout


# .ci/run's own logic, with stand-ins for the two venvs' Python (pip does nothing) and pytest, and for
# the fresh-clone README step: each step exits with the code the story gives it. What runs is the real
# script.
STAND_IN_STEP = """#!/usr/bin/env bash
echo "{step} $*" >> "$CI_RUN_LOG"
exit {exit_code}
"""


@pytest.mark.parametrize("readme_exit, main_exit, vllm_exit, passes", [
    (0, 0, 0, True),
    (0, 1, 0, False),  # a failed (or timed-out) main suite; the vLLM step still runs
    (0, 0, 5, False),  # pytest's "no tests collected" is not a pass
    (1, 0, 0, False),  # the README's first block failed in a fresh clone; the suites still run
    (1, 2, 1, False),
], ids=["all-pass", "main-fails", "vllm-collects-nothing", "readme-fails", "all-fail"])
def test_ci_run_runs_every_step_and_fails_if_any_fails(tmp_path, readme_exit, main_exit, vllm_exit, passes):
    checkout = tmp_path / "checkout"
    (checkout / ".ci").mkdir(parents=True)
    shutil.copy(ROOT / ".ci" / "run", checkout / ".ci" / "run")
    stand_ins = {".ci/readme_first_block": ("readme", readme_exit),
                 ".venv/bin/python": ("pip", 0), ".venv/bin/pytest": ("main", main_exit),
                 ".venv-vllm/bin/python": ("pip", 0), ".venv-vllm/bin/pytest": ("vllm", vllm_exit)}
    for path, (step, code) in stand_ins.items():
        stand_in = checkout / path
        stand_in.parent.mkdir(parents=True, exist_ok=True)
        stand_in.write_text(STAND_IN_STEP.format(step=step, exit_code=code))
        stand_in.chmod(0o755)
    tools = tmp_path / "bin"
    tools.mkdir()
    for tool in ("chromium", "prometheus-alertmanager"):  # installed: .ci/run leaves apt-get alone
        (tools / tool).write_text("#!/bin/sh\n")
        (tools / tool).chmod(0o755)
    log = tmp_path / "steps.log"
    env = dict(os.environ, PATH=f"{tools}{os.pathsep}{os.environ['PATH']}", CI_RUN_LOG=str(log), CI="true")
    done = subprocess.run(["bash", ".ci/run"], cwd=checkout, env=env, capture_output=True, text=True,
                          timeout=CHILD_BOUND_S)
    assert (done.returncode == 0) == passes, done.stdout + done.stderr
    steps = [line for line in log.read_text().splitlines() if not line.startswith("pip ")]
    assert [s.split()[0] for s in steps] == ["readme", "main", "vllm"]
    assert "--ignore-glob=tests/test_vllm_*.py" in steps[1]
    assert "amx_int8" in done.stdout
