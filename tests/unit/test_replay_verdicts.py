"""The counterfactual's decision, given what each re-execution chose (no engine here: tests/test_replay.py
runs the real one). Runs A (a cache hit) and B (recomputed) forked at token 2 of turn 1: A chose 7,
B chose 9. The verdict follows from four re-executions: each request on its own path, and on the other's."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvtrace import semconv as sc
from kvtrace.analysis.fork_text import describe_fork
from kvtrace.analysis.forks import CachePath, Diff, Fork, Side
from kvtrace.analysis.html_view import render_diff
from kvtrace.replay.recorded import EngineConfiguration, RecordedRequest, ReplayRefused
from kvtrace.replay.reproduce import A_ON_B_PATH, B_ON_A_PATH, counterfactual, judge_fork

CONFIGURATION = EngineConfiguration("llama_cpp", "0.3.36", "m.gguf", "f1", {"n_ubatch": 256})
PROMPT = (1, 2, 3, 4)


def request(span: str, output: tuple[int, ...], starts_from, sampling=None) -> RecordedRequest:
    return RecordedRequest(span, "run-" + span, "e0", 1, sc.CAPTURE_IDS, CONFIGURATION, sampling or {},
                           sc.LAYER_KV_REUSE if starts_from else sc.LAYER_NONE, 3 if starts_from else 0, PROMPT,
                           output, starts_from)


A = request("a", (5, 6, 7, 8), "a0")
B = request("b", (5, 6, 9, 9), None)


def side(run: str, span: str, token: int) -> Side:
    return Side(run, span, span, token, -1, 0.01, CachePath(sc.LAYER_NONE, 0, 4, "", "", -1))


FORK = Fork("e0", 1, sc.FORK_KIND_OUTPUT, 2, sc.ATTRIBUTION_HIT_VS_RECOMPUTE, "", "run-a", "run-b",
            side("run-a", "a", 7), side("run-b", "b", 9), True, 0.01, sc.CAPTURE_IDS, None)


def outcomes(a_own, b_own, a_switched, b_switched):
    return {"a": {"token_ids": list(a_own)}, "b": {"token_ids": list(b_own)},
            A_ON_B_PATH: {"token_ids": list(a_switched)}, B_ON_A_PATH: {"token_ids": list(b_switched)}}


@pytest.mark.parametrize("story, executed, verdict", [
    ("the token follows the path", ((5, 6, 7), (5, 6, 9), (5, 6, 9), (5, 6, 7)), sc.VERDICT_CONFIRMED),
    ("the token stays with its request", ((5, 6, 7), (5, 6, 9), (5, 6, 7), (5, 6, 9)), sc.VERDICT_NOT_CACHE),
    ("only one side moves", ((5, 6, 7), (5, 6, 9), (5, 6, 9), (5, 6, 9)), sc.VERDICT_NOT_CACHE),
    ("the recorded paths agree: no fork", ((5, 6, 7), (5, 6, 7), (5, 6, 7), (5, 6, 7)), sc.VERDICT_NOT_REPRODUCED),
    ("an earlier token already differs", ((5, 4, 7), (5, 6, 9), (5, 6, 9), (5, 6, 7)), sc.VERDICT_NOT_REPRODUCED),
])
def test_the_verdict_follows_the_four_re_executions(story, executed, verdict):
    judged = judge_fork(FORK, A, B, outcomes(*executed))
    assert judged.verdict == verdict, story
    assert judged.recorded == (7, 9)


def test_not_reproduced_names_the_unrecorded_sampling_input_the_record_admits():
    biased = request("b", (5, 6, 9, 9), None, sampling={"logits_processor": True})
    judged = judge_fork(FORK, A, biased, outcomes((5, 6, 7), (5, 6, 7), (5, 6, 7), (5, 6, 7)))
    assert judged.verdict == sc.VERDICT_NOT_REPRODUCED
    assert "something the spans do not record differs" in judged.explanation
    assert "logits_processor" in judged.explanation


def test_a_fork_not_yet_judged_shows_the_replay_that_would_judge_it_in_text_and_html():
    command = "kvtrace replay run-a run-b --episode e0 --counterfactual"
    assert f"prove it: {command}" in describe_fork(FORK)
    judged = replace(FORK, verdict=sc.VERDICT_CONFIRMED, verdict_note="A's token follows the path")
    assert "prove it" not in describe_fork(judged)
    assert "replay" not in describe_fork(replace(FORK, kind=sc.FORK_KIND_PROMPT))

    def page(fork):
        return render_diff(Diff("run-a", "run-b", 1, [fork]), {})

    assert f"<code>{command}</code>" in page(FORK)
    assert command not in page(judged)


def test_a_fork_where_one_side_was_cancelled_is_not_replayed():
    cancelled = replace(FORK, attribution=sc.ATTRIBUTION_OUTPUT_CANCELLED, b=replace(FORK.b, token=-1))
    with pytest.raises(ReplayRefused, match="cancelled there"):
        counterfactual(None, None, cancelled, None)  # refused before any run or engine is touched
    assert not cancelled.replayable() and FORK.replayable()
