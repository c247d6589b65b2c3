"""How far an answer's ids stand where they were generated, when llama-server's logprobs leave a token
out (one that ends inside a UTF-8 character): the state's hash chain goes on only that far."""

from kvtrace.llama_server.tasks import fingerprint


def _answer(entries, predicted_n, token_ids=None):
    choice = {"logprobs": {"content": entries}}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"choices": [choice], "timings": {"predicted_n": predicted_n}}


def _entry(token, raw):
    return {"token": token, "bytes": raw, "logprob": -0.1}


def test_the_ids_stand_in_place_up_to_the_first_entry_past_ascii():
    entries = [_entry("a", [97]), _entry("b", [98]), _entry("é", [0xC3, 0xA9]), _entry("c", [99])]
    assert fingerprint(_answer(entries, 5), slot=0).ids_in_place == 2


def test_every_id_given_or_none_left_out_needs_no_cut():
    entries = [_entry("a", [97]), _entry("é", [0xC3, 0xA9])]
    assert fingerprint(_answer(entries, 2), slot=0).ids_in_place is None
    assert fingerprint(_answer(entries, 3, token_ids=[1, 2, 3]), slot=0).ids_in_place is None


def test_a_token_left_out_at_the_end_keeps_every_entry():
    entries = [_entry("a", [97]), _entry("b", [98])]
    assert fingerprint(_answer(entries, 3), slot=0).ids_in_place == 2


def test_bytes_that_are_not_numbers_stop_the_chain_there_instead_of_failing_the_record():
    entries = [_entry("a", [97]), _entry("b", ["x"]), _entry("c", [99])]
    assert fingerprint(_answer(entries, 4), slot=0).ids_in_place == 1
