"""``kvtrace probe`` against llama.cpp's own llama-server, whose ``cache_prompt: false`` bypass the
probe relies on for its cold requests.

The canary story of tests/test_probe_llama_server.py, on the server the study used, with README's
command and the example prompts: the probe tells llama-server from the models list, sends each cold
request with ``cache_prompt: false`` and the warm ones with the cache on; the server's own counts
(``usage.prompt_tokens_details``) say the cold request recomputed its whole prompt and the warm one
reused it.
"""

from __future__ import annotations

import json

from kvtrace import semconv as sc
from kvtrace.cli import main
from llama_server_process import llama_server_binary, running_llama_server
from readme_commands import ROOT, readme_kvtrace_args

PROBE = "kvtrace probe --url http://127.0.0.1:8080/v1 --prompts examples/probe-prompts.jsonl"


def test_probe_cold_requests_bypass_llama_servers_cache_and_warm_ones_reuse_it(tiny_gguf, tmp_path, db, spool_dir,
                                                                                capsys, monkeypatch):
    from kvtrace.collectors.ingest import ingest_paths

    llama_server_binary()
    examples = (ROOT / "examples" / "probe-prompts.jsonl").read_text(encoding="utf-8").splitlines()
    prompt_ids = sorted(json.loads(line)["id"] for line in examples if line.strip() and not line.startswith("#"))
    monkeypatch.chdir(ROOT)  # README's command names the example prompts relative to the clone
    with running_llama_server(tiny_gguf, log_path=tmp_path / "server.log") as server:
        probe = readme_kvtrace_args(PROBE, {"http://127.0.0.1:8080/v1": f"{server}/v1"})
        code = main(["-q", *probe, "--run-id", "canary", "--warm", "2", "--max-tokens", "6", "--weight-format", "F32"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "as llama-server: cold requests send cache_prompt: false" in captured.err

    ingest_paths(db, [spool_dir])
    rows = db.query(
        "SELECT episode_id, turn, SpanAttributes['kvtrace.probe.role'], SpanAttributes['kvtrace.probe.bypass'], "
        "engine, prompt_tokens, reused_tokens, SpanAttributes['kvtrace.cache.reused_tokens.source'], "
        "length(token_ids), length(margins) "
        "FROM kvtrace_requests INNER JOIN otel_traces USING (SpanId) WHERE run_id = 'canary' "
        "ORDER BY episode_id, turn").result_rows
    assert [row[:3] for row in rows] == [(prompt, turn, role) for prompt in prompt_ids
                                         for turn, role in ((0, "cold"), (1, "warm"), (2, "warm"))]
    for episode in (rows[i:i + 3] for i in range(0, len(rows), 3)):
        cold, *warm = episode
        assert cold[3] == "cache_prompt_false" and cold[4] == "llama-server"
        assert cold[6] == 0 and cold[5] > 0  # the server recomputed the whole prompt
        for request in warm:
            assert 0 < request[6] <= request[5] == cold[5]  # ...and served the same prompt from the slot after
        for request in episode:
            assert request[7] == sc.REUSED_SOURCE_OPENAI_USAGE
            assert request[8] == request[9] > 0
