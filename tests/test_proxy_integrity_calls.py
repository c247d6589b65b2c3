"""The integrity check's calls to llama-server (``/apply-template``, ``/tokenize``): a prompt the server
already tokenized for the proxy is not asked again, and nothing it could not answer is remembered."""

from __future__ import annotations

import threading
from types import SimpleNamespace

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


def _provenance(tmp_path, wait_s: float = 120.0):
    from kvtrace.llama_server.log import LogFollower
    from kvtrace.llama_server.tasks import TaskProvenance

    provenance = TaskProvenance(LogFollower(tmp_path / "server.log"))
    provenance.REMEMBER_WAIT_S = wait_s
    return provenance


def _matched(task: int, previous: int | None = None, marker: int | None = None):
    from types import SimpleNamespace

    from kvtrace.llama_server.log import TaskDecision

    return SimpleNamespace(task=TaskDecision(task, 0, previous_task=previous), marker=marker, prompt_chain=None,
                           answer=None)


_RECORD = SimpleNamespace(config={}, output_token_ids=[], origin=lambda: None)


def test_a_record_waiting_for_the_request_its_state_came_from_runs_when_that_one_is_remembered(tmp_path):
    provenance = _provenance(tmp_path)
    source, other, waiting = _matched(7), _matched(8), _matched(11, previous=7)
    provenance._unremembered.update({7, 8})  # both matched to their tasks, their records still being made
    ran = []
    provenance.when_settled(waiting, lambda: ran.append(threading.current_thread()))
    assert ran == []  # parked: it holds no thread while it waits
    provenance.remember(other, _RECORD)
    assert ran == []  # another task's request settles nothing for it
    provenance.remember(source, _RECORD)
    assert ran == [threading.current_thread()]  # made by the thread that remembered its state's request
    provenance.when_settled(_matched(12, previous=7), lambda: ran.append("at once"))
    assert ran[-1] == "at once"


def test_a_parked_record_run_early_is_let_go_then_not_held_until_its_deadline(tmp_path):
    import gc
    import weakref

    provenance = _provenance(tmp_path)
    provenance._unremembered.update({6, 7})

    class End:
        def __call__(self):
            pass

    end = End()
    gone = weakref.ref(end)
    provenance.when_settled(_matched(10, previous=6), lambda: None)  # first in line, and never settled here
    provenance.when_settled(_matched(11, previous=7), end)
    del end
    provenance.remember(_matched(7), _RECORD)
    gc.collect()
    assert gone() is None  # the record (its end holds it) is not kept for the 120 s of its deadline


def test_a_slots_chain_of_waiting_records_runs_in_order_as_a_loop_on_the_thread_that_settles_the_first(tmp_path):
    # Each record's state came from the one before it on the slot; remembering one settles the next. Made
    # one inside another, a chain this long would run out of stack.
    provenance = _provenance(tmp_path)
    chain = [_matched(0)] + [_matched(task, previous=task - 1) for task in range(1, 3000)]
    provenance._unremembered.update(range(3000))
    made = []
    for traced in chain[1:]:
        def end(traced=traced):
            made.append(traced.task.task)
            provenance.remember(traced, _RECORD)
        provenance.when_settled(traced, end)
    assert made == []
    provenance.remember(chain[0], _RECORD)
    assert made == list(range(1, 3000))
    assert not provenance._parked


def test_a_record_whose_states_request_is_never_remembered_is_made_after_the_wait_on_a_thread_of_its_own(tmp_path):
    provenance = _provenance(tmp_path, wait_s=0.05)
    provenance._unremembered.add(7)  # matched, and never remembered nor let go
    made = threading.Event()
    threads = []
    provenance.when_settled(_matched(11, previous=7), lambda: (threads.append(threading.current_thread()), made.set()))
    assert made.wait(30)
    assert threads[0] is not threading.current_thread()
    assert not provenance._parked


def test_a_record_whose_state_is_an_unclaimed_marked_task_waits_only_while_a_request_carries_that_marker(tmp_path):
    from kvtrace.llama_server.log import TaskDecision
    from kvtrace.llama_server.tasks import MARKER_BASE

    provenance = _provenance(tmp_path)
    marker = MARKER_BASE + 5
    sender = _matched(0, marker=marker)
    sender.task = None
    with provenance._lock:
        provenance._unclaimed[7] = TaskDecision(7, 0, marker=marker)
        provenance._unclaimed_by_marker[marker] = [provenance._unclaimed[7]]
        provenance._wait(sender)  # the request that may yet claim task 7
    ran = []
    provenance.when_settled(_matched(11, previous=7), lambda: ran.append(11))
    assert ran == []
    provenance.abandon(sender)  # its record made without claiming task 7: another proxy's, then
    assert ran == [11]


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
