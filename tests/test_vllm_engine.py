"""vLLM (vllm-cpu) in the fast single-process mode, on a generated tiny HF Llama.

One engine serves the whole module (startup ≈ 5 s): prefix caching on, 32-token
blocks and only 12 KV blocks, so a handful of requests already evicts.  The
story: an agent sends prompts that share a prefix; kvtrace's span for the
second one names the hit blocks by vLLM's own hashes, the margins equal what
vLLM's logprobs say, evictions name the request that had stored the blocks,
a request handed another prompt's blocks is caught all the way into the
database (listed, counted, alerted on, its fork labelled foreign_state), and
nothing the engine returns changes when tracing is on.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm")

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

from integrity_readback import assert_counted_and_alerted, store  # noqa: E402
from kvtrace import correlate, queries, semconv as sc  # noqa: E402
from kvtrace.analysis.forks import diff_runs  # noqa: E402
from vllm_fork_workload import vllm_block_hashes  # noqa: E402
from vllm_request_endings import PROBE_PROMPT, SAMPLED_PROMPT, abort_mid_answer, requests_ending_every_way  # noqa: E402

BLOCK = 32
SHARED = "the agent opens the file and reads the first line of the configuration " * 3


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    from kvtrace.testmodels.hf_llama import make_model

    return make_model(tmp_path_factory.mktemp("models") / "tiny-hf")


@pytest.fixture(scope="module")
def vllm_patch():
    from kvtrace.patches import vllm as patch

    assert patch.patch()
    yield patch
    patch.unpatch()


@pytest.fixture(scope="module")
def llm(hf_model, vllm_patch):
    from vllm import LLM

    return LLM(model=str(hf_model), dtype="float32", max_model_len=256, block_size=BLOCK, enforce_eager=True,
               enable_prefix_caching=True, distributed_executor_backend="uni", num_gpu_blocks_override=12, seed=0)


def spans_of(recorder) -> list[dict]:
    recorder.pipeline.force_flush()
    return [dict(s.attributes, _events=list(s.events)) for s in recorder.pipeline.exporter.get_finished_spans()]


def generate(llm, text: str, turn: int, max_tokens: int = 8, logprobs=None, run: str = "vllm-test",
             episode: str = "e0"):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)
    with correlate(run_id=run, episode_id=episode, turn=turn):
        return llm.generate([text], params, use_tqdm=False)[0]


def test_a_shared_prefix_hits_blocks_named_by_vllms_own_hashes(llm, memory_recorder):
    llm.reset_prefix_cache()
    first = generate(llm, SHARED + "alpha", turn=0)
    second = generate(llm, SHARED + "beta gamma", turn=1)
    a, b = spans_of(memory_recorder)
    assert a[sc.CACHE_LAYER] == sc.LAYER_NONE and a[sc.CACHE_REUSED_TOKENS] == 0
    assert b[sc.CACHE_LAYER] == sc.LAYER_PREFIX_BLOCKS
    assert b[sc.CACHE_REUSED_TOKENS] == second.num_cached_tokens > 0
    expected = vllm_block_hashes(llm, list(second.prompt_token_ids))
    hits = list(b[sc.CACHE_HIT_BLOCK_HASHES])
    assert hits == expected[: second.num_cached_tokens // BLOCK]
    assert list(b[sc.PROMPT_BLOCK_HASHES]) == expected
    assert list(a[sc.PROMPT_BLOCK_HASHES]) == vllm_block_hashes(llm, list(first.prompt_token_ids))
    # The hit names the request that stored the state, through run/episode/turn baggage.
    assert b[sc.CACHE_SOURCE_REQUEST_ID] == a[sc.REQUEST_ID] and b[sc.CACHE_SOURCE_TURN] == 0
    # The hit blocks hold the prompt's own hash chain: verified (and no verdict where nothing was reused).
    assert b[sc.CACHE_INTEGRITY] == sc.INTEGRITY_VERIFIED and sc.CACHE_INTEGRITY not in a
    assert not [e for e in b["_events"] if e.name == sc.EVENT_CACHE_INTEGRITY_VIOLATION]
    lookup = next(e for e in b["_events"] if e.name == sc.EVENT_CACHE_LOOKUP)
    assert lookup.attributes[sc.EVENT_OUTCOME] == sc.OUTCOME_HIT
    assert len(lookup.attributes[sc.EVENT_BLOCK_IDS]) == len(hits)
    stores = [e for e in a["_events"] if e.name == sc.EVENT_CACHE_STORE]
    assert [h for e in stores for h in e.attributes[sc.EVENT_BLOCK_HASHES]][: len(hits)] == hits
    assert b[sc.RUN_ID] == "vllm-test" and b[sc.TURN] == 1 and b[sc.ENGINE_NAME] == "vllm"
    assert b[sc.PROMPT_BLOCK_SIZE] == BLOCK
    assert '"prefix_caching": true' in b[sc.CACHE_SETTINGS] and '"hash_algorithm"' in b[sc.CACHE_SETTINGS]
    assert '"dtype": "float32"' in b[sc.NUMERICS_SETTINGS] and '"batch_invariant"' in b[sc.NUMERICS_SETTINGS]


def test_margins_and_logprobs_equal_vllms_own_logprobs(llm, memory_recorder):
    out = generate(llm, "a fresh prompt about margins", turn=0, max_tokens=12, logprobs=2)
    (span,) = spans_of(memory_recorder)
    assert list(span[sc.OUTPUT_TOKEN_IDS]) == list(out.outputs[0].token_ids)
    for i, (position, token) in enumerate(zip(out.outputs[0].logprobs, out.outputs[0].token_ids)):
        ranked = sorted(position.values(), key=lambda lp: lp.rank)
        assert span[sc.OUTPUT_MARGINS][i] == pytest.approx(ranked[0].logprob - ranked[1].logprob, abs=1e-4)
        assert span[sc.OUTPUT_LOGPROBS][i] == pytest.approx(position[token].logprob, abs=1e-4)
        assert span[sc.OUTPUT_RUNNER_UP_IDS][i] == next(t for t, lp in position.items() if lp.rank == 2)


def test_sampled_tokens_carry_the_raw_logits_margins_not_the_tempered_ones(llm, memory_recorder):
    # A float32 model sampled at temperature 0.7: vLLM divides the logits by the temperature and
    # masks them for top-k / top-p in place.  The margins and log-probabilities kvtrace records are
    # still those of the model's own logits, which vLLM's raw logprobs (its default logprobs_mode) report.
    from vllm import SamplingParams

    requests = {
        "the agent samples a warm answer": SamplingParams(temperature=0.7, seed=11, max_tokens=10,
                                                          ignore_eos=True, logprobs=2),
        "the agent samples a narrow answer": SamplingParams(temperature=0.7, top_k=8, top_p=0.9, seed=12,
                                                            max_tokens=10, ignore_eos=True, logprobs=2),
        "the agent answers greedily beside them": SamplingParams(temperature=0.0, max_tokens=10,
                                                                 ignore_eos=True, logprobs=2),
    }
    with correlate(run_id="vllm-test", episode_id="e0", turn=0):
        outputs = llm.generate(list(requests), list(requests.values()), use_tqdm=False)
    spans = {tuple(s[sc.PROMPT_TOKEN_IDS]): s for s in spans_of(memory_recorder)}
    assert len(spans) == len(requests)
    for out in outputs:
        span, completion = spans[tuple(out.prompt_token_ids)], out.outputs[0]
        assert list(span[sc.OUTPUT_TOKEN_IDS]) == list(completion.token_ids)
        for i, (position, token) in enumerate(zip(completion.logprobs, completion.token_ids)):
            ranked = sorted(position.values(), key=lambda lp: lp.rank)
            assert span[sc.OUTPUT_MARGINS][i] == pytest.approx(ranked[0].logprob - ranked[1].logprob, abs=1e-4)
            assert span[sc.OUTPUT_LOGPROBS][i] == pytest.approx(position[token].logprob, abs=1e-4)
            assert span[sc.OUTPUT_RUNNER_UP_IDS][i] == next(t for t, lp in position.items() if lp.rank == 2)
    sampled = [out for out in outputs if out.prompt != "the agent answers greedily beside them"]
    assert any(position[token].rank > 1 for out in sampled  # the temperature did draw other tokens
               for position, token in zip(out.outputs[0].logprobs, out.outputs[0].token_ids))


def test_every_row_is_its_output_token_whatever_ends_the_request(llm, memory_recorder):
    # Stop token, stop string, max_tokens=1, n=2, mixed lengths and (12 KV blocks for 16 requests)
    # preemption in one call, then an abort mid-stream: kvtrace checks each row's chosen id against
    # vLLM's output token at its position; here, where nothing reorders rows, none may be cut.
    probe = generate(llm, PROBE_PROMPT, turn=0, max_tokens=8).outputs[0]
    stop_token = probe.token_ids[3]
    spans_of(memory_recorder)
    memory_recorder.pipeline.exporter.clear()
    greedy = dict(temperature=0.0, ignore_eos=True)
    requests = requests_ending_every_way(probe, greedy)
    with correlate(run_id="vllm-rows", episode_id="e0", turn=0):
        outputs = llm.generate([text for text, _ in requests], [params for _, params in requests], use_tqdm=False)
        abort_mid_answer(llm.llm_engine, greedy)
    spans = spans_of(memory_recorder)
    completions = sum(len(out.outputs) for out in outputs)
    assert len(spans) == completions + 1 == 18  # n=2 is two requests in the engine core; the aborted one too
    by_prompt = {tuple(s[sc.PROMPT_TOKEN_IDS]): s for s in spans}
    stopped = by_prompt[tuple(outputs[0].prompt_token_ids)]
    assert list(stopped[sc.OUTPUT_TOKEN_IDS]) == list(probe.token_ids[:probe.token_ids.index(stop_token) + 1])
    assert len(outputs[2].outputs[0].token_ids) == 1
    preempted = [s for s in spans for e in s["_events"] if e.attributes.get(sc.EVENT_REASON) == sc.REASON_PREEMPTED]
    assert preempted, "16 requests on 12 blocks of 32 tokens: vLLM must preempt one"
    for span in spans:
        tokens = list(span[sc.OUTPUT_TOKEN_IDS])
        assert sc.OUTPUT_ROWS_CUT_AT not in span, span[sc.REQUEST_ID]
        assert len(span[sc.OUTPUT_MARGINS]) == len(tokens) == span[sc.GEN_AI_USAGE_OUTPUT_TOKENS] >= 1
    for out in outputs:
        if out.prompt != SAMPLED_PROMPT:  # greedy: the chosen id is the raw top-1
            span = by_prompt[tuple(out.prompt_token_ids)]
            assert list(span[sc.OUTPUT_TOP1_IDS]) == list(span[sc.OUTPUT_TOKEN_IDS])
    counters = memory_recorder.pipeline.counters.snapshot()
    assert counters["rows_misaligned"] == counters["rows_late"] == 0


def test_a_small_kv_budget_evicts_and_names_whose_blocks_went(llm, memory_recorder):
    llm.reset_prefix_cache()
    for turn, word in enumerate(("one", "two", "three", "four", "five")):
        generate(llm, f"{word} " * 30 + SHARED, turn=turn)
    spans = spans_of(memory_recorder)
    evictions = [(s, e) for s in spans for e in s["_events"] if e.name == sc.EVENT_CACHE_EVICT]
    assert evictions, "12 blocks cannot hold five 4-block prompts: vLLM must evict"
    stored_by = {h: s[sc.REQUEST_ID] for s in spans for e in s["_events"] if e.name == sc.EVENT_CACHE_STORE
                 for h in e.attributes[sc.EVENT_BLOCK_HASHES]}
    for span, event in evictions:
        (digest,) = event.attributes[sc.EVENT_BLOCK_HASHES]
        assert event.attributes[sc.EVENT_SOURCE_REQUEST_ID] == stored_by[digest] != span[sc.REQUEST_ID]
        assert event.attributes[sc.EVENT_TOKENS] == BLOCK


def test_a_prefix_cache_reset_shows_on_the_next_request(llm, memory_recorder):
    generate(llm, "before the reset", turn=0)
    assert llm.reset_prefix_cache()
    generate(llm, "after the reset", turn=1)
    before, after = spans_of(memory_recorder)
    assert sc.EVENT_CACHE_RESET in [e.name for e in after["_events"]]
    assert sc.EVENT_CACHE_RESET not in [e.name for e in before["_events"]]


def test_a_request_handed_another_prompts_blocks_is_caught_labelled_listed_and_alerted(
        llm, spool_recorder, spool_dir, db):
    """The prefix-cache lookup of one request is answered with the blocks another prompt cached (its
    hash chain looked up instead of the request's own): the engine continues from that prompt's KV.

    Two runs of the same two episodes, stored in the database: in the honest one every hit is the
    prompt's own; in the spoiled one the "mine" episode's request is violated, naming the "theirs"
    request that stored the blocks. The saved query lists it, ``kvtrace runs`` counts it, an alert rule
    fires for the spoiled run only, and ``kvtrace diff`` labels the fork ``foreign_state``."""
    coordinator = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.coordinator
    requests = [("theirs", 0, SHARED + "alpha"),
                ("mine", 0, "a different agent writes a report about the weather " * 3),
                ("theirs", 1, SHARED + "beta gamma")]  # a hit of its own: the honest run reuses state too
    chains = []
    lookup = coordinator.find_longest_cache_hit

    def mixed_up(block_hashes, max_cache_hit_length):
        chains.append(list(block_hashes))
        if len(chains) == 2:  # the second request gets the first one's chain looked up
            block_hashes = chains[0][: len(block_hashes)]
        return lookup(block_hashes, max_cache_hit_length)

    outputs = {}
    for run in ("honest", "spoiled"):
        llm.reset_prefix_cache()
        if run == "spoiled":
            coordinator.find_longest_cache_hit = mixed_up
        try:
            for episode, number, text in requests:
                outputs[run, episode, number] = generate(llm, text, turn=number, run=run, episode=episode)
        finally:
            vars(coordinator).pop("find_longest_cache_hit", None)  # vLLM's own method again
    theirs, mine = outputs["spoiled", "theirs", 0], outputs["spoiled", "mine", 0]
    assert mine.num_cached_tokens >= BLOCK
    # The engine continued from the other prompt's KV; the other episode answered as in the honest run.
    assert list(mine.outputs[0].token_ids) != list(outputs["honest", "mine", 0].outputs[0].token_ids)
    assert list(outputs["spoiled", "theirs", 1].outputs[0].token_ids) == list(
        outputs["honest", "theirs", 1].outputs[0].token_ids)
    store(spool_recorder, spool_dir, db)

    verdicts = dict(db.query(
        f"SELECT concat(SpanAttributes['{sc.RUN_ID}'], '/', SpanAttributes['{sc.EPISODE_ID}'], '/', "
        f"SpanAttributes['{sc.TURN}']), SpanAttributes['{sc.CACHE_INTEGRITY}'] FROM otel_traces").result_rows)
    assert verdicts == {"honest/theirs/0": "", "honest/mine/0": "", "honest/theirs/1": sc.INTEGRITY_VERIFIED,
                        "spoiled/theirs/0": "", "spoiled/mine/0": sc.INTEGRITY_VIOLATED,
                        "spoiled/theirs/1": sc.INTEGRITY_VERIFIED}

    # The saved query lists it with both sides: this request, and the request whose blocks they were.
    columns, rows = queries.run(db, "integrity_violations", {"run": "spoiled"})
    (violation,) = [dict(zip(columns, row)) for row in rows]
    assert (violation["episode_id"], violation["turn"], violation["engine"]) == ("mine", 0, "vllm")
    assert violation["reason"] == sc.INTEGRITY_HASH_CHAIN_DIFFERS and violation["layer"] == sc.LAYER_PREFIX_BLOCKS
    assert (violation["used_tokens"], violation["matched_tokens"]) == (mine.num_cached_tokens, 0)
    theirs_chain = vllm_block_hashes(llm, list(theirs.prompt_token_ids))
    assert list(violation["block_hashes"]) == theirs_chain[: mine.num_cached_tokens // BLOCK]
    (stored_request, stored_span), = db.query(
        f"SELECT SpanAttributes['{sc.REQUEST_ID}'], SpanId FROM otel_traces WHERE SpanAttributes['{sc.RUN_ID}'] = "
        f"'spoiled' AND SpanAttributes['{sc.EPISODE_ID}'] = 'theirs' AND SpanAttributes['{sc.TURN}'] = '0'").result_rows
    assert violation["source_request_id"] == stored_request and violation["source_span_id"] == stored_span
    assert (violation["source_run_id"], violation["source_episode_id"], violation["source_turn"]) == (
        "spoiled", "theirs", 0)
    assert queries.run(db, "integrity_violations", {"run": "honest"})[1] == []

    # kvtrace diff: "mine" forks at its first turn, on the spoiled side, labelled foreign_state.
    diff = diff_runs(db, "honest", "spoiled")
    (fork,) = diff.forks
    assert (fork.episode, fork.turn, fork.attribution) == ("mine", 0, sc.ATTRIBUTION_FOREIGN_STATE)
    assert diff.unforked == ["theirs"]
    assert fork.culprit.run == "spoiled" and fork.culprit.event == sc.EVENT_CACHE_INTEGRITY_VIOLATION
    assert fork.culprit.source.request_id == stored_request and fork.culprit.source.span_id == stored_span
    assert "foreign state <- stored by request" in fork.culprit.describe()

    # kvtrace runs counts it, and an alert rule on the violation count fires for the spoiled run only.
    assert_counted_and_alerted(db, "spoiled", "honest", engine="vllm")


def test_outputs_are_identical_with_tracing_off(llm, vllm_patch, memory_recorder):
    prompts = [SHARED + "x", SHARED + "y z", "short one"]

    def run() -> list[list[int]]:
        llm.reset_prefix_cache()
        return [list(generate(llm, p, turn=i, max_tokens=16).outputs[0].token_ids) for i, p in enumerate(prompts)]

    traced = run()
    vllm_patch.unpatch()
    try:
        untraced = run()
    finally:
        assert vllm_patch.patch()
    assert traced == untraced
    assert len(spans_of(memory_recorder)) == len(prompts)  # nothing recorded while unpatched


def test_unsupported_versions_are_refused_without_raising(monkeypatch, caplog):
    from kvtrace.patches import vllm as patch

    monkeypatch.setattr(patch, "_patched", False)
    monkeypatch.setattr(patch, "get_version", lambda: "0.20.1")
    assert patch.patch() is False
    assert "not supported" in caplog.text and patch.SUPPORTED in caplog.text
    assert patch.is_supported("0.32.0") and patch.is_supported("0.33.1") and patch.is_supported("0.34.0rc1")
    assert not patch.is_supported("0.35.0")


def test_the_installed_vllm_has_every_name_the_hooks_rely_on():
    # The source check against the vLLM these tests run (vllm-cpu): the AST reading agrees with the import.
    import subprocess
    import sys

    import vllm

    done = subprocess.run([sys.executable, "-m", "kvtrace.patches.vllm.surface_check", os.path.dirname(vllm.__file__)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "every feature has its targets" in done.stdout


def test_rows_a_worker_ships_survive_pickling_and_leave_vllms_outputs_alone():
    # What the mp executor's worker does with one step's sampler rows (the multiprocess test in
    # test_vllm_processes.py runs it for real): they ride on a copy of the output, as plain lists.
    import pickle

    import torch
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, AsyncModelRunnerOutput, ModelRunnerOutput

    from kvtrace.patches.vllm import worker

    stats = torch.tensor([[5.0, 5.0, 7.0, 0.5, -0.25, 1.0], [3.0, 3.0, 4.0, 0.0, -1.0, 0.0]])
    entries = [(["r-1", "r-2"], stats, None, (2, 7, [1, 6]), None)]  # ids, rows, event, the step's shape, skip
    shipped = worker._attach_rows(EMPTY_MODEL_RUNNER_OUTPUT, entries)
    assert not hasattr(EMPTY_MODEL_RUNNER_OUTPUT, worker.ROWS_ATTR)  # vLLM's shared instance untouched
    back = pickle.loads(pickle.dumps(shipped, protocol=pickle.HIGHEST_PROTOCOL))
    assert isinstance(back, ModelRunnerOutput)
    assert getattr(back, worker.ROWS_ATTR) == [(["r-1", "r-2"], stats.tolist(), (2, 7, [1, 6]))]

    class Pending(AsyncModelRunnerOutput):  # a runner's async output (async scheduling)
        def get_output(self):
            return ModelRunnerOutput(req_ids=["r-1"], req_id_to_index={"r-1": 0}, sampled_token_ids=[[5]])

    wrapped = worker._rows_output_class(AsyncModelRunnerOutput)(Pending(), entries)
    assert isinstance(wrapped, AsyncModelRunnerOutput)
    resolved = pickle.loads(pickle.dumps(wrapped.get_output()))
    assert resolved.sampled_token_ids == [[5]] and getattr(resolved, worker.ROWS_ATTR)[0][0] == ["r-1", "r-2"]
