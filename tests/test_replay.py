"""`kvtrace replay` on the real engine with a generated quantized model.

A user ran the experiment's `reuse`, `prompt-cache` and `off` arms (Q8_0, flash attention on: the
setting that forks here, see test_experiment.py) with token ids captured. Re-executing every episode
of any of these runs on its recorded cache paths (in-context reuse, prompt-cache restores, recompute)
gives back every recorded token: the "40/40" control. Where `diff` blamed a
fork on the cache hit (`hit_vs_recompute`), switching only the cache path between the two sides
moves the fork token to the other side's: `confirmed`, and `diff` says so next to the label.

A fork that something else made — a logit bias one side applied, which the record holds only as
"a logits processor was used" — does not reproduce from what was recorded: `not_reproduced`.

Without `--model`, replay finds the recorded model in kvtrace's model cache by its fingerprint: a user
who ran `kvtrace experiment --model BASE.gguf --formats Q8_0` replays the run on the Q8_0 file the
experiment quantized, even where another base model's `Q8_0.gguf` sits next to it.

Replay refuses what it cannot re-execute faithfully, each with one line and exit 2: another model
file than the recorded one, a model the cache does not hold (naming its fingerprint, file name and
the folder searched), a run recorded with hashed token ids, a run or episode that does not exist.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

pytest.importorskip("llama_cpp")

from kvtrace import correlate  # noqa: E402
from kvtrace import semconv as sc  # noqa: E402
from kvtrace.cli import main  # noqa: E402
from kvtrace.experiment import Plan, run_experiment  # noqa: E402
from kvtrace.experiment.models import generated_models, model_cache_dir  # noqa: E402
from kvtrace.patches.llama_cpp.config import static_config  # noqa: E402
from kvtrace.replay.model_lookup import find_model, fingerprints_file  # noqa: E402
from kvtrace.testmodels.llama_gguf import make_model  # noqa: E402
from readme_commands import readme_kvtrace_args  # noqa: E402

EPISODES, TURNS, TOKENS = 6, 3, 16


@pytest.fixture
def three_arms(llama_patched, spool_recorder):
    """The experiment's reuse, prompt-cache and off arms, recorded through the spool (ingested by the first
    command)."""
    arms = ("reuse", "prompt-cache", "off")
    plan = Plan(formats=("Q8_0",), arms=arms, episodes=EPISODES, turns=TURNS, tokens=TOKENS, seed=1,
                flash_attn=("on",))
    outcome = run_experiment(plan, generated_models("tiny", plan.formats))
    assert outcome.failure is None and outcome.requests == len(arms) * EPISODES * TURNS
    return [plan.run_id(plan.key("Q8_0", arm)) for arm in arms]


def kvtrace_json(capsys, *argv: str):
    code = main(["-q", *argv, "--format", "json"])
    captured = capsys.readouterr()
    return code, json.loads(captured.out) if captured.out else None, captured.err


def refusal(capsys, *argv: str) -> str:
    assert main(["-q", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err
    return err


@pytest.mark.slow
def test_every_episode_replays_exactly_and_the_cache_hit_forks_are_confirmed(three_arms, capsys):
    reuse, prompt_cache, off = three_arms
    episodes = [f"e{i:03d}" for i in range(EPISODES)]
    every_episode = [arg for e in episodes for arg in ("--episode", e)]
    paths = {}
    for run in (reuse, prompt_cache, off):
        code, replayed, _ = kvtrace_json(capsys, "replay", run, *every_episode)
        assert code == 0
        assert replayed["exact"] is True
        assert (replayed["requests_reproduced"], replayed["requests"]) == (EPISODES * TURNS, EPISODES * TURNS)
        assert (replayed["tokens_reproduced"], replayed["tokens"]) == (EPISODES * TURNS * TOKENS,) * 2
        # The cost is printed against the recording's (the engine's own time on each request, from its span).
        assert all(replayed[key] for key in ("seconds", "recorded_seconds"))
        paths[run] = {r["path"].split(" of ")[0] for r in replayed["per_request"]}
    # Each run's requests really were re-executed on their own cache paths.
    assert paths == {reuse: {"recompute", "in-context reuse"}, prompt_cache: {"recompute", "prompt-cache restore"},
                     off: {"recompute"}}

    code, forks, _ = kvtrace_json(capsys, "diff", reuse, off)
    cache_forks = [f for f in forks if f["attribution"] == sc.ATTRIBUTION_HIT_VS_RECOMPUTE]
    assert cache_forks, "this seed forks with prefix reuse on the tiny Q8_0 model (see test_experiment.py)"
    fork = cache_forks[0]
    counterfactual = readme_kvtrace_args("kvtrace replay RUN_A RUN_B --episode EPISODE --counterfactual",
                                         {"RUN_A": reuse, "RUN_B": off, "EPISODE": fork["episode"]})
    code, verdict, _ = kvtrace_json(capsys, *counterfactual)
    assert code == 0
    assert verdict["verdict"] == sc.VERDICT_CONFIRMED
    recorded_a, recorded_b = verdict["recorded"]
    assert (recorded_a, recorded_b) == (fork["a"]["token"], fork["b"]["token"])
    assert verdict["own_path"] == [recorded_a, recorded_b]
    assert verdict["switched_path"] == [recorded_b, recorded_a]

    # diff now shows the verdict next to the label, in JSON and in text.
    code, forks, _ = kvtrace_json(capsys, "diff", reuse, off, "--episode", fork["episode"])
    assert forks[0]["verdict"] == sc.VERDICT_CONFIRMED
    assert main(["-q", "diff", reuse, off, "--episode", fork["episode"]]) == 0
    assert "[hit_vs_recompute, counterfactual: confirmed]" in capsys.readouterr().out


@pytest.fixture
def biased_fork(llama_patched, spool_recorder, make_llama):
    """Two runs of one episode, every request recomputed; at turn 1 run B's request carries a logit bias
    that makes the runner-up win at the first generated token."""
    llm = make_llama()
    prompt = llm.tokenize(b"Episode 0: the agent opens the file and")
    for run in ("plain", "biased"):
        tokens = list(prompt)
        for turn in range(2):
            llm.reset()
            bias = None
            if run == "biased" and turn == 1:
                llm.create_completion(tokens, max_tokens=1, temperature=0.0)  # unrecorded: no correlation
                logits = np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(llm.n_vocab(),))
                runner_up = int(np.argsort(logits)[-2])
                bias = {runner_up: 100.0}
                llm.reset()
            with correlate(run_id=run, episode_id="e0", turn=turn):
                out = llm.create_completion(tokens, max_tokens=8, temperature=0.0, logit_bias=bias)
            tokens = tokens + llm.tokenize(out["choices"][0]["text"].encode(), add_bos=False) \
                + llm.tokenize(f" obs {turn}.".encode(), add_bos=False)
    spool_recorder.pipeline.force_flush()
    return llm.model_path


@pytest.mark.slow
def test_a_fork_made_by_an_unrecorded_logit_bias_is_not_reproduced(biased_fork, capsys):
    code, forks, _ = kvtrace_json(capsys, "diff", "plain", "biased")
    (fork,) = forks
    assert (fork["turn"], fork["position"], fork["attribution"]) == (1, 0, sc.ATTRIBUTION_SAME_CACHE_PATH)
    code, verdict, _ = kvtrace_json(capsys, "replay", "plain", "biased", "--episode", "e0", "--counterfactual",
                                    "--model", biased_fork)
    assert code == 0
    assert verdict["verdict"] == sc.VERDICT_NOT_REPRODUCED
    assert "something the spans do not record differs" in verdict["explanation"]
    assert "logits_processor" in verdict["explanation"]
    # Without the bias the biased side chooses what the plain side chose.
    assert verdict["own_path"] == [fork["a"]["token"], fork["a"]["token"]]


@pytest.mark.slow
def test_replay_refuses_another_model_file_hashed_capture_and_unknown_names(biased_fork, capsys, spool_dir,
                                                                              monkeypatch, make_llama, tmp_path):
    from kvtrace.config import Settings
    from kvtrace.recording.exporters.spool import SpoolExporter
    from kvtrace.recording.recorder import Recorder, set_recorder

    other = make_model(tmp_path / "tiny-Q8_0.gguf", "Q8_0", "tiny")
    err = refusal(capsys, "replay", "plain", "--episode", "e0", "--model", str(other))
    assert "model fingerprint" in err and "replay needs the same model file" in err

    monkeypatch.setenv("KVTRACE_CAPTURE", "hashed")
    recorder = Recorder(Settings.from_env(), exporter=SpoolExporter(spool_dir))
    previous = set_recorder(recorder)
    try:
        llm = make_llama()
        with correlate(run_id="private", episode_id="e0", turn=0):
            llm.create_completion(llm.tokenize(b"a private prompt"), max_tokens=4, temperature=0.0)
    finally:
        set_recorder(previous)
        recorder.shutdown()
    err = refusal(capsys, "replay", "private", "--episode", "e0", "--model", biased_fork)
    assert "hashed capture" in err and "KVTRACE_CAPTURE=ids" in err

    assert "no run 'nowhere'" in refusal(capsys, "replay", "nowhere", "--episode", "e0")
    assert "has no episode 'e7'" in refusal(capsys, "replay", "plain", "--episode", "e7", "--model", biased_fork)


def fingerprint_of(make_llama, model) -> str:
    """The fingerprint an engine on ``model`` records (a full load, as the recorded engine did)."""
    return static_config(make_llama(model_path=str(model)))[sc.MODEL_FINGERPRINT]


@pytest.mark.slow
def test_a_run_on_a_model_the_experiment_quantized_replays_without_model(tiny_gguf, make_llama, capsys):
    # Another base model's Q8_0.gguf, read first: the same file name, other weights.
    decoy = make_model(model_cache_dir() / "another-base-0123456789ab" / "Q8_0.gguf", "Q8_0", "tiny", seed=2)
    assert main(["-q", "experiment", "--model", str(tiny_gguf), "--formats", "Q8_0", "--arms", "off",
                 "--episodes", "1", "--turns", "2", "--tokens", "8", "--prefix", "user", "--format", "json"]) == 0
    (run,) = {r["run_id"] for r in json.loads(capsys.readouterr().out)["runs"]}
    (quantized,) = model_cache_dir().glob(f"{tiny_gguf.stem}-*/Q8_0.gguf")

    code, replayed, err = kvtrace_json(capsys, "replay", run, "--episode", "e000")
    assert code == 0, err
    assert replayed["exact"] is True
    assert (replayed["requests_reproduced"], replayed["requests"]) == (2, 2)
    assert replayed["tokens_reproduced"] == replayed["tokens"] > 0
    # Found by its fingerprint, which the search keeps for the next replay; the decoy was read and is kept too.
    kept = json.loads(fingerprints_file().read_text())
    assert kept[str(quantized)]["fingerprint"] == fingerprint_of(make_llama, quantized)
    assert kept[str(decoy)]["fingerprint"] == fingerprint_of(make_llama, decoy) != kept[str(quantized)]["fingerprint"]


@pytest.mark.slow
def test_a_run_whose_model_is_not_in_the_model_cache_is_refused_naming_fingerprint_file_and_folder(
        biased_fork, make_llama, capsys):
    recorded = fingerprint_of(make_llama, biased_fork)
    # The cache holds a file of the recorded name with other weights, and a file llama.cpp cannot read.
    make_model(model_cache_dir() / "elsewhere" / "tiny-F32.gguf", "F32", "tiny", seed=2)
    (model_cache_dir() / "garbage.gguf").write_bytes(b"GGUF and then nothing a model has")
    err = refusal(capsys, "replay", "plain", "--episode", "e0")
    assert f"recorded the model 'tiny-F32.gguf' with fingerprint {recorded}" in err
    assert f"({model_cache_dir()}: 2 looked at)" in err and "give the file with --model PATH.gguf" in err
    # Asked again, the fingerprints kept from the first search (the unreadable file's too) say the same.
    assert refusal(capsys, "replay", "plain", "--episode", "e0") == err


@pytest.mark.slow
def test_kept_fingerprints_count_while_the_file_keeps_its_size_and_mtime(tiny_gguf, make_llama):
    folder = model_cache_dir()
    model = folder / "base-0123456789ab" / "F32.gguf"
    model.parent.mkdir(parents=True)
    model.write_bytes(tiny_gguf.read_bytes())
    recorded = fingerprint_of(make_llama, tiny_gguf)  # the path is not part of it
    assert find_model(recorded, "tiny-F32.gguf", folder) == (model, 1)

    kept = json.loads(fingerprints_file().read_text())
    assert kept[str(model)]["fingerprint"] == recorded
    kept[str(model)]["fingerprint"] = "kept-earlier"
    fingerprints_file().write_text(json.dumps(kept))
    assert find_model("kept-earlier", "F32.gguf", folder) == (model, 1)  # trusted: the file is unchanged

    stat = model.stat()
    os.utime(model, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert find_model("kept-earlier", "F32.gguf", folder) == (None, 1)  # the file changed: read again
    assert json.loads(fingerprints_file().read_text())[str(model)]["fingerprint"] == recorded

    fingerprints_file().write_text("{cut short")  # a kept file the disk filled up: read again
    assert find_model(recorded, "F32.gguf", folder) == (model, 1)
