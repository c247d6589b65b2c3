"""The same llama.cpp engine run — greedy multi-turn episodes with in-context reuse, cache off and
a prompt cache, as in test_diff_llama — recorded at once with token ids in the clear and hashed:
``kvtrace diff`` finds the same forks, at the same turns and positions, with the same labels and
culprits, under both capture policies."""

from __future__ import annotations

import dataclasses

import pytest

from diff_scenarios import fork_summary
from kvtrace import correlate
from kvtrace.collectors.ingest import ingest_paths
from kvtrace.config import Settings
from kvtrace.analysis.forks import diff_runs
from kvtrace.recording.recorder import Recorder, set_recorder
from kvtrace.recording.exporters.spool import SpoolExporter

llama_cpp = pytest.importorskip("llama_cpp")


class BothCaptures(Recorder):
    """The process recorder for one engine run: ids in the clear to one spool, hashed to another."""

    def __init__(self, settings: Settings, ids_spool, hashed_spool):
        super().__init__(dataclasses.replace(settings, capture_mode="ids"), exporter=SpoolExporter(ids_spool))
        self.hashed = Recorder(dataclasses.replace(settings, capture_mode="hashed"),
                               exporter=SpoolExporter(hashed_spool))

    def finish(self, record):
        self.hashed.finish(dataclasses.replace(record))
        super().finish(record)

    def shutdown(self):
        self.hashed.shutdown()
        super().shutdown()


@pytest.mark.slow
def test_a_real_engine_run_forks_alike_under_both_captures(llama_patched, make_llama, kvtrace_env, tmp_path):
    from kvtrace.collectors.schema import init_schema
    from kvtrace.db import connect
    from kvtrace.testmodels.llama_gguf import make_model

    recorder = BothCaptures(Settings.from_env(), tmp_path / "spool-ids", tmp_path / "spool-hashed")
    previous = set_recorder(recorder)
    try:
        # The workload of test_diff_llama: greedy multi-turn episodes with reuse, cache off, prompt cache.
        llm = make_llama(model_path=str(make_model(tmp_path / "tiny-Q4_0.gguf", "Q4_0", "tiny")), n_ctx=1024,
                         flash_attn=True)  # as test_diff_llama, whose settings make these episodes fork
        for arm in ("reuse", "off", "ram"):
            llm.reset()
            llm.set_cache(llama_cpp.LlamaRAMCache(capacity_bytes=256 << 20) if arm == "ram" else None)
            prompts = {e: llm.tokenize(f"Episode {e}: the agent opens the file and".encode()) for e in range(16)}
            order = [(e, t) for first in range(0, 16, 2) for t in range(5) for e in (first, first + 1)] \
                if arm == "ram" else [(e, t) for e in range(16) for t in range(5)]
            for e, turn in order:
                if arm == "off":
                    llm.reset()
                with correlate(run_id=f"llama-{arm}", episode_id=f"e{e}", turn=turn):
                    llm.create_completion(prompts[e], max_tokens=24, temperature=0.0)
                prompts[e] = llm.input_ids[: llm.n_tokens].tolist() + llm.tokenize(f" obs {turn}.".encode(),
                                                                                     add_bos=False)
    finally:
        set_recorder(previous)
        recorder.shutdown()
    summaries = {}
    for capture in ("ids", "hashed"):  # one embedded database per process at a time: one after the other
        client = connect(f"chdb://{tmp_path / f'db-{capture}'}")
        init_schema(client)
        ingest_paths(client, [tmp_path / f"spool-{capture}"])
        summaries[capture] = {pair: (fork_summary(diff), diff.unforked) for pair in
                              (("llama-reuse", "llama-off"), ("llama-ram", "llama-off"), ("llama-ram", "llama-reuse"))
                              for diff in [diff_runs(client, *pair)]}
        client.close()
    assert summaries["hashed"] == summaries["ids"]
    assert any(forks for forks, _ in summaries["ids"].values()), "this model and seed fork somewhere"
