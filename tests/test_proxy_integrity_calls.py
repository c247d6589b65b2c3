"""The integrity check's calls to llama-server (``/apply-template``, ``/tokenize``): a prompt the server
already tokenized for the proxy is not asked again, and nothing it could not answer is remembered."""

from __future__ import annotations

from kvtrace.llama_server.tasks import server_tokenizer


class CountingServer:
    """Answers as llama-server does, and counts what it was asked."""

    def __init__(self):
        self.calls: list[str] = []
        self.answering = True

    def post(self, path: str, body: dict):
        self.calls.append(path)
        if not self.answering:
            return None
        if path == "/apply-template":
            return {"prompt": "".join(m["content"] for m in body["messages"])}
        return {"tokens": [ord(c) for c in body["content"]]}


def chat(text: str) -> dict:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": 4, "temperature": 0.5}


def test_a_prompt_tokenized_once_is_not_asked_of_the_server_again():
    server = CountingServer()
    tokenize = server_tokenizer(server.post)
    assert tokenize(chat("hello"), "chat") == [ord(c) for c in "hello"]
    # The same prompt with other sampling settings (a shadow twin, a repeat): no call at all.
    again = tokenize({**chat("hello"), "temperature": 0, "seed": 3}, "chat")
    assert again == [ord(c) for c in "hello"] and type(again) is list and type(again[0]) is int  # a record keeps it
    assert server.calls == ["/apply-template", "/tokenize"]
    assert list(tokenize(chat("hello!"), "chat")) == [ord(c) for c in "hello!"]  # another prompt is asked
    assert list(tokenize({"prompt": "hello"}, "completions")) == [ord(c) for c in "hello"]
    assert list(tokenize({"prompt": "hello"}, "native")) == [ord(c) for c in "hello"]
    assert server.calls == ["/apply-template", "/tokenize"] * 2 + ["/tokenize"]


def test_an_unanswered_call_is_not_remembered_and_the_oldest_prompts_make_room():
    server = CountingServer()
    server.answering = False
    tokenize = server_tokenizer(server.post, max_tokens=10)
    assert tokenize({"prompt": "abc"}, "completions") is None
    server.answering = True
    assert list(tokenize({"prompt": "abc"}, "completions")) == [97, 98, 99]  # asked again, now answered
    for prompt in ("defgh", "ijklm"):  # 3 + 5 + 5 tokens: past 10, "abc" goes
        tokenize({"prompt": prompt}, "completions")
    calls = len(server.calls)
    tokenize({"prompt": "ijklm"}, "completions")
    assert len(server.calls) == calls
    tokenize({"prompt": "abc"}, "completions")
    assert len(server.calls) == calls + 1


def test_a_record_waiting_for_the_request_its_state_came_from_is_woken_when_that_one_is_remembered(tmp_path):
    import threading
    import time
    from types import SimpleNamespace

    from kvtrace.llama_server.log import LogFollower, TaskDecision
    from kvtrace.llama_server.tasks import TaskProvenance

    provenance = TaskProvenance(LogFollower(tmp_path / "server.log"))
    provenance.REMEMBER_WAIT_S = 120.0  # woken, not timed out
    record = SimpleNamespace(config={}, output_token_ids=[], origin=lambda: None)
    source, other = (SimpleNamespace(task=TaskDecision(task, 0), marker=None, prompt_chain=None) for task in (7, 8))
    provenance._unremembered.update({7, 8})  # both matched to their tasks, their records still being made
    waiting = threading.Thread(target=provenance._wait_for, args=(7,))
    waiting.start()
    while 7 not in provenance._waiters:
        time.sleep(0.01)
    provenance.remember(other, record)
    waiting.join(0.2)
    assert waiting.is_alive()  # another task's request settles nothing for it
    provenance.remember(source, record)
    waiting.join(30)
    assert not waiting.is_alive()


def test_a_state_whose_answer_left_a_generated_id_out_goes_on_only_as_far_as_its_ids_stand_in_place(tmp_path):
    from types import SimpleNamespace

    from kvtrace import semconv as sc
    from kvtrace.llama_server.log import LogFollower, TaskDecision
    from kvtrace.llama_server.tasks import PromptChains, TaskProvenance, fingerprint

    def answer(tokens: list[str], generated: int) -> dict:
        entries = [{"id": 10 + i, "token": t, "bytes": list(t.encode()), "logprob": 0.0} for i, t in enumerate(tokens)]
        return {"choices": [{"logprobs": {"content": entries}}], "timings": {"prompt_n": 3, "predicted_n": generated}}

    provenance = TaskProvenance(LogFollower(tmp_path / "server.log"))
    chains = provenance._chains = PromptChains(b"key")
    prompt = chains.chain([1, 2, 3])
    kept = {}
    # Five tokens generated, four given: the one left out ended inside "é", whose entry carries its byte too.
    # Its state is known as far as the entry before; with every id given, to all but the last.
    for task, tokens, generated in ((7, [" a", " b", "\u00e9", " c"], 5), (8, [" a", " b", "\u00e9", " c"], 4),
                                    (9, [" a", " b", " c", " d"], 5)):
        traced = SimpleNamespace(task=TaskDecision(task, 0), prompt_chain=prompt,
                                 answer=fingerprint(answer(tokens, generated), None))
        record = SimpleNamespace(config={sc.OUTPUT_TOKEN_ID_SOURCE: sc.TOKEN_ID_SOURCE_ENGINE},
                                 output_token_ids=[10, 11, 12, 13], origin=lambda: None)
        provenance.remember(traced, record)
        kept[task] = len(chains.get(task))
    assert kept == {7: 3 + 2, 8: 3 + 3, 9: 3 + 4}  # 9: the one left out came after every entry
