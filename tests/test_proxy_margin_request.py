"""What the proxy adds to a request for margins, and how exactly it is taken out of the answer.

The end-to-end proof is tests/test_proxy_llama_server.py against a real llama-server; these are
the cases a server's answers rarely show: the added member first in its object, spaces around the
colon, the member's name inside a string, nested objects, several choices.
"""

from __future__ import annotations

import json

from kvtrace import semconv as sc
from kvtrace.proxy.margin_request import (CHAT, COMPLETIONS, NATIVE, OPENAI_COMPATIBLE, UpstreamProfile, cut,
                                          plan_request, with_marker)

LLAMA_SERVER = UpstreamProfile(engine="llama-server", llama_server=True)
TOP_TWO = {"content": [{"id": 5, "token": "a", "logprob": -0.1,
                        "top_logprobs": [{"id": 5, "token": "a", "logprob": -0.1},
                                         {"id": 9, "token": "}\",\"logprobs\":", "logprob": -2.5}]}]}


def test_a_chat_request_without_logprobs_asks_llama_server_for_two_and_the_answer_loses_them_again():
    request = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    plan = plan_request(CHAT, request, LLAMA_SERVER)
    assert plan.source == sc.MARGIN_SOURCE_INJECTED
    assert plan.upstream_request == {**request, "n_probs": 2, "post_sampling_probs": False}
    answer_as_asked = ('{"choices":[{"finish_reason":"length","index":0,"message":{"role":"assistant",'
                       '"content":"\\"logprobs\\": no"},"logprobs":' + json.dumps(TOP_TWO) + '}],"created":1}')
    assert cut(plan, answer_as_asked) == ('{"choices":[{"finish_reason":"length","index":0,"message":{"role":'
                                          '"assistant","content":"\\"logprobs\\": no"}}],"created":1}')


def test_completions_answers_get_their_null_back_and_a_native_answer_its_settings_echo():
    completions = plan_request(COMPLETIONS, {"prompt": "x"}, LLAMA_SERVER)
    answer = '{"choices":[{"text":"y","index":0,"logprobs": ' + json.dumps(TOP_TWO) + ',"finish_reason":null}]}'
    assert cut(completions, answer) == '{"choices":[{"text":"y","index":0,"logprobs": null,"finish_reason":null}]}'

    native = plan_request(NATIVE, {"prompt": "x", "post_sampling_probs": True}, LLAMA_SERVER)
    answer = ('{"completion_probabilities":[{"id":1}],"content":"y","generation_settings":{"n_probs":2,'
              '"post_sampling_probs":false,"n_keep":0}}')
    assert cut(native, answer) == ('{"content":"y","generation_settings":{"n_probs":0,"post_sampling_probs":true,'
                                   '"n_keep":0}}')


def test_a_whole_native_answer_is_asked_for_its_generated_ids_and_gives_back_the_empty_list():
    native = plan_request(NATIVE, {"prompt": "x"}, LLAMA_SERVER)
    assert native.upstream_request["return_tokens"] is True
    answer = '{"content":"y","tokens":[198,172],"stop":true,"completion_probabilities":[{"id":172}]}'
    assert cut(native, answer) == '{"content":"y","tokens":[],"stop":true}'
    # A stream's events carry their ids anyway; a client that asked for the ids keeps them.
    for request in ({"prompt": "x", "stream": True}, {"prompt": "x", "return_tokens": True}):
        plan = plan_request(NATIVE, request, LLAMA_SERVER)
        assert plan.upstream_request.get("return_tokens") == request.get("return_tokens")
        assert "tokens" not in dict(plan.cuts)
    assert "return_tokens" not in plan_request(CHAT, {"messages": []}, LLAMA_SERVER).upstream_request


def test_every_choice_loses_what_was_added():
    plan = plan_request(CHAT, {"messages": []}, OPENAI_COMPATIBLE)
    assert plan.upstream_request["top_logprobs"] == 2
    answer = json.dumps({"choices": [{"index": i, "logprobs": TOP_TWO} for i in range(2)]})
    assert json.loads(cut(plan, answer)) == {"choices": [{"index": 0, "logprobs": None},
                                                         {"index": 1, "logprobs": None}]}


def test_a_client_that_asked_for_logprobs_keeps_its_request_and_answer():
    for endpoint, request in ((CHAT, {"logprobs": True, "top_logprobs": 5}), (COMPLETIONS, {"logprobs": 3}),
                              (NATIVE, {"n_probs": 4})):
        plan = plan_request(endpoint, request, LLAMA_SERVER)
        assert (plan.source, plan.upstream_request, plan.cuts) == (sc.MARGIN_SOURCE_CLIENT, None, ())
    one = plan_request(CHAT, {"logprobs": True, "top_logprobs": 1}, LLAMA_SERVER)
    assert (one.source, one.upstream_request) == (sc.MARGIN_SOURCE_UNAVAILABLE, None)


def test_a_server_that_sends_probabilities_by_default_is_left_alone():
    generous = UpstreamProfile(engine="llama-server", llama_server=True, default_n_probs=5)
    assert plan_request(NATIVE, {"prompt": "x"}, generous).source == sc.MARGIN_SOURCE_CLIENT


def test_a_marker_rides_in_dry_s_window_only_while_dry_is_off_and_its_echo_is_set_back():
    server = UpstreamProfile(engine="llama-server", llama_server=True, default_dry_penalty_last_n=64)
    request = {"prompt": "x", "n_predict": 3}
    marked = with_marker(plan_request(NATIVE, request, server), request, server, "dry_penalty_last_n", 1048577)
    assert marked.upstream_request["dry_penalty_last_n"] == 1048577
    assert marked.upstream_request["n_probs"] == 2  # the margins' request is kept
    answer = '{"content":"y","generation_settings":{"n_probs":2,"dry_penalty_last_n":1048577,"n_keep":0}}'
    assert cut(marked, answer) == '{"content":"y","generation_settings":{"n_probs":0,"dry_penalty_last_n":64,"n_keep":0}}'

    # A client's own logprobs: its request is still marked, and nothing else changes.
    asked = {"messages": [], "logprobs": True, "top_logprobs": 2}
    client = with_marker(plan_request(CHAT, asked, server), asked, server, "dry_penalty_last_n", 7)
    assert client.upstream_request == {**asked, "dry_penalty_last_n": 7} and client.source == sc.MARGIN_SOURCE_CLIENT

    # The window matters, or the server's default is unknown: no marker.
    for unmarked, profile in (({**request, "dry_multiplier": 0.8}, server),
                              ({**request, "dry_penalty_last_n": 32}, server),
                              (request, UpstreamProfile(engine="llama-server", llama_server=True)),
                              (request, UpstreamProfile(engine="llama-server", llama_server=True,
                                                        default_dry_multiplier=0.5, default_dry_penalty_last_n=64)),
                              (request, OPENAI_COMPATIBLE)):
        plan = plan_request(NATIVE, unmarked, profile)
        assert with_marker(plan, unmarked, profile, "dry_penalty_last_n", 7) is plan
