"""Real forks from llama.cpp: the same multi-turn episodes, greedy, run three ways on one
quantized tiny model — in-context prefix reuse, cache off (``reset()`` before every call), and a
``LlamaRAMCache`` with episodes interleaved in pairs (every turn restores the state the
episode's previous turn stored).  kvtrace diff must find exactly the forks the harness saw, blame
the cache hit, and trace a restored state back to the request that stored it."""

from __future__ import annotations

import pytest

llama_cpp = pytest.importorskip("llama_cpp")

from kvtrace import correlate  # noqa: E402
from kvtrace.collectors.ingest import ingest_paths  # noqa: E402
from kvtrace.analysis.forks import diff_runs  # noqa: E402

EPISODES, TURNS, MAX_TOKENS = 16, 5, 24


def episode_order(arm: str) -> list[tuple[int, int]]:
    if arm == "ram":  # two episodes at a time, turns alternating: live context never matches
        return [(e, t) for first in range(0, EPISODES, 2) for t in range(TURNS) for e in (first, first + 1)]
    return [(e, t) for e in range(EPISODES) for t in range(TURNS)]


@pytest.fixture
def three_runs(llama_patched, spool_recorder, spool_dir, make_llama, db, tmp_path):
    from kvtrace.testmodels.llama_gguf import make_model

    # Quantized weights and flash attention make the cache-path logit differences large enough to flip
    # near ties: without flash attention an AVX2-only CPU forked on none of these episodes, with it 11 of 16.
    model = make_model(tmp_path / "tiny-Q4_0.gguf", "Q4_0", "tiny")
    llm = make_llama(model_path=str(model), n_ctx=1024, flash_attn=True)
    seen: dict[tuple[str, str, int], tuple[list[int], str]] = {}
    for arm in ("reuse", "off", "ram"):
        llm.reset()
        llm.set_cache(llama_cpp.LlamaRAMCache(capacity_bytes=256 << 20) if arm == "ram" else None)
        prompts = {e: llm.tokenize(f"Episode {e}: the agent opens the file and".encode()) for e in range(EPISODES)}
        for e, turn in episode_order(arm):
            if arm == "off":
                llm.reset()
            with correlate(run_id=f"llama-{arm}", episode_id=f"e{e}", turn=turn):
                out = llm.create_completion(prompts[e], max_tokens=MAX_TOKENS, temperature=0.0)
            seen[(f"llama-{arm}", f"e{e}", turn)] = (list(prompts[e]), out["choices"][0]["text"])
            observation = llm.tokenize(f" obs {turn}.".encode(), add_bos=False)
            prompts[e] = llm.input_ids[: llm.n_tokens].tolist() + observation
    spool_recorder.pipeline.force_flush()
    ingest_paths(db, [spool_dir])
    return db, seen


def recorded(db, run: str, episode: str, turn: int) -> dict:
    result = db.query(
        "SELECT SpanId, token_ids, reused_tokens FROM kvtrace_requests "
        "WHERE run_id = {run:String} AND episode_id = {episode:String} AND turn = {turn:Int32}",
        parameters={"run": run, "episode": episode, "turn": turn})
    (span_id, token_ids, reused), = result.result_rows
    return {"span_id": span_id, "token_ids": list(token_ids), "reused": reused}


def harness_fork(seen, run_a: str, run_b: str, episode: str):
    """First turn whose prompt or completion differs, as the harness itself saw them."""
    for turn in range(TURNS):
        (prompt_a, text_a), (prompt_b, text_b) = seen[(run_a, episode, turn)], seen[(run_b, episode, turn)]
        if prompt_a != prompt_b or text_a != text_b:
            return turn
    return None


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.mark.slow
def test_cache_on_and_off_runs_fork_where_the_harness_saw_them_fork(three_runs):
    db, seen = three_runs
    for run_a, run_b in (("llama-reuse", "llama-off"), ("llama-ram", "llama-off"), ("llama-ram", "llama-reuse")):
        diff = diff_runs(db, run_a, run_b)
        assert diff.episodes_compared == EPISODES
        found = {f.episode: f for f in diff.forks}
        for e in range(EPISODES):
            episode = f"e{e}"
            turn = harness_fork(seen, run_a, run_b, episode)
            if turn is None:
                assert episode not in found and episode in diff.unforked
                continue
            fork = found[episode]
            a, b = recorded(db, run_a, episode, turn), recorded(db, run_b, episode, turn)
            assert (fork.turn, fork.position) == (turn, first_difference(a["token_ids"], b["token_ids"]))
            assert (fork.a.span_id, fork.b.span_id) == (a["span_id"], b["span_id"])
    reuse_vs_off = diff_runs(db, "llama-reuse", "llama-off")
    assert reuse_vs_off.forks, "this model and seed fork on some episode with prefix reuse on vs off"


@pytest.mark.slow
def test_forks_against_cache_off_blame_the_cache_hit(three_runs):
    db, _ = three_runs
    for run in ("llama-reuse", "llama-ram"):
        for fork in diff_runs(db, run, "llama-off").forks:
            if fork.kind == "prompt":
                continue
            hit = recorded(db, run, fork.episode, fork.turn)
            assert hit["reused"] > 0
            assert fork.attribution == "hit_vs_recompute"
            assert (fork.culprit.run, fork.culprit.span_id, fork.culprit.reused_tokens) == (
                run, hit["span_id"], hit["reused"])
            assert fork.b.cache.reused_tokens == 0
            assert fork.near_tie, f"a cache-path fork happens at a near tie, got margins {fork.a.margin}, {fork.b.margin}"


@pytest.mark.slow
def test_restored_state_is_traced_to_the_request_that_stored_it(three_runs):
    db, _ = three_runs
    forks = [f for f in diff_runs(db, "llama-ram", "llama-off").forks if f.kind == "output"]
    assert forks, "with episodes interleaved, the prompt-cache restores fork as the in-context reuse did"
    for fork in forks:
        culprit = fork.culprit
        assert culprit.event == "kvtrace.cache.restore" and culprit.layer == "prompt_cache"
        stored_by = recorded(db, "llama-ram", fork.episode, fork.turn - 1)
        assert (culprit.source.run_id, culprit.source.episode_id, culprit.source.turn, culprit.source.span_id) == (
            "llama-ram", fork.episode, fork.turn - 1, stored_by["span_id"])
