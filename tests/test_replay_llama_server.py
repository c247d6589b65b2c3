"""`kvtrace replay --server` on a conversation recorded through `kvtrace proxy` in front of llama-server.

An operator serves the tiny model at Q8_0 with llama-server (flash attention on) and records
through the proxy (ids captured, the server's log read). Two arms of the same episode: in `reuse`
every later turn continues from the slot's own state, in `recompute` every turn recomputes its
prompt (`cache_prompt: false`). Re-sent to the server as token-id prompts on their recorded paths,
every turn of either arm gives back every recorded token, with the recorded reused count. The arms
fork at turn 2 (`hit_vs_recompute`); switching only the cache path at the fork moves the fork token
to the other side's: `confirmed`, which `kvtrace diff` then shows.

Replay refuses what it cannot re-execute, one line each: a llama-server run without --server, a
server that does not answer (exit 1) or serves another model (exit 2), a run recorded with hashed
ids, an unknown episode; nothing is kept then.
"""

from __future__ import annotations

import json

import pytest

from kvtrace import semconv as sc
from kvtrace.cli import main
from kvtrace.replay import verdicts
from kvtrace.testmodels.llama_gguf import make_model
from llama_server_process import free_port, llama_server_binary, running_llama_server, running_proxy
import this_cpu

httpx = pytest.importorskip("httpx")
pytest.importorskip("h11")

TURNS, TOKENS = 4, 12


MEASURED_HERE = "avx2" in this_cpu.flags() and "avx512f" not in this_cpu.flags()
"""The arms' fork was measured on AVX2 without AVX-512 (llama.cpp's AVX2 kernels): there it must appear."""
PROMPT = "Episode 5: the agent opens the kitchen drawer and"
ARMS_SETTINGS = ("-fa", "on", "-lv", "4", "--cache-ram", "0")
"""The arms' server: flash attention on, where a reused prefix's logits differ from a recomputed one's (the
quantized tiny model forks at turn 2 with this prompt); without a prompt cache the slot's own state is the only
one a request can reuse, when recorded and replayed."""


def record_arm(proxy: str, run: str, reuse: bool, biased_turn: int = -1) -> None:
    """One episode of TURNS turns; each turn's prompt is the last one, its answer and an observation.
    At ``biased_turn`` a logit bias (which the record does not keep) makes the runner-up win first."""
    prompt = PROMPT
    for turn in range(TURNS):
        baggage = f"kvtrace.run_id={run},kvtrace.episode_id=e0,kvtrace.turn={turn}"
        # The first turn starts afresh in either arm: the slot holds the other arm's conversation.
        body = {"prompt": prompt, "n_predict": TOKENS, "temperature": 0, "cache_prompt": reuse and turn > 0}
        if turn == biased_turn:
            body["logit_bias"] = [[runner_up(proxy, prompt), 100.0]]
        answer = httpx.post(proxy + "/completion", json=body, headers={"baggage": baggage}, timeout=120)
        assert answer.status_code == 200
        prompt += answer.json()["content"] + f" Observation {turn}: the drawer"


def runner_up(proxy: str, prompt: str) -> int:
    """The second most likely first token after ``prompt`` (asked without correlation: the proxy's own run)."""
    answer = httpx.post(proxy + "/completion", json={"prompt": prompt, "n_predict": 1, "temperature": 0,
                                                     "cache_prompt": False, "n_probs": 2}, timeout=120).json()
    return answer["completion_probabilities"][0]["top_logprobs"][1]["id"]


@pytest.fixture(scope="module")
def tiny_q8_gguf(tmp_path_factory):
    """The tiny model at Q8_0: its reused and recomputed prefixes differ in the last bits, as F32's need not."""
    pytest.importorskip("llama_cpp")  # llama.cpp's own quantizer
    return make_model(tmp_path_factory.mktemp("models") / "tiny-Q8_0.gguf", "Q8_0", "tiny")


@pytest.fixture
def recorded_arms(tiny_q8_gguf, tmp_path, spool_recorder):
    """The reuse and recompute arms recorded through the proxy; yields the server, still running."""
    llama_server_binary()
    log_path = tmp_path / "server.log"
    with running_llama_server(tiny_q8_gguf, *ARMS_SETTINGS, log_path=log_path) as server:
        with running_proxy(server, spool_recorder, llama_server_log=log_path) as proxy:
            record_arm(proxy, "reuse", reuse=True)
            record_arm(proxy, "recompute", reuse=False)
        spool_recorder.pipeline.force_flush()
        yield server


def kvtrace_json(capsys, *argv: str):
    code = main(["-q", *argv, "--format", "json"])
    captured = capsys.readouterr()
    return code, json.loads(captured.out) if captured.out else None, captured.err


def refusal(capsys, code: int, *argv: str) -> str:
    assert main(["-q", *argv]) == code
    err = capsys.readouterr().err.strip()
    assert err and err.count("\n") == 0 and "Traceback" not in err
    return err


@pytest.mark.slow
def test_each_arm_replays_exactly_on_the_server_and_the_counterfactual_confirms_the_fork(recorded_arms, capsys):
    server = recorded_arms
    paths = {}
    for run in ("reuse", "recompute"):
        code, replayed, err = kvtrace_json(capsys, "replay", run, "--episode", "e0", "--server", server)
        assert code == 0, (err, replayed)
        assert replayed["exact"] is True
        assert (replayed["requests_reproduced"], replayed["requests"]) == (TURNS, TURNS)
        assert replayed["tokens_reproduced"] == replayed["tokens"] == TURNS * TOKENS
        paths[run] = [r["path"].split(" of ")[0] for r in replayed["per_request"]]
    # Each arm's turns really ran on their recorded paths: the reuse arm's later turns on the slot's state.
    assert paths == {"reuse": ["recompute"] + ["in-context reuse"] * (TURNS - 1), "recompute": ["recompute"] * TURNS}
    # Each side's cache path says how llama-server chose its slot, as the server's log said it.
    assert main(["-q", "diff", "reuse", "recompute", "--episode", "e0", "--turns", "1,1"]) == 0
    out = capsys.readouterr().out
    assert out.count("; slot chosen ") == 2

    code, forks, _ = kvtrace_json(capsys, "diff", "reuse", "recompute", "--episode", "e0")
    assert code == 0
    if not forks:
        # Measured on AVX2 without AVX-512: other CPUs run other kernels and may fork elsewhere or nowhere.
        assert not MEASURED_HERE, "this prompt forks with prefix reuse on the tiny Q8_0 model, flash attention on"
        assert main(["-q", "replay", "reuse", "recompute", "--episode", "e0", "--counterfactual",
                     "--server", server]) == 2
        assert "did not fork" in capsys.readouterr().err
        return
    fork = forks[0]
    assert fork["attribution"] == sc.ATTRIBUTION_HIT_VS_RECOMPUTE
    assert fork["turn"] == 2 or not MEASURED_HERE
    code, verdict, err = kvtrace_json(capsys, "replay", "reuse", "recompute", "--episode", "e0", "--counterfactual",
                                      "--server", server)
    assert code == 0, err
    recorded_a, recorded_b = verdict["recorded"]
    assert (recorded_a, recorded_b) == (fork["a"]["token"], fork["b"]["token"])
    assert verdict["own_path"] == [recorded_a, recorded_b]  # the fork reproduces on its recorded paths
    # Switching only the cache path moves the fork token to the other side's: the cache path made the fork.
    assert verdict["switched_path"] == [recorded_b, recorded_a]
    assert verdict["verdict"] == sc.VERDICT_CONFIRMED
    code, forks, _ = kvtrace_json(capsys, "diff", "reuse", "recompute", "--episode", "e0")
    assert forks[0]["verdict"] == sc.VERDICT_CONFIRMED


@pytest.mark.slow
def test_a_prompt_cache_restore_replays_as_the_state_of_the_request_that_stored_it(tiny_gguf, tmp_path,
                                                                                   spool_recorder, capsys):
    """Two conversations take turns on one slot of a server with a prompt cache: the kitchen's second turn
    is served from its first turn's state, restored from the cache. Replayed on a server without one, that
    state is rebuilt on the slot by running the first turn again, and every token comes back."""
    log_path = tmp_path / "server.log"
    with running_llama_server(tiny_gguf, "-lv", "4", "--cache-ram", "64", log_path=log_path) as server:
        with running_proxy(server, spool_recorder, llama_server_log=log_path) as proxy:
            prompts = {"kitchen": "The kitchen has a long oak table and",
                       "harbour": "Zulu harbour boats rocked under grey skies while"}
            for episode, turn in (("kitchen", 0), ("harbour", 0), ("kitchen", 1)):
                baggage = f"kvtrace.run_id=shared,kvtrace.episode_id={episode},kvtrace.turn={turn}"
                answer = httpx.post(proxy + "/completion", json={"prompt": prompts[episode], "n_predict": TOKENS,
                                                                 "temperature": 0}, headers={"baggage": baggage},
                                    timeout=120)
                prompts[episode] += answer.json()["content"] + " Next, the pantry holds"
        spool_recorder.pipeline.force_flush()
    with running_llama_server(tiny_gguf, "--cache-ram", "0", log_path=tmp_path / "replay.log") as replaying:
        code, replayed, err = kvtrace_json(capsys, "replay", "shared", "--episode", "kitchen", "--server", replaying)
    assert code == 0, err
    assert replayed["exact"] is True
    assert (replayed["requests_reproduced"], replayed["requests"]) == (2, 2)
    restored = replayed["per_request"][1]
    assert restored["turn"] == 1 and restored["path"].startswith("prompt-cache restore of ")
    assert restored["path_reproduced"] is True  # the slot reused as many tokens as the restore gave


@pytest.mark.slow
def test_a_fork_made_by_an_unrecorded_logit_bias_is_not_reproduced_on_the_server(tiny_gguf, tmp_path,
                                                                                 spool_recorder, capsys):
    log_path = tmp_path / "server.log"
    with running_llama_server(tiny_gguf, "-lv", "4", "--cache-ram", "0", log_path=log_path) as server:
        with running_proxy(server, spool_recorder, llama_server_log=log_path) as proxy:
            record_arm(proxy, "reuse", reuse=True)
            record_arm(proxy, "biased", reuse=False, biased_turn=2)
        spool_recorder.pipeline.force_flush()

        code, forks, _ = kvtrace_json(capsys, "diff", "reuse", "biased", "--episode", "e0")
        fork = forks[0]
        assert (fork["turn"], fork["position"], fork["attribution"]) == (2, 0, sc.ATTRIBUTION_HIT_VS_RECOMPUTE)
        code, verdict, err = kvtrace_json(capsys, "replay", "reuse", "biased", "--episode", "e0", "--counterfactual",
                                          "--server", server)
    assert code == 0, err
    assert verdict["verdict"] == sc.VERDICT_NOT_REPRODUCED
    assert "something the spans do not record differs" in verdict["explanation"]
    # Re-sent without the bias, the biased side's request chooses what the other side chose, on either path.
    assert verdict["own_path"] == [fork["a"]["token"], fork["a"]["token"]]
    assert verdict["switched_path"] == [fork["a"]["token"], fork["a"]["token"]]
    code, forks, _ = kvtrace_json(capsys, "diff", "reuse", "biased", "--episode", "e0")
    assert forks[0]["verdict"] == sc.VERDICT_NOT_REPRODUCED


@pytest.mark.slow
def test_replay_refuses_a_missing_or_other_server_hashed_ids_and_an_unknown_episode(
        recorded_arms, tiny_q8_gguf, tmp_path, capsys, monkeypatch, spool_dir):
    from kvtrace.config import Settings
    from kvtrace.recording.exporters.spool import SpoolExporter
    from kvtrace.recording.recorder import Recorder

    server = recorded_arms
    err = refusal(capsys, 2, "replay", "reuse", "--episode", "e0")
    assert "recorded in front of llama-server" in err and "--server URL" in err

    nobody = f"http://127.0.0.1:{free_port()}"
    err = refusal(capsys, 1, "replay", "reuse", "--episode", "e0", "--server", nobody)
    assert f"no llama-server answers at {nobody}" in err

    assert "has no episode 'e7'" in refusal(capsys, 2, "replay", "reuse", "--episode", "e7", "--server", server)

    monkeypatch.setenv("KVTRACE_CAPTURE", "hashed")
    hashed = Recorder(Settings.from_env(), exporter=SpoolExporter(spool_dir))
    try:
        log_path = tmp_path / "private.log"
        with running_llama_server(tiny_q8_gguf, *ARMS_SETTINGS, log_path=log_path) as private:
            with running_proxy(private, hashed, llama_server_log=log_path) as proxy:
                record_arm(proxy, "private", reuse=True)
    finally:
        hashed.shutdown()
    err = refusal(capsys, 2, "replay", "private", "--episode", "e0", "--server", server)
    assert "hashed capture" in err and "KVTRACE_CAPTURE=ids" in err

    other = make_model(tmp_path / "other-F32.gguf", "F32", "tiny", seed=2)
    with running_llama_server(other, "--cache-ram", "0", log_path=tmp_path / "other.log") as elsewhere:
        err = refusal(capsys, 2, "replay", "reuse", "--episode", "e0", "--server", elsewhere)
    assert "differs from the recorded one in model (tiny-Q8_0.gguf vs other-F32.gguf)" in err
    assert not verdicts.verdicts_file().exists()
