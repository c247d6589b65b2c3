"""A llama-server run recorded through `kvtrace proxy`, read back for replay.

The proxy names the request whose state each reuse or restore started from; replay rebuilds that
state on one slot of the replaying server, so a restore of a state another slot saved, or of a
state from outside the run, is refused, as is a request sampled at the server's default temperature
or recorded without its prompt ids. The server backend re-runs a state's requests whenever its slot
holds another."""

from __future__ import annotations

import json

import pytest

from kvtrace import semconv as sc
from kvtrace.patches.llama_cpp.engine import ENGINE as LLAMA_CPP
from kvtrace.progress import Progress
from kvtrace.replay import recorded
from kvtrace.replay.backends import backend_for
from kvtrace.replay.recorded import LLAMA_SERVER, ReplayRefused, Step, read_run
from kvtrace.replay.server import ServerBackend

GREEDY = json.dumps({"temperature": 0})


def row(span: str, turn: int, reused: int = 0, layer: str = sc.LAYER_NONE, source: str = "", slot: int = 0,
        sampling: str = GREEDY, prompt=(1, 2, 3, 4), engine: str = LLAMA_SERVER) -> dict:
    return {"span_id": span, "run_id": "served", "episode_id": "e0", "turn": turn, "capture_mode": sc.CAPTURE_IDS,
            "engine": engine, "engine_version": "b1", "model": "tiny-F32.gguf", "model_fingerprint": "tiny-F32.gguf",
            "numerics_settings": "{}", "sampling_settings": sampling, "cache_layer": layer, "reused_tokens": reused,
            "source_span_id": source, "slot_id": slot, "prompt_tokens": 4, "prompt_token_ids": list(prompt),
            "token_ids": [7, 8]}


def read(monkeypatch, *rows: dict):
    columns = list(rows[0])
    monkeypatch.setattr(recorded.queries, "run", lambda client, name, params: (columns, [
        [r[c] for c in columns] for r in rows]))
    return read_run(None, "served")


def test_a_reuse_and_a_restore_start_from_the_request_the_proxy_named(monkeypatch):
    run = read(monkeypatch, row("a", 0), row("other", 0, slot=1), row("b", 1, 3, sc.LAYER_KV_REUSE, "a"),
               row("c", 2, 3, sc.LAYER_PROMPT_CACHE, "b"))
    # The slot's previous request, not the run's (another slot served one in between).
    assert [r.starts_from for r in run.requests] == [None, None, "a", "b"]
    assert run.by_span["c"].path() == "prompt-cache restore of 3 tokens"


def test_a_restore_of_a_state_another_slot_saved_is_refused(monkeypatch):
    with pytest.raises(ReplayRefused, match="a state saved by slot 1 .* cannot be reproduced"):
        read(monkeypatch, row("a", 0, slot=1), row("b", 1, 3, sc.LAYER_PROMPT_CACHE, "a", slot=0))


def test_a_state_left_by_a_request_outside_the_run_is_refused(monkeypatch):
    with pytest.raises(ReplayRefused, match="left by span f00d, which is not in the run"):
        read(monkeypatch, row("a", 0), row("b", 1, 3, sc.LAYER_KV_REUSE, "f00d"))
    with pytest.raises(ReplayRefused, match="a request the proxy could not name"):
        read(monkeypatch, row("a", 0), row("b", 1, 3, sc.LAYER_KV_REUSE, ""))


def test_the_servers_default_temperature_and_missing_prompt_ids_are_refused(monkeypatch):
    with pytest.raises(ReplayRefused, match="server's default temperature"):
        read(monkeypatch, row("a", 0, sampling="{}"))
    with pytest.raises(ReplayRefused, match="temperature 0.7"):
        read(monkeypatch, row("a", 0, sampling=json.dumps({"temperature": 0.7})))
    with pytest.raises(ReplayRefused, match="kvtrace proxy --llama-server-log"):
        read(monkeypatch, row("a", 0, prompt=()))


def test_a_served_run_needs_server_and_an_engine_run_refuses_it(monkeypatch):
    served = read(monkeypatch, row("a", 0))
    with pytest.raises(ReplayRefused, match="--server URL"):
        backend_for([served], None, None, Progress(), 10)
    assert isinstance(backend_for([served], "http://127.0.0.1:1", None, Progress(), 10), ServerBackend)
    in_process = read(monkeypatch, row("a", 0, engine=LLAMA_CPP, sampling="{}"))
    with pytest.raises(ReplayRefused, match="recorded inside llama-cpp-python"):
        backend_for([in_process], "http://127.0.0.1:1", None, Progress(), 10)


def test_the_server_backend_rebuilds_a_state_its_slot_no_longer_holds(monkeypatch):
    sent = []
    backend = ServerBackend("http://127.0.0.1:1", 10)
    monkeypatch.setattr(backend, "_check_serves", lambda configuration: None)
    monkeypatch.setattr(backend, "_post", lambda path, body, optional=False: None)
    monkeypatch.setattr(backend, "_complete", lambda step: sent.append(step.key) or {"token_ids": [], "reused": 0})

    def step(key, starts_from=None):
        return Step(key, key if key in "ab" else "b", (1, 2), 2, {}, starts_from, keep_state=False)

    outcomes = backend.execute(None, [step("a"), step("b", "a"), step("b-on-a", "a")], Progress())
    # b's own run follows a's state; the switched run needs a's state again, so a is run first.
    assert sent == ["a", "b", "a", "b-on-a"]
    assert set(outcomes) == {"a", "b", "b-on-a"}
