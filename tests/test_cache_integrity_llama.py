"""A prompt cache that hands out another conversation's state, caught on llama-cpp-python.

The story: two agent episodes interleave on one ``Llama`` with a RAM prompt cache, once with an
honest cache and once with one that, for episode e1's second turn, hands out the state episode e0
stored under e1's tokens.  The engine continues from e0's conversation.  The honest run's every
reuse and restore is ``verified``; the spoiled request is ``violated`` with an integrity-violation
event naming e0's request; ``kvtrace diff`` labels the fork ``foreign_state``; the saved query lists
the violation, ``kvtrace runs`` counts it, and an alert rule on the violation count fires.
"""

from __future__ import annotations


import pytest

llama_cpp = pytest.importorskip("llama_cpp")

from foreign_state_cache import ForeignStateCache  # noqa: E402
from integrity_readback import assert_counted_and_alerted, store  # noqa: E402
from kvtrace import correlate, queries  # noqa: E402
from kvtrace import semconv as sc  # noqa: E402
from kvtrace.analysis.forks import diff_runs  # noqa: E402

EPISODES, TURNS, MAX_TOKENS = 2, 3, 12
SPOILED = ("e1", 1)


@pytest.fixture
def two_runs(llama_patched, spool_recorder, spool_dir, make_llama, db):
    llm = make_llama(n_ctx=1024)
    seen: dict[tuple[str, str, int], str] = {}
    caches = {}
    for run in ("honest", "spoiled"):
        llm.reset()
        spoil_next = []
        cache = (llama_cpp.LlamaRAMCache(capacity_bytes=256 << 20) if run == "honest"
                 else ForeignStateCache(spoil=lambda key: bool(spoil_next and spoil_next.pop())))
        caches[run] = cache
        llm.set_cache(cache)
        prompts = {e: llm.tokenize(f"Episode {e}: the agent opens file number {e * 7} and".encode())
                   for e in range(EPISODES)}
        for turn in range(TURNS):
            for e in range(EPISODES):  # interleaved: every turn after the first restores from the cache
                if run == "spoiled" and (f"e{e}", turn) == SPOILED:
                    spoil_next.append(True)
                with correlate(run_id=run, episode_id=f"e{e}", turn=turn):
                    out = llm.create_completion(prompts[e], max_tokens=MAX_TOKENS, temperature=0.0)
                seen[(run, f"e{e}", turn)] = out["choices"][0]["text"]
                prompts[e] = llm.input_ids[: llm.n_tokens].tolist() + llm.tokenize(f" obs {turn}.".encode(),
                                                                                   add_bos=False)
    store(spool_recorder, spool_dir, db)
    return db, seen, caches["spoiled"]


def spans(db, run: str) -> dict[tuple[str, int], dict]:
    rows = db.query(
        f"SELECT SpanAttributes['{sc.EPISODE_ID}'], toInt32(SpanAttributes['{sc.TURN}']), "
        f"SpanAttributes['{sc.CACHE_INTEGRITY}'], toInt64OrZero(SpanAttributes['{sc.CACHE_REUSED_TOKENS}']) "
        f"FROM otel_traces WHERE SpanAttributes['{sc.RUN_ID}'] = {{run:String}}",
        parameters={"run": run}).result_rows
    return {(e, t): {"verdict": v, "reused": r} for e, t, v, r in rows}


def test_a_cache_handing_out_another_conversation_is_caught_labelled_listed_and_alerted(two_runs):
    db, seen, spoiled_cache = two_runs
    ((looked_up, handed_out),) = spoiled_cache.handed_out
    # The fault took effect: the engine continued from e0's state, and e1's turn 1 answered otherwise.
    assert seen[("honest", *SPOILED)] != seen[("spoiled", *SPOILED)]

    honest = spans(db, "honest")
    assert len(honest) == EPISODES * TURNS
    for key, span in honest.items():  # every reuse and restore of an honest cache is the prompt's own
        assert span["verdict"] == (sc.INTEGRITY_VERIFIED if span["reused"] else ""), key
    assert sum(1 for s in honest.values() if s["reused"]) >= EPISODES * (TURNS - 1)
    spoiled = spans(db, "spoiled")
    assert spoiled[SPOILED]["verdict"] == sc.INTEGRITY_VIOLATED and spoiled[SPOILED]["reused"] > 0
    assert [k for k, s in spoiled.items() if s["verdict"] == sc.INTEGRITY_VIOLATED] == [SPOILED]

    # The saved query lists it with both sides: this request, and e0's request whose state it was.
    columns, rows = queries.run(db, "integrity_violations", {"run": "spoiled"})
    (violation,) = [dict(zip(columns, row)) for row in rows]
    assert (violation["episode_id"], violation["turn"]) == SPOILED
    assert violation["layer"] == sc.LAYER_PROMPT_CACHE and violation["reason"] == sc.INTEGRITY_TOKENS_DIFFER
    assert violation["used_tokens"] == spoiled[SPOILED]["reused"]
    assert violation["matched_tokens"] == llama_cpp.Llama.longest_token_prefix(handed_out, looked_up)
    assert violation["matched_tokens"] < violation["used_tokens"]
    assert (violation["source_run_id"], violation["source_episode_id"]) == ("spoiled", "e0")
    (source_span,) = db.query(
        "SELECT SpanId FROM kvtrace_cache_events WHERE run_id = 'spoiled' AND event = {store:String} "
        "AND episode_id = 'e0' AND tokens = {n:UInt32}",
        parameters={"store": sc.EVENT_CACHE_STORE, "n": len(handed_out)}).result_rows[0]
    assert violation["source_span_id"] == source_span
    assert queries.run(db, "integrity_violations", {"run": "honest"})[1] == []

    # kvtrace diff: e1 forks at the spoiled turn, on the spoiled side, labelled foreign_state.
    diff = diff_runs(db, "honest", "spoiled")
    fork = next(f for f in diff.forks if f.episode == SPOILED[0])
    assert (fork.turn, fork.attribution) == (SPOILED[1], sc.ATTRIBUTION_FOREIGN_STATE)
    assert fork.culprit.run == "spoiled" and fork.culprit.event == sc.EVENT_CACHE_INTEGRITY_VIOLATION
    assert fork.culprit.source.span_id == source_span and fork.culprit.source.episode_id == "e0"
    assert "foreign state <- stored by request" in fork.culprit.describe()

    # kvtrace runs counts it, and an alert rule on the violation count fires for the spoiled run only.
    assert_counted_and_alerted(db, "spoiled", "honest", engine="llama_cpp")
