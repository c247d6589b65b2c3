"""kvtrace's own commands print their own output only: llama.cpp's log goes to the debug log.

llama.cpp writes from C (the quantizer's ``[   1/  21] ...`` per-tensor lines,
``llama_model_loader: ...``, the ``n_ctx_train`` warning), so the commands run as separate
processes here and both of their streams are read whole.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("llama_cpp")


def kvtrace(*args: str, env_dir) -> subprocess.CompletedProcess:
    env = dict(os.environ, XDG_DATA_HOME=str(env_dir / "data"), KVTRACE_SPOOL_DIR=str(env_dir / "spool"),
               KVTRACE_CLICKHOUSE_URL=f"chdb://{env_dir / 'db'}")
    return subprocess.run([sys.executable, "-m", "kvtrace.cli", *args], capture_output=True, text=True, env=env,
                          timeout=600)


def llama_cpp_lines(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in (result.stdout + result.stderr).splitlines()
            if line.startswith(("llama_", "[ ", "print_info", "load", "warning: "))]


def test_demo_prints_only_its_own_story(kvtrace_env):
    # A fresh data dir: the demo generates and quantizes its models in this very run.
    result = kvtrace("demo", "--episodes", "3", "--turns", "2", "--tokens", "6", env_dir=kvtrace_env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("kvtrace demo: ")
    assert "divergence against `off`: episodes that forked" in result.stdout and "demo took" in result.stdout
    assert llama_cpp_lines(result) == []


def test_make_model_is_quiet_and_its_quantizer_lines_reach_the_debug_log(kvtrace_env):
    out = kvtrace_env / "tiny-Q4_0.gguf"
    quiet = kvtrace("make-model", "--out", str(out), "--quant", "Q4_0", env_dir=kvtrace_env)
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stdout == "" and quiet.stderr.startswith("wrote ") and len(quiet.stderr.splitlines()) == 1
    verbose = kvtrace("-v", "make-model", "--out", str(out), "--quant", "Q4_0", env_dir=kvtrace_env)
    assert verbose.returncode == 0, verbose.stderr
    routed = [line for line in verbose.stderr.splitlines() if line.startswith("kvtrace.llama_cpp: DEBUG: ")]
    assert any("[   1/" in line for line in routed)  # the quantizer's per-tensor lines, now log records
    assert llama_cpp_lines(verbose) == []


def test_generated_models_are_trained_for_the_context_kvtrace_runs_them_with():
    from kvtrace.experiment import Plan
    from kvtrace.testmodels.llama_gguf import SIZES

    assert {shape.n_ctx_train for shape in SIZES.values()} == {Plan().n_ctx}


def test_the_route_is_kvtraces_only_while_kvtrace_drives_llama_cpp(caplog, tmp_path):
    import ctypes
    import logging

    import llama_cpp

    from kvtrace.testmodels.llama_gguf import make_model

    def callback_in_force() -> int:
        callback, user_data = llama_cpp.llama_log_callback(), ctypes.c_void_p()
        llama_cpp.llama_log_get(ctypes.byref(callback), ctypes.byref(user_data))
        return ctypes.cast(callback, ctypes.c_void_p).value

    before = callback_in_force()
    with caplog.at_level(logging.DEBUG, logger="kvtrace.llama_cpp"):
        make_model(tmp_path / "tiny-Q8_0.gguf", "Q8_0", "tiny")
    assert any(r.name == "kvtrace.llama_cpp" and r.getMessage().startswith("[   1/") for r in caplog.records)
    assert callback_in_force() == before  # llama-cpp-python's own callback is back for the user's engines
