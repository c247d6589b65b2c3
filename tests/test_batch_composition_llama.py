"""llama-cpp-python records how each prompt was split into micro-batches: the same episodes run with
n_ubatch 64 and 1 (every other setting equal, the cache reset before every request) fork where the
harness sees them fork, and `kvtrace diff` labels every such fork batch_composition with both sides'
prompt splits; a rerun with the same n_ubatch is bit-equal and shows no fork."""

from __future__ import annotations

import pytest

llama_cpp = pytest.importorskip("llama_cpp")

from kvtrace import correlate  # noqa: E402
from kvtrace import semconv as sc  # noqa: E402
from kvtrace.analysis.forks import diff_runs  # noqa: E402
from kvtrace.collectors.ingest import ingest_paths  # noqa: E402

EPISODES, MAX_TOKENS, N_BATCH = 16, 24, 64
RUNS = {"ub64": 64, "ub1": 1, "ub64-again": 64}


@pytest.fixture
def runs(llama_patched, spool_recorder, spool_dir, make_llama, db, tmp_path):
    from kvtrace.testmodels.llama_gguf import make_model

    # Q8_0 with flash attention: here a one-token micro-batch and a 64-token one give logits far enough
    # apart to flip near ties (6 of these 16 episodes fork on an AVX2-only CPU).
    model = make_model(tmp_path / "tiny-Q8_0.gguf", "Q8_0", "tiny")
    seen = {}
    for run, n_ubatch in RUNS.items():
        llm = make_llama(model_path=str(model), n_batch=N_BATCH, n_ubatch=n_ubatch, flash_attn=True)
        for e in range(EPISODES):
            prompt = llm.tokenize((f"Episode {e}: the agent opens the file and reads line {e * 7} of the log, "
                                   * 2).encode())
            llm.reset()
            with correlate(run_id=run, episode_id=f"e{e}", turn=0):
                out = llm.create_completion(prompt, max_tokens=MAX_TOKENS, temperature=0.0)
            seen[(run, f"e{e}")] = (len(prompt), out["choices"][0]["text"])
    spool_recorder.pipeline.force_flush()
    ingest_paths(db, [spool_dir])
    return db, seen


def expected_split(prompt_tokens: int, n_ubatch: int) -> list[int]:
    split = []
    for start in range(0, prompt_tokens, N_BATCH):
        chunk = min(N_BATCH, prompt_tokens - start)
        split += [min(n_ubatch, chunk - i) for i in range(0, chunk, n_ubatch)]
    return split


def test_forks_between_micro_batch_sizes_are_labelled_by_the_prompt_split(runs):
    db, seen = runs
    forked = {e for (run, e), (_, text) in seen.items() if run == "ub64" and text != seen[("ub1", e)][1]}
    assert forked, "no episode forked between n_ubatch 64 and 1: the test shows nothing"
    diff = diff_runs(db, "ub64", "ub1")
    assert {f.episode for f in diff.forks} == forked
    for fork in diff.forks:
        prompt_tokens = seen[("ub64", fork.episode)][0]
        assert fork.attribution == sc.ATTRIBUTION_BATCH_COMPOSITION, fork
        assert fork.a.cache.reused_tokens == fork.b.cache.reused_tokens == 0
        assert fork.a.batch.prefill_steps == expected_split(prompt_tokens, 64) != [1] * prompt_tokens
        assert fork.b.batch.prefill_steps == [1] * prompt_tokens
        assert fork.a.batch.rows == fork.b.batch.rows == 1
    assert diff_runs(db, "ub64", "ub64-again").forks == []


def test_each_token_is_recorded_as_a_one_row_step_after_the_prompts_last_micro_batch(runs):
    db, seen = runs
    result = db.query("SELECT run_id, episode_id, batch_composition, step_rows, step_tokens, prefill_steps, "
                      "length(token_ids) FROM kvtrace_requests FINAL")
    assert len(result.result_rows) == len(RUNS) * EPISODES
    for run, episode, composition, rows, tokens, split, generated in result.result_rows:
        prompt_tokens = seen[(run, episode)][0]
        assert composition == sc.BATCH_RECORDED
        assert list(split) == expected_split(prompt_tokens, RUNS[run]) and sum(split) == prompt_tokens
        assert len(rows) == generated > 0 and set(rows) == {1}
        assert list(tokens) == [split[-1]] + [1] * (generated - 1)
