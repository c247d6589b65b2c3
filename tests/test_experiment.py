"""The experiment harness on the real engine with the tiny generated model.

An agent's conversation keeps every generated token and grows by observations that depend on what
the model wrote; `off` repeats agree exactly and the report says so once, not as extra samples;
prefix reuse forks against `off` with every forked episode blamed on a cache event; the engine knobs
are dimensions of the grid (n_ubatch 1 makes every cache arm agree with `off`, a prompt cache of 0
bytes restores nothing); interleaved episodes make the prompt cache restore other episodes' states,
which plain reuse never does; the restore control is reported as a control; a seed fixes the results.

Q8_0 with flash attention is what forks here: with llama.cpp's weight repack off (how kvtrace loads
models), quantized matrix products decode and prefill alike on the CPUs these tests run on, while
flash attention takes a different path for one token than for a batch.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp")

from kvtrace import queries  # noqa: E402
from kvtrace import semconv as sc  # noqa: E402
from kvtrace.analysis.forks import diff_runs  # noqa: E402
from kvtrace.collectors.ingest import ingest_paths  # noqa: E402
from kvtrace.experiment import Plan, run_experiment  # noqa: E402
from kvtrace.experiment.models import generated_models  # noqa: E402
from kvtrace.experiment.report import build_report  # noqa: E402
from kvtrace.experiment.workload import episode_order, make_episodes  # noqa: E402

CACHE_EVENTS = {"kvtrace.cache.reuse", "kvtrace.cache.restore", "kvtrace.cache.lookup"}
SETTINGS = "b256.ub256.fa-on.kv-f16"
UBATCH_1 = "b256.ub1.fa-on.kv-f16"


@pytest.fixture
def experiment(llama_patched, spool_recorder, spool_dir, db):
    def run(**overrides):
        params = dict(formats=("Q8_0",), arms=("off", "reuse"), episodes=12, turns=4, tokens=16, seed=1,
                      flash_attn=("on",))
        params.update(overrides)
        plan = Plan(**params)
        outcome = run_experiment(plan, generated_models("tiny", plan.formats))
        spool_recorder.pipeline.force_flush()
        ingest_paths(db, [spool_dir])
        return plan, outcome, build_report(db, plan, outcome)

    return run


def against(report, arm_label):
    return [p for p in report["pairs"] if p["arm_a"] == arm_label]


def test_the_environment_answers_every_completion_deterministically_and_at_varying_length():
    assert [e.opening() for e in make_episodes(5, 1)] == [e.opening() for e in make_episodes(5, 1)]
    assert [e.opening() for e in make_episodes(5, 1)] != [e.opening() for e in make_episodes(5, 2)]
    assert episode_order(6, "shuffled", 1) == episode_order(6, "shuffled", 1) != list(range(6))
    episode, again = make_episodes(1, 0)[0], make_episodes(1, 0)[0]
    assert "calc(3 * 4) -> 12" in episode.observe("CALL calc(3 * 4)", 1)
    # A model that never emits a valid call still gets answers that depend on what it wrote.
    babble = [f"random words {i}" for i in range(20)]
    answers = [episode.observe(text, 2) for text in babble]
    assert answers == [again.observe(text, 2) for text in babble]
    assert all("no CALL found; ran " in a for a in answers)
    assert len(set(answers)) > 10 and len({len(a) for a in answers}) > 5
    other_episode = make_episodes(2, 0)[1]
    assert [other_episode.observe(text, 2) for text in babble] != answers


def test_every_generated_token_stays_in_the_conversation(make_llama, llama_patched, memory_recorder,
                                                         finished_requests):
    from kvtrace.experiment.conversation import TextConversation, TokenConversation

    llm = make_llama()
    opening = make_episodes(1, 0)[0].opening()
    tokens, text = TokenConversation(llm, opening), TextConversation(llm, opening)
    for turn in range(3):
        prompt = tokens.prompt()
        output = llm.create_completion(prompt, max_tokens=12, temperature=0.0)
        tokens.add_turn(prompt, output, f"\nObservation {turn}: ok\nAgent:")
        text.add_turn(text.prompt(), output, f"\nObservation {turn}: ok\nAgent:")
        (recorded, _, _) = finished_requests(memory_recorder)[-1]
        generated = list(recorded[sc.OUTPUT_TOKEN_IDS])
        assert len(generated) == 12
        # tokens: prompt + every generated id (the last one too) + the observation's tokens
        assert tokens.prompt()[:len(prompt) + 12] == prompt + generated
        # text: the whole completion is in the transcript sent next turn
        assert output["choices"][0]["text"] + f"\nObservation {turn}: ok\nAgent:" in text.text


def test_off_repeats_are_identical_and_count_once(experiment, db):
    plan, outcome, report = experiment(arms=("off", "reuse"), repeats=2, orders=("canonical", "shuffled"),
                                       episodes=6, turns=3)
    # Every request the passes answered is stored with its episode: the repeats are compared on those.
    columns, found = queries.run(db, "runs")
    runs = [dict(zip(columns, row)) for row in found if row[0].startswith(plan.prefix + "/")]
    assert sum(r["requests"] for r in runs) == outcome.requests and {r["episodes"] for r in runs} == {6}, runs
    (off,) = [r for r in report["repeat_agreement"] if r["arm"] == "off"]
    assert (off["runs"], off["n_episodes"], off["n_forked"]) == (4, 6, 0)
    (reuse,) = against(report, "reuse")
    assert (reuse["runs"], reuse["compared_runs"], reuse["n_episodes"]) == (4, 4, 6)
    # An order that changes no trajectory adds no sample: then each episode is one yes/no (Wilson).
    assert reuse["samples"] >= 6 and (reuse["interval"] == "wilson") == (reuse["samples"] == 6)
    assert outcome.requests == 8 * 6 * 3


def test_reuse_forks_against_off_and_each_forked_episode_has_a_culprit_cache_event(experiment, db):
    plan, _, report = experiment()
    (cross,) = against(report, "reuse")
    assert cross["n_forked"] > 0, "this seed forks with prefix reuse on the tiny Q8_0 model"
    assert (cross["n_episodes"], cross["interval"]) == (12, "wilson")
    assert cross["ci95"][0] <= cross["rate"] <= cross["ci95"][1]
    assert cross["mean_cached_tokens"] > 0
    diff = diff_runs(db, plan.run_id(plan.key("Q8_0", "reuse")), plan.run_id(plan.key("Q8_0", "off")))
    assert len(diff.forks) == cross["n_forked"]
    for fork in diff.forks:
        assert fork.attribution == "hit_vs_recompute"
        assert fork.culprit is not None and fork.culprit.event in CACHE_EVENTS
    assert report["attribution"] == {f"Q8_0/{SETTINGS}/reuse": {"forked_episodes": cross["n_forked"],
                                                              "labels": {"hit_vs_recompute": cross["n_forked"]}}}


def test_engine_knobs_are_dimensions_of_the_grid(experiment, db):
    plan, _, report = experiment(arms=("off", "reuse", "prompt-cache"), n_ubatch=(256, 1), cache_ram=(0, 1 << 30),
                                 episodes=8, turns=3)
    runs = {r["run_id"] for r in report["runs"]}
    assert f"{plan.prefix}/Q8_0/{UBATCH_1}/prompt-cache-1GiB/r0/canonical" in runs
    assert len(runs) == 2 * (2 + 2)  # per n_ubatch: off, reuse and the prompt cache at two sizes
    rows = {(p["settings"], p["arm_a"]): p for p in report["pairs"]}
    assert set(rows) == {(s, a) for s in (SETTINGS, UBATCH_1)
                         for a in ("reuse", "prompt-cache-0", "prompt-cache-1GiB")}
    # A micro-batch of one token: prefill and decode use the same kernels, so caching changes nothing.
    for arm in ("reuse", "prompt-cache-0", "prompt-cache-1GiB"):
        assert rows[(UBATCH_1, arm)]["n_forked"] == 0
    # A prompt cache that holds nothing restores nothing: the arm recomputes like `off`.
    assert rows[(SETTINGS, "prompt-cache-0")]["mean_cached_tokens"] == 0
    assert rows[(SETTINGS, "prompt-cache-0")]["n_forked"] == 0
    assert rows[(SETTINGS, "prompt-cache-1GiB")]["mean_cached_tokens"] > 0
    columns, found = queries.run(db, "runs")
    assert len([r for r in found if r[0].startswith(plan.prefix + "/")]) == len(runs)


def test_interleaved_episodes_make_the_prompt_cache_restore_other_episodes_state(experiment, db):
    plan, _, report = experiment(arms=("off", "reuse", "prompt-cache"), schedule="interleaved", episodes=6, turns=3)
    rows = {p["arm_a"]: p for p in report["pairs"]}
    # In-context reuse holds only the previous request, another episode's: no more than the shared
    # system prompt is reused. The prompt cache keeps every episode's last state and restores it.
    assert rows["prompt-cache-1GiB"]["mean_cached_tokens"] > rows["reuse"]["mean_cached_tokens"]
    cache_run, reuse_run = plan.run_id(plan.key("Q8_0", "prompt-cache")), plan.run_id(plan.key("Q8_0", "reuse"))
    sources = []
    for episode in make_episodes(plan.episodes, plan.seed):
        columns, found = queries.run(db, "episode_timeline", {"run_a": cache_run, "run_b": reuse_run,
                                                              "episode": episode.episode_id})
        sources += [(episode.episode_id, row["source_episode_id"]) for row in (dict(zip(columns, r)) for r in found)
                    if row["run_id"] == cache_run and row["reused_tokens"] > 0]
    # Turn 0 restores another episode's state (they share the system prompt); later turns their own.
    assert any(source != episode for episode, source in sources)
    assert any(source == episode for episode, source in sources)


def test_the_restore_control_is_a_control_not_an_arm_and_the_disk_cache_an_arm(experiment):
    scratch = set(Path(tempfile.gettempdir()).glob("kvtrace-disk-cache-*"))
    _, outcome, report = experiment(arms=("off", "restore", "disk-cache"), episodes=4, turns=3)
    assert report["control"] == {"arm": "restore-replay", "checked": 12, "reproduced": 12, "mismatches": []}
    assert {p["arm_a"] for p in report["pairs"]} == {"restore", "disk-cache-1GiB"}
    assert all(r["arm"] != "restore-replay" for r in report["repeat_agreement"])
    # The disk cache restored stored states, and its directory went with its pass.
    assert {p["arm_a"]: p for p in report["pairs"]}["disk-cache-1GiB"]["mean_cached_tokens"] > 0
    assert set(Path(tempfile.gettempdir()).glob("kvtrace-disk-cache-*")) <= scratch


def test_same_seed_gives_the_same_results(experiment):
    def comparable(report):
        return json.dumps([{k: v for k, v in p.items() if k not in ("runs", "compared_runs")} for p in report["pairs"]],
                          sort_keys=True)

    _, _, first = experiment(prefix="first", episodes=6, turns=3)
    _, _, second = experiment(prefix="second", episodes=6, turns=3)
    assert comparable(first) == comparable(second)
    assert first["attribution"] == second["attribution"]


def test_the_prompt_cache_counts_every_byte_of_the_states_it_holds(make_llama):
    from kvtrace.experiment.caches import BoundedRAMCache, state_bytes

    llm = make_llama()
    llm.create_completion(llm.tokenize(b"episode 9 says"), max_tokens=4, temperature=0.0)
    one_state = state_bytes(llm.save_state())  # what each request below stores
    cache = BoundedRAMCache(capacity_bytes=int(2.5 * one_state))
    llm.set_cache(cache)
    for i in range(5):
        llm.reset()
        llm.create_completion(llm.tokenize(f"episode {i} says".encode()), max_tokens=4, temperature=0.0)
    assert len(cache.cache_state) == 2 and cache.cache_size <= cache.capacity_bytes
    # llama-cpp-python's own count leaves out the logits copy each state carries.
    assert sum(s.llama_state_size for s in cache.cache_state.values()) < cache.cache_size / 2


@pytest.mark.parametrize("arguments, message", [
    (["--batch", "4"], "--batch is for --engine vllm; llama.cpp serves one request at a time"),
    (["--engine", "vllm", "--batch", "0"], "argument --batch: '0': give 1, turn or a number of requests"),
    (["--engine", "vllm", "--batch", "1,all"], "argument --batch: 'all': give 1, turn or a number of requests"),
], ids=["llama", "zero", "unknown"])
def test_a_bad_batch_is_refused_in_one_line_before_any_engine_starts(arguments, message, capsys, kvtrace_env):
    from kvtrace.cli import main

    try:
        code = main(["experiment", "--generate", "tiny", *arguments])
    except SystemExit as exc:  # argparse refuses the value while parsing
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err
    assert not (kvtrace_env / "spool").exists()  # nothing ran
