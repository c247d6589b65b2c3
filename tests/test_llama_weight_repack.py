"""Intel AMX machines: kvtrace's own engines load without llama.cpp's weight repack, on every CPU.

On a Xeon with AMX, llama.cpp repacks quantized weights for its AMX kernels and the first decode
crashes or hangs (llama.cpp #20824).  kvtrace's loaders (the experiment, the demo, the tests'
fixtures, the benchmarks) therefore load with ``use_extra_bufts = False`` everywhere, so every
machine runs the same kernels; the setting every request ran with is recorded; a user's own
engine keeps llama.cpp's defaults; ``kvtrace selfcheck`` tells a user on such a machine what to do.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

llama_cpp = pytest.importorskip("llama_cpp")

from kvtrace import semconv as sc  # noqa: E402
from kvtrace.cli import main  # noqa: E402
from kvtrace.patches.llama_cpp import repack  # noqa: E402

SAPPHIRE_RAPIDS = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu vme avx2 avx512f avx512_vnni avx512_bf16 amx_bf16 avx512_fp16 amx_tile amx_int8
"""
EPYC = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9654 96-Core Processor
flags\t\t: fpu vme avx2 avx512f avx512_vnni avx512_bf16
"""
LLAMA_WITH_AMX = "CPU : SSE3 = 1 | AVX2 = 1 | AVX512 = 1 | AVX512_VNNI = 1 | AMX_INT8 = 1 | REPACK = 1 |"
LLAMA_WITHOUT_AMX = "CPU : SSE3 = 1 | AVX2 = 1 | AVX512 = 1 | AVX512_VNNI = 1 | REPACK = 1 |"

GENERATE = """
import sys
from kvtrace.patches.llama_cpp.repack import load_llama
llm = load_llama(sys.argv[1], n_ctx=256, n_batch=64, n_ubatch=64, n_threads=1, n_threads_batch=1)
print(int(llm.model_params.use_extra_bufts))
print(llm.create_completion("the agent opens the file and", max_tokens=8, temperature=0.0)["choices"][0]["text"])
"""


def numerics_of(attrs: dict) -> dict:
    return json.loads(attrs[sc.NUMERICS_SETTINGS])


def test_kvtraces_engines_load_without_the_repack_and_the_request_says_so(llama_patched, memory_recorder,
                                                                          make_llama, finished_requests):
    llm = make_llama()  # the tests' fixture loads the way kvtrace's own commands do
    assert llm.model_params.use_extra_bufts is False  # what llama.cpp was handed, read back from the engine
    llm.create_completion("configuration", max_tokens=2, temperature=0.0)
    ((attrs, _, _),) = finished_requests(memory_recorder)
    numerics = numerics_of(attrs)
    assert numerics["weight_repack"] is False
    assert numerics["cpu_amx"] is repack.cpu_has_amx()


def test_the_experiment_opens_its_engines_without_the_repack(tiny_gguf):
    from kvtrace.experiment import Plan
    from kvtrace.experiment.runner import open_llama

    llm = open_llama(tiny_gguf, Plan(n_ctx=256))
    try:
        assert llm.model_params.use_extra_bufts is False
    finally:
        llm.close()


def test_a_quantized_model_generates_through_kvtraces_loader(tmp_path):
    """The model that crashes a plain ``Llama`` on an AMX machine; its own process, so a crash or a
    hang fails this test instead of the test run."""
    from kvtrace.testmodels.llama_gguf import make_model

    model = make_model(tmp_path / "tiny-Q4_0.gguf", "Q4_0", "tiny")
    try:
        result = subprocess.run([sys.executable, "-c", GENERATE, str(model)], capture_output=True, text=True,
                                timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail(f"decode hung; {repack.amx_hint() or 'no AMX on this CPU'}")
    assert result.returncode == 0, f"exit {result.returncode}: {result.stderr[-2000:]}; {repack.amx_hint()}"
    repack_flag, text = result.stdout.split("\n", 1)
    assert repack_flag == "0" and text.strip()


def test_a_users_own_llama_keeps_llama_cpps_defaults(llama_patched, memory_recorder, tiny_gguf,
                                                     finished_requests):
    """Instrumentation records the user's engine as it is; it changes nothing, even in a process
    where kvtrace has loaded its own models with the repack off."""
    repack.load_llama(tiny_gguf, vocab_only=True).close()  # kvtrace's hook is installed and must stay inert
    default = bool(llama_cpp.llama_model_default_params().use_extra_bufts)
    llm = llama_cpp.Llama(model_path=str(tiny_gguf), n_ctx=256, n_batch=64, n_ubatch=64, n_threads=1,
                          n_threads_batch=1, verbose=False)
    try:
        assert bool(llm.model_params.use_extra_bufts) is default
        llm.create_completion("the user's engine", max_tokens=2, temperature=0.0)
    finally:
        llm.close()
    ((attrs, _, _),) = finished_requests(memory_recorder)
    assert numerics_of(attrs)["weight_repack"] is default


def test_amx_is_read_from_the_cpu_flags():
    assert repack.cpu_has_amx(SAPPHIRE_RAPIDS)
    assert not repack.cpu_has_amx(EPYC)
    assert not repack.cpu_has_amx("")  # no /proc/cpuinfo (not Linux): no AMX claimed
    assert repack.cpu_has_amx(SAPPHIRE_RAPIDS.replace(" amx_int8", "").replace(" amx_bf16", ""))  # amx_tile alone


def test_llama_cpp_repacks_for_amx_when_built_with_it():
    assert repack.llama_repacks_for_amx(LLAMA_WITH_AMX)
    assert not repack.llama_repacks_for_amx(LLAMA_WITHOUT_AMX)
    assert not repack.llama_repacks_for_amx(LLAMA_WITH_AMX.replace("AMX_INT8 = 1", "AMX_INT8 = 0"))


def test_the_crash_hint_names_the_cause_only_where_it_can_be():
    hint = repack.amx_hint(SAPPHIRE_RAPIDS, LLAMA_WITH_AMX)
    assert "Intel AMX" in hint and "#20824" in hint and "use_extra_bufts = False" in hint and "\n" not in hint
    assert repack.amx_hint(EPYC, LLAMA_WITH_AMX) is None
    assert repack.amx_hint(SAPPHIRE_RAPIDS, LLAMA_WITHOUT_AMX) is None


@pytest.mark.parametrize("cpuinfo, system_info, warned", [
    (SAPPHIRE_RAPIDS, LLAMA_WITH_AMX, True),
    (EPYC, LLAMA_WITH_AMX, False),
    (SAPPHIRE_RAPIDS, LLAMA_WITHOUT_AMX, False),
])
def test_selfcheck_warns_on_an_amx_machine_and_keeps_its_exit_code(monkeypatch, capsys, cpuinfo, system_info,
                                                                   warned):
    monkeypatch.setattr(repack, "_proc_cpuinfo", lambda: cpuinfo)
    monkeypatch.setattr(repack, "llama_system_info", lambda: system_info)
    assert main(["--db", "chdb://memory", "selfcheck", "--requests", "2"]) == 0
    captured = capsys.readouterr()
    assert "selfcheck passed" in captured.out
    warnings = [line for line in captured.err.splitlines() if "Intel AMX" in line]
    if warned:
        (line,) = warnings
        assert line.startswith("kvtrace: warning:") and "--no-repack" in line and "use_extra_bufts" in line
    else:
        assert warnings == []


# --- a user's own Llama(...): the AMX warning and KVTRACE_LLAMA_REPACK=off --------------------

USERS_SCRIPT = """
import sys
import kvtrace
from kvtrace.patches.llama_cpp import repack
repack._proc_cpuinfo = lambda: sys.argv[2]  # the CPU this story is told on
kvtrace.instrument(["llama_cpp"])
import llama_cpp
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=256, n_batch=64, n_ubatch=64, n_threads=1, n_threads_batch=1,
                      verbose=False)
print(int(llm.model_params.use_extra_bufts))
if not llm.model_params.use_extra_bufts:  # never decode a quantized model with the repack on: that is the crash
    print(llm.create_completion("the agent opens the file and", max_tokens=4, temperature=0.0)["choices"][0]["text"])
"""


@pytest.fixture(scope="module")
def tiny_q4_0(tmp_path_factory):
    from kvtrace.testmodels.llama_gguf import make_model

    return make_model(tmp_path_factory.mktemp("models") / "tiny-Q4_0.gguf", "Q4_0", "tiny")


def run_users_script(model, cpuinfo: str, repack_setting=None):
    env = {key: value for key, value in os.environ.items() if key != "KVTRACE_LLAMA_REPACK"}
    env["KVTRACE_EXPORTER"] = "none"
    if repack_setting is not None:
        env["KVTRACE_LLAMA_REPACK"] = repack_setting
    try:
        result = subprocess.run([sys.executable, "-c", USERS_SCRIPT, str(model), cpuinfo], capture_output=True,
                                text=True, timeout=120, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the user's script hung; {repack.amx_hint() or 'no AMX on this CPU'}")
    warnings = [line for line in result.stderr.splitlines() if "Intel AMX" in line]
    return result, warnings


def test_a_users_quantized_model_loaded_with_the_repack_on_an_amx_cpu_is_warned_about_before_its_decode(tiny_q4_0):
    result, warnings = run_users_script(tiny_q4_0, SAPPHIRE_RAPIDS)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["1"]  # the user's load, as llama.cpp's defaults make it
    (line,) = warnings
    assert "tiny-Q4_0.gguf is quantized (Q4_0)" in line
    assert "load_llama" in line and "KVTRACE_LLAMA_REPACK=off" in line


def test_the_same_model_on_a_cpu_without_amx_is_not_warned_about(tiny_q4_0):
    result, warnings = run_users_script(tiny_q4_0, EPYC)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["1"] and warnings == []


def test_kvtrace_llama_repack_off_lets_a_users_quantized_model_decode_on_an_amx_cpu(tiny_q4_0):
    """On this machine's CPU (an AMX Xeon) the same load with the repack on crashes in its first decode."""
    result, warnings = run_users_script(tiny_q4_0, SAPPHIRE_RAPIDS, repack_setting="off")
    assert result.returncode == 0, f"exit {result.returncode}: {result.stderr[-2000:]}; {repack.amx_hint()}"
    repack_flag, text = result.stdout.split("\n", 1)
    assert repack_flag == "0" and text.strip() and warnings == []


def test_kvtrace_llama_repack_off_loads_a_users_llama_without_the_repack_and_the_request_says_so(
        llama_patched, memory_recorder, tiny_gguf, finished_requests, monkeypatch, caplog):
    from kvtrace.patches.llama_cpp import model_load

    model_load.NOTICES.forget()
    monkeypatch.setattr(repack, "_proc_cpuinfo", lambda: SAPPHIRE_RAPIDS)
    monkeypatch.setenv("KVTRACE_LLAMA_REPACK", "off")
    with caplog.at_level("WARNING", logger="kvtrace"):
        llm = llama_cpp.Llama(model_path=str(tiny_gguf), n_ctx=256, n_batch=64, n_ubatch=64, n_threads=1,
                              n_threads_batch=1, verbose=False)
    try:
        assert llm.model_params.use_extra_bufts is False  # what llama.cpp's loader was handed
        llm.create_completion("the user's engine", max_tokens=2, temperature=0.0)
    finally:
        llm.close()
    ((attrs, _, _),) = finished_requests(memory_recorder)
    assert numerics_of(attrs)["weight_repack"] is False
    assert "Intel AMX" not in caplog.text


def test_an_f32_model_loaded_with_the_repack_on_an_amx_cpu_is_not_warned_about(llama_patched, memory_recorder,
                                                                               tiny_gguf, monkeypatch, caplog):
    from kvtrace.patches.llama_cpp import model_load

    model_load.NOTICES.forget()
    monkeypatch.setattr(repack, "_proc_cpuinfo", lambda: SAPPHIRE_RAPIDS)
    monkeypatch.delenv("KVTRACE_LLAMA_REPACK", raising=False)
    with caplog.at_level("WARNING", logger="kvtrace"):
        llm = llama_cpp.Llama(model_path=str(tiny_gguf), n_ctx=256, n_batch=64, n_ubatch=64, n_threads=1,
                              n_threads_batch=1, verbose=False)
    try:
        assert bool(llm.model_params.use_extra_bufts) is bool(llama_cpp.llama_model_default_params().use_extra_bufts)
    finally:
        llm.close()
    assert "Intel AMX" not in caplog.text


def test_load_llama_keeps_its_own_choice_whatever_the_variable_says(llama_patched, tiny_gguf, monkeypatch):
    monkeypatch.setenv("KVTRACE_LLAMA_REPACK", "off")
    llm = repack.load_llama(tiny_gguf, weight_repack=True, vocab_only=True)
    try:
        assert bool(llm.model_params.use_extra_bufts) is bool(llama_cpp.llama_model_default_params().use_extra_bufts)
    finally:
        llm.close()
