"""`kvtrace advise` on the real engine: a user with a quantized model asks which llama.cpp setting
makes prefix reuse harmless and what it costs.

On the tiny generated Q8_0 model with flash attention on, reuse forks against `off` (the experiment's
finding); a micro-batch of one token runs prefill through decode's kernels and forks nothing. advise
reports, for every setting it tried, a fork rate over distinct episodes with its interval and a speed
ratio against the baseline measured in the same run, and recommends the cheapest setting with no
fork — stating the interval's upper end, since 0 forks in n episodes bounds the rate, not zeroes it.
The weight repack on is tried in its own processes: where it crashes (an AMX CPU) that is a result.
Bad input costs one line and exit code 2, before any engine starts.
"""

from __future__ import annotations

import io
import json
import math

import pytest

pytest.importorskip("llama_cpp")

from kvtrace.advise.candidates import BASELINE, parse_candidates  # noqa: E402
from kvtrace.advise.report import print_advice  # noqa: E402
from kvtrace.cli import main  # noqa: E402
from kvtrace.experiment.plan import EngineSettings  # noqa: E402
from kvtrace.patches.llama_cpp.repack import amx_hint  # noqa: E402
from kvtrace.testmodels.llama_gguf import make_model  # noqa: E402

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
EPISODES = 12


def wilson_upper(forked: int, n: int, z: float = 1.959964) -> float:
    p = forked / n
    centre = p + z * z / (2 * n)
    spread = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return (centre + spread) / (1 + z * z / n)


@pytest.fixture(scope="session")
def q8_model(tmp_path_factory):
    """The tiny random-weight model in Q8_0, made once per test session."""
    return make_model(tmp_path_factory.mktemp("models") / "tiny-Q8_0.gguf", "Q8_0", "tiny")


def test_advise_reports_a_rate_and_a_speed_ratio_per_setting_and_recommends_the_cheapest_without_forks(
        q8_model, capsys, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "advice.png"
    code = main(["-q", "advise", "--model", str(q8_model), "--settings", "ub1,ub32,repack-on", "--arms", "off,reuse",
                 "--episodes", str(EPISODES), "--turns", "4", "--tokens", "16", "--seed", "1", "--speed-rounds", "2",
                 "--prompt-tokens", "96", "--decode-tokens", "8", "--pass-timeout", "60", "--json", "--plot", str(png)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    report = json.loads(captured.out)
    by_name = {s["name"]: s for s in report["settings"]}
    assert list(by_name) == [BASELINE, "ub1", "ub32", "repack-on"]
    assert report["weight_format"] == "Q8_0" and report["baseline"] == "b256.ub256.fa-on.kv-f16"

    for name in (BASELINE, "ub1", "ub32"):
        (reuse,) = by_name[name]["arms"]
        assert (reuse["arm"], reuse["n_episodes"], reuse["interval"]) == ("reuse", EPISODES, "wilson")
        assert reuse["ci95"][0] <= reuse["rate"] <= reuse["ci95"][1]
        cost = by_name[name]["cost"]
        assert all(ratio > 0 for ratio in [*cost["speed_ratio"].values(), *cost["request_time_ratio"].values()])
    assert by_name[BASELINE]["cost"]["request_time_ratio"] == {"wall": 1.0, "cpu": 1.0}
    assert by_name["ub1"]["speed_rounds"] == 2 and report["baseline_tokens_per_s"]["prefill_cpu"] > 0

    # The baseline forks with reuse; one-token micro-batches fork nothing.
    assert by_name[BASELINE]["arms"][0]["n_forked"] > 0 and not by_name[BASELINE]["zero_forks"]
    assert by_name["ub1"]["zero_forks"]
    # The recommendation: the setting without forks that costs least CPU time per request, its bound stated.
    clean = [s for s in report["settings"] if s["zero_forks"]]
    best = min(clean, key=lambda s: s["cost"]["request_time_ratio"]["cpu"])
    recommendation = report["recommendation"]
    assert recommendation["name"] == best["name"]
    assert recommendation["rate_upper_95"] == pytest.approx(wilson_upper(0, EPISODES), abs=1e-3)
    assert f"0/{EPISODES} forked with reuse" in recommendation["text"]
    assert f"at most {recommendation['rate_upper_95']:.1%} at 95 %" in recommendation["text"]

    # The repack on: where it crashes (AMX), that is this setting's result, not the command's failure.
    repack = by_name["repack-on"]
    if amx_hint():
        assert repack["crashed"] and "weight-repack on" in repack["crash_detail"]
    if repack["crashed"]:
        assert not repack["zero_forks"] and recommendation["name"] != "repack-on"
    else:
        assert repack["arms"][0]["n_episodes"] == EPISODES

    text = io.StringIO()
    print_advice(report, text)
    table = text.getvalue()
    for name, setting in by_name.items():
        assert f"{name}  " in table and setting["settings"] in table
    assert f"recommendation: {best['name']} ({best['settings']}): 0/{EPISODES} forked" in table
    assert png.read_bytes()[:8] == PNG_SIGNATURE


def exit_code(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # argparse refuses the value while parsing
        return exc.code


@pytest.mark.parametrize("arguments, message", [
    (["--model", "/nonexistent/model.gguf"], "argument --model: /nonexistent/model.gguf: No such file"),
    (["--settings", "ub1,turbo"], "'turbo' is not a setting change"),
    (["--settings", "ub0"], "'ub0': batch sizes are at least 1"),
    (["--settings", "ub1,b256.ub1"], "'b256.ub1' is not a setting change"),
    (["--settings", "ub512"], "n_ubatch 512 is larger than n_batch 256"),
    (["--settings", "ub1,ub1"], "'ub1' is the same engine setting as 'ub1'"),
    (["--settings", "fa-on"], "'fa-on' is the same engine setting as 'defaults'"),
    (["--settings", "kv-q8_0+fa-off"], "a q8_0 KV cache needs flash attention on"),
    (["--arms", "reuse,prompt-cache"], "give off and at least one cache arm"),
    (["--n-ubatch", "512"], "--n-ubatch 512 is larger than --n-batch 256"),
    (["--settings", ","], "give at least one setting to try"),
], ids=["missing-model", "unknown-change", "zero-batch", "unreadable-change", "ubatch-over-batch", "twice",
        "the-baseline", "q8-kv-without-fa", "no-off-arm", "baseline-ubatch-over-batch", "empty-list"])
def test_bad_input_gets_one_line_and_exit_code_2_before_any_engine_starts(arguments, message, q8_model, capsys,
                                                                          kvtrace_env):
    if "--model" not in arguments:
        arguments = ["--model", str(q8_model), *arguments]
    assert exit_code(["advise", *arguments]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    if "--model" not in message:  # argparse's own refusals add the usage line above theirs
        assert err.startswith("kvtrace: error: ") and len(err.strip().splitlines()) == 1
    assert not (kvtrace_env / "spool").exists()  # nothing ran


def test_a_file_that_is_not_a_gguf_model_is_refused(tmp_path, capsys, kvtrace_env):
    not_a_model = tmp_path / "notes.gguf"
    not_a_model.write_text("these are notes, not weights\n")
    assert main(["advise", "--model", str(not_a_model)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtrace: error: --model") and "not a GGUF model file" in err
    assert len(err.strip().splitlines()) == 1


def test_a_candidate_is_a_change_to_the_baseline():
    baseline = EngineSettings(256, 256, "on", "f16")
    found = parse_candidates(("ub32+kv-f32", "b64", "fa-flip", "repack-on"), baseline)
    assert [(c.name, c.settings.label) for c in found] == [
        (BASELINE, "b256.ub256.fa-on.kv-f16"), ("ub32+kv-f32", "b256.ub32.fa-on.kv-f32"),
        ("b64", "b64.ub64.fa-on.kv-f16"),  # a smaller logical batch takes the micro-batch down with it
        ("fa-off", "b256.ub256.fa-off.kv-f16"), ("repack-on", "b256.ub256.fa-on.kv-f16.repack-on")]
