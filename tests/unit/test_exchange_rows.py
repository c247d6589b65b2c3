"""A chat answer's per-token arrays read in one pass where every entry is the plain case, and exactly as the
general reading gives them: ids, logprobs, top-1, runner-up, margins, what fails and with what message."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtrace.exchanges import exchange as reading
from kvtrace.exchanges.exchange import ExchangeError, TextHasher, parse_exchange

HASHER = TextHasher(b"k" * 32)
REQUEST = {"messages": [{"role": "user", "content": "hi"}]}

ids = st.integers(0, 2**20) | st.sampled_from([-1, 2**63, True, None, "7", 3.0])
logprobs = st.floats(-30, 0) | st.sampled_from([0, -1, float("nan"), float("-inf"), None, "x", True])


@st.composite
def entries(draw):
    def token():
        entry = {"token": draw(st.text(max_size=3)), "bytes": [1, 2]}
        # Mostly the plain case, so that whole answers of it are drawn too.
        if draw(st.integers(0, 29)):
            entry["id"] = draw(ids) if draw(st.integers(0, 19)) == 0 else draw(st.integers(0, 2**20))
        if draw(st.integers(0, 29)):
            entry["logprob"] = draw(logprobs) if draw(st.integers(0, 19)) == 0 else draw(st.floats(-30, 0))
        return entry

    entry = token()
    count = draw(st.sampled_from([2] * 8 + [0, 1, 3]))
    alternatives = [token() for _ in range(count)]
    if draw(st.integers(0, 29)) == 0:
        alternatives.append("not an object")
    if draw(st.integers(0, 29)) != 0:
        entry["top_logprobs"] = alternatives
    return entry


def read(response, plain_rows_allowed):
    with pytest.MonkeyPatch.context() as patched:
        if not plain_rows_allowed:
            patched.setattr(reading, "_plain_engine_rows", lambda logprobs: None)
        try:
            exchange = parse_exchange(REQUEST, response, HASHER, lambda token_ids: "by-ids")
        except ExchangeError as error:
            return f"refused: {error}"
    return repr(exchange)


@settings(max_examples=300, deadline=None, database=None)
@given(content=st.lists(entries(), max_size=5), token_ids=st.none() | st.lists(st.integers(0, 2**20), max_size=7))
def test_the_one_pass_reading_gives_what_the_general_reading_gives(content, token_ids):
    choice = {"index": 0, "finish_reason": "stop", "logprobs": {"content": content}}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    response = {"object": "chat.completion", "model": "m", "choices": [choice], "usage": {"prompt_tokens": 3}}
    assert read(response, True) == read(response, False)


def test_a_plain_llama_server_answer_is_read_in_one_pass_and_ranks_ties_as_the_stable_sort():
    entry = {"id": 5, "token": "a", "logprob": -0.5,
             "top_logprobs": [{"id": 5, "token": "a", "logprob": -0.5}, {"id": 9, "token": "b", "logprob": -0.5}]}
    swapped = {**entry, "top_logprobs": [{"id": 9, "logprob": -2.0}, {"id": 5, "logprob": -0.5}]}
    rows = reading._plain_engine_rows({"content": [entry, swapped]})
    assert rows == ([5, 5], [-0.5, -0.5], [5, 5], [9, 9], [0.0, 1.5])
    assert reading._plain_engine_rows({"content": [entry, {**entry, "id": True}]}) is None


@pytest.mark.parametrize("bad", [float("nan"), float("-inf"), float("inf"), 1, None])
def test_a_logprob_that_is_not_a_finite_float_anywhere_leaves_the_answer_to_the_general_reading(bad):
    def entry(chosen=-0.5, first=-0.5, second=-1.0):
        return {"id": 5, "logprob": chosen,
                "top_logprobs": [{"id": 5, "logprob": first}, {"id": 9, "logprob": second}]}

    for spoiled in (entry(chosen=bad), entry(first=bad), entry(second=bad)):
        assert reading._plain_engine_rows({"content": [entry(), spoiled]}) is None
        response = {"object": "chat.completion", "choices": [{"index": 0, "logprobs": {"content": [spoiled]}}]}
        assert read(response, True) == read(response, False)


@pytest.mark.parametrize("bad", [-1, 2**63, True])
def test_an_id_out_of_range_anywhere_leaves_the_answer_to_the_general_reading(bad):
    for where in range(3):
        tokens = [{"id": 5, "logprob": -0.5}, {"id": 5, "logprob": -0.5}, {"id": 9, "logprob": -1.0}]
        tokens[where] = {**tokens[where], "id": bad}
        spoiled = {**tokens[0], "top_logprobs": tokens[1:]}
        assert reading._plain_engine_rows({"content": [spoiled]}) is None
        response = {"object": "chat.completion", "choices": [{"index": 0, "logprobs": {"content": [spoiled]}}]}
        assert read(response, True) == read(response, False)
