"""What the proxy adds to a request for margins, and how exactly it is taken out of the answer.

The end-to-end proof is tests/test_proxy_llama_server.py against a real llama-server; these are
the cases a server's answers rarely show: the added member first in its object, spaces around the
colon, the member's name inside a string, nested objects, several choices.
"""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtrace import semconv as sc
from kvtrace.proxy import margin_request
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


# --- where an added member's value ends -----------------------------------------------------------
#
# The cut guesses a value's end from the right and takes a guess only where msgspec finds the text up to
# it to be exactly one JSON value; the JSON decoder measures the rest. The cut as it was, the decoder
# measuring every value, is the reference: same text out, or a ValueError from both.

CHAT_PLAN = plan_request(CHAT, {"messages": [], "stream": True}, LLAMA_SERVER)
COMPLETIONS_PLAN = plan_request(COMPLETIONS, {"prompt": "x"}, LLAMA_SERVER)
NATIVE_PLAN = plan_request(NATIVE, {"prompt": "x"}, LLAMA_SERVER)
PLANS = (CHAT_PLAN, COMPLETIONS_PLAN, NATIVE_PLAN)
LLAMA_SERVER_EVENT = ('{"choices":[{"finish_reason":null,"index":0,"delta":{"content":" w0"},"logprobs":{"content":'
                      '[{"id":100,"token":" w0","bytes":[32,119,48],"logprob":-0.25,"top_logprobs":[{"id":100,'
                      '"token":" w0","bytes":[32,119,48],"logprob":-0.25},{"id":7,"token":" a","bytes":[32,97],'
                      '"logprob":-1.5}]}]}}],"created":1765000000,"id":"chatcmpl-fake","model":"fake",'
                      '"system_fingerprint":"b0-fake","object":"chat.completion.chunk"}')
HOSTILE = [
    LLAMA_SERVER_EVENT,
    # the member last, first, in the middle, alone, in every choice
    '{"choices":[{"index":0,"logprobs":{"content":[]}}],"created":1}',
    '{"logprobs":{"content":[{"token":"a"}]},"choices":[]}',
    '{"a":1,"logprobs":[1,2],"b":{"c":[3]},"d":"}"}',
    '{"logprobs":{"x":1}}',
    '{"choices":[{"logprobs":{"a":1}},{"logprobs":{"b":2}},{"logprobs":null}]}',
    # strings holding what a value's end looks like, escaped quotes, the member's own name
    '{"choices":[{"logprobs":{"content":[{"token":"}],\\"created\\":1}"}]}}],"created":1}',
    '{"choices":[{"logprobs":{"content":[{"token":"}}],"}]}}],"note":"}],\\"x\\":{\\"y\\":1}"}',
    '{"logprobs":{"token":"\\"},{\\"logprobs\\":1}"},"after":"\\\\"}',
    '{"logprobs":"a string }, with \\"quotes\\" and \\\\","n_probs":2}',
    '{"logprobs":{"t":"\\\\\\"}"},"z":"\\"}"}',
    # nested members of the same name
    '{"logprobs":{"logprobs":{"logprobs":[1]}},"n_probs":{"n_probs":2}}',
    '{"choices":[{"logprobs":{"content":[{"logprobs":{"x":1},"n_probs":3}]}}],"post_sampling_probs":true}',
    # whitespace everywhere
    '{ "logprobs" : { "content" : [ 1 , 2 ] } , "b" : 1 }',
    '{\n\t"choices": [ {"logprobs": {"a": "}"}\r\n} ], "n_probs" :2 }',
    '{"logprobs": [ ] }',
    '{"logprobs":{"a":1}  ,"b":2}',
    # values of every JSON type
    '{"logprobs":null,"n_probs":2,"post_sampling_probs":false}',
    '{"logprobs":true,"n_probs":-1.5e3,"post_sampling_probs":"yes"}',
    '{"logprobs":"","n_probs":[],"post_sampling_probs":{}}',
    '{"logprobs":0,"completion_probabilities":[{"id":1,"top_probs":[{"prob":0.5}]}],"tokens":[1,2]}',
    '{"tokens":[1,2,3],"content":"y","completion_probabilities":[],"generation_settings":{"n_probs":2,'
    '"post_sampling_probs":false,"samplers":["top_k","dry"]}}',
    # unicode, raw and escaped
    '{"logprobs":{"token":"é ✓ 🙂","bytes":[195,169]},"x":"ü}"}',
    '{"logprobs":{"token":"\\u00e9\\ud83d\\ude42"},"x":"\\u007d"}',
    '{"choices":[{"logprobs":{"t":"日本語"}}],"model":"モデル"}',
    # where the value would end its object, first: a "}" after a closing character that is not its end
    '{"choices":[{"logprobs":{"t":"a}}b","u":{"v":1}}}],"x":{"y":1}}',
    '{"choices":[{"logprobs":[["]}"],[1]]}],"x":[2]}',
    '{"choices":[{"logprobs":{"t":"\\"}"}}],"x":1}',
    # not JSON, or JSON that only Python's decoder takes
    '{"logprobs":{"content":[1,2}}',
    '{"logprobs":{"content":[1,2],}}',
    '{"logprobs":{"a":"unclosed}}',
    '{"logprobs":{"a":1}',
    '{"logprobs":',
    '{"logprobs":   ',
    '{"logprobs":}',
    '{"logprobs":{"a":01},"b":1}',
    '{"logprobs":{"a":NaN},"b":1}',
    '{"logprobs":[Infinity,-Infinity],"b":1}',
    '{"logprobs":{"a":"\\ud800"},"b":1}',
    '{"logprobs":{"a":"\\x"},"b":1}',
    '{"logprobs":{"a":"tab\there"},"b":1}',
    '{"logprobs":{"a" 1},"b":{"c":2}}',
    '{"logprobs":{"a":1}} trailing',
    '{"logprobs":[1]]}',
    '{"logprobs":"a"b","c":1}',
    '{"logprobs":{"a":1}}}',
    '"logprobs":{"a":1}',
    'data: [DONE]',
    '',
]


def cut_by_decoding(plan, text):
    """The reference: the same cut with no guesses (the decoder measures every value)."""
    with pytest.MonkeyPatch.context() as patched:
        patched.setattr(margin_request, "_GUESSES", 0)
        patched.setattr(margin_request, "_GUESSES_LAST", 0)
        return outcome(plan, text)


def outcome(plan, text):
    try:
        return cut(plan, text)
    except ValueError:
        return ValueError


@pytest.mark.parametrize("text", HOSTILE)
def test_the_cut_ends_each_value_where_the_json_decoder_ends_it(text):
    for plan in PLANS:
        assert outcome(plan, text) == cut_by_decoding(plan, text), (plan.endpoint, text)


def test_a_guess_that_is_not_exactly_one_value_is_not_taken(monkeypatch):
    # From the right, the first closing brace a comma or a brace follows is the usage's, not the logprobs'.
    text = '{"logprobs":{"a":1},"usage":{"b":2}}'
    assert cut(CHAT_PLAN, text) == '{"usage":{"b":2}}'
    monkeypatch.setattr(margin_request, "_ONE_VALUE", lambda text: None)  # every guess taken unchecked
    assert cut(CHAT_PLAN, text) != '{"usage":{"b":2}}'


def test_llama_servers_events_are_cut_without_decoding_the_added_logprobs(monkeypatch):
    class NoDecoder:
        def raw_decode(self, text, start):
            raise AssertionError("the value was decoded to find its end")

    monkeypatch.setattr(margin_request, "_DECODER", NoDecoder())
    expected = LLAMA_SERVER_EVENT.replace(LLAMA_SERVER_EVENT[LLAMA_SERVER_EVENT.index(',"logprobs"'):
                                                              LLAMA_SERVER_EVENT.index('}],"created"')], "")
    assert cut(CHAT_PLAN, LLAMA_SERVER_EVENT) == expected
    native = '{"index":0,"content":" w","tokens":[7],"stop":false,"completion_probabilities":[{"id":7}]}'
    assert cut(plan_request(NATIVE, {"prompt": "x", "stream": True}, LLAMA_SERVER), native) == \
        '{"index":0,"content":" w","tokens":[7],"stop":false}'


def test_a_stream_event_that_cannot_be_cut_goes_on_as_it_came_and_is_counted():
    from kvtrace.proxy.app import ProxyApp

    class Counting:
        failures = 0

        def _count_failure(self, what):
            self.failures += 1

    proxy = Counting()
    good = b'data: {"choices":[{"index":0,"logprobs":{"a":1}}]}\n\n'
    broken = b'data: {"choices":[{"index":0,"logprobs":{"a":1,}}]}\n\n'
    assert ProxyApp._cut_events(proxy, CHAT_PLAN, good) == b'data: {"choices":[{"index":0}]}\n\n'
    assert ProxyApp._cut_events(proxy, CHAT_PLAN, good + broken) == good + broken
    assert proxy.failures == 1


HOSTILE_STRINGS = st.sampled_from(['}],"created":1', '\\"', '"', '}', ']', ',"logprobs":{', '\\', 'é🙂', '\\u007d',
                                   ' , ', '{"n_probs":2}'])
ADDED = st.sampled_from(["logprobs", "n_probs", "post_sampling_probs", "completion_probabilities", "tokens"])
DOCUMENTS = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False) | st.text(max_size=4)
    | HOSTILE_STRINGS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(ADDED | st.text(max_size=3), inner, max_size=4),
    max_leaves=10)


@settings(max_examples=400, deadline=None, database=None)
@given(document=st.dictionaries(ADDED, DOCUMENTS, min_size=1, max_size=4), plan=st.sampled_from(PLANS),
       separators=st.sampled_from([(",", ":"), (", ", ": "), (" ,\n", " :\t")]), ascii_only=st.booleans(),
       edit=st.tuples(st.integers(0, 400), st.integers(0, 2), st.sampled_from('{}[]",:\\ 0e-tn')))
def test_a_drawn_and_then_damaged_document_is_cut_as_the_json_decoder_would_cut_it(document, plan, separators,
                                                                                   ascii_only, edit):
    text = json.dumps(document, separators=separators, ensure_ascii=ascii_only)
    at, how, character = edit
    at %= len(text) + 1
    damaged = (text, text[:at] + text[at + 1:], text[:at] + character + text[at:])[how]
    assert outcome(plan, damaged) == cut_by_decoding(plan, damaged)


def test_json_that_only_pythons_decoder_refuses_is_cut_all_the_same():
    text = '{"choices":[{"index":0,"logprobs":[' + "7" * 5000 + ']}],"created":1}'
    assert cut_by_decoding(CHAT_PLAN, text) is ValueError  # its limit on an integer's digits
    assert cut(CHAT_PLAN, text) == '{"choices":[{"index":0}],"created":1}'


def test_the_check_takes_one_json_value_and_nothing_else():
    # What the guesses rest on: msgspec refuses a value with anything after it, and a value cut short.
    margin_request._ONE_VALUE('{"a":[1,"}"]}')
    for text in ('{"a":1}}', '{"a":1},{"b":2}', '{"a":"}', '[1]]', '"a"b"', '{"a":1} x'):
        with pytest.raises(msgspec.DecodeError):
            margin_request._ONE_VALUE(text)
