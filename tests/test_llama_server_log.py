"""Reading llama-server's own log: which task restored which earlier task's state, and where the log
cannot say. The lines are llama-server's (-lv 4), as tests/test_proxy_llama_server.py sees them
from a real server; here the cases a short test run rarely shows."""

from __future__ import annotations

import os
import threading
from types import SimpleNamespace

from kvtrace import semconv as sc
from kvtrace.llama_server.log import LogFollower, LogParser, started_after
from kvtrace.llama_server.tasks import Fingerprint, TaskProvenance

START = """\
0.00.100.000 I srv    load_model: prompt cache is enabled, size limit: 64 MiB
"""


def task(number: int, prompt_tokens: int, released_tokens: int, before: str = "", slot: int = 0) -> str:
    """One task's lines: what the server decided (``before``), then processing and release."""
    return (before
            + f"0.01.000.000 I slot launch_slot_: id  {slot} | task {number} | processing task, is_child = 0\n"
            + f"0.01.000.001 I slot   operator(): id  {slot} | task {number} | new prompt, n_ctx_slot = 1024, "
              f"n_keep = 0, task.n_tokens = {prompt_tokens}\n"
            + f"0.01.000.002 I slot      release: id  {slot} | task {number} | stop processing: "
              f"n_tokens = {released_tokens}, truncated = 0\n")


def lru_switch(saved: int, candidates: list[tuple[int, int, str, str]], found: tuple[str, str] | None,
               slot: int = 0) -> str:
    lines = (f"0.02.000.000 I slot get_availabl: id  {slot} | task -1 | selected slot by LRU, t_last = 1\n"
             "0.02.000.001 I srv  get_availabl: updating prompt cache\n"
             f"0.02.000.002 I srv   prompt_save:  - saving prompt with length {saved}, total state size = 0.011 MiB\n"
             "0.02.000.003 I srv          load:  - looking for better prompt, base f_keep = 0.048, f_sim = 0.042\n")
    for length, lcp, keep, sim in candidates:
        lines += (f"0.02.000.004 I srv          load:    - prompt with length {length:7d}, lcp = {lcp:7d}, "
                  f"f_keep = {keep}, f_sim = {sim}\n")
    if found:
        lines += f"0.02.000.005 I srv          load:  - found better prompt with f_keep = {found[0]}, f_sim = {found[1]}\n"
    return lines


def feed(text: str) -> LogParser:
    parser = LogParser()
    for line in text.splitlines():
        parser.feed(line)
    return parser


def test_a_restore_names_the_task_whose_state_was_saved():
    log = (START + task(7, 18, 21)
           + task(12, 24, 27, lru_switch(21, [(21, 1, "0.048", "0.042")], None))
           + task(17, 32, 35, lru_switch(27, [(21, 18, "0.857", "0.562"), (27, 1, "0.037", "0.031")],
                                         ("0.857", "0.562"))))
    parser = feed(log)
    assert parser.settings == {"cache_ram_mib": 64}
    assert parser.decisions[12].restore is None and parser.decisions[12].looked_up
    restore = parser.decisions[17].restore
    assert (restore.source_task, restore.length, restore.common_prefix, restore.similarity) == (7, 21, 18, 0.562)
    assert restore.doubt is None
    assert parser.decisions[17].prompt_tokens == 32 and parser.decisions[17].selected_by == "lru"


def test_two_cached_prompts_alike_leave_the_source_open_instead_of_guessing():
    log = (START + task(1, 18, 21) + task(2, 18, 21, lru_switch(21, [(21, 1, "0.048", "0.042")], None))
           + task(3, 30, 33, lru_switch(21, [(21, 18, "0.857", "0.562"), (21, 18, "0.857", "0.562")],
                                        ("0.857", "0.562"))))
    restore = feed(log).decisions[3].restore
    assert restore.source_task is None
    assert "same length and similarity" in restore.doubt


def test_a_state_the_log_did_not_see_stored_has_no_source():
    # The log starts mid-way: the cache already held a prompt nobody saw being saved.
    log = task(5, 18, 21) + task(6, 30, 33, lru_switch(21, [(40, 30, "0.750", "0.900"), (21, 1, "0.048", "0.033")],
                                                       ("0.750", "0.900")))
    restore = feed(log).decisions[6].restore
    assert restore.source_task is None and restore.doubt


def test_the_follower_reads_only_what_was_added_and_waits_for_whole_lines(tmp_path):
    path = tmp_path / "server.log"
    path.write_text(START + task(7, 18, 21)[:60])
    follower = LogFollower(path)
    assert follower.poll() == []
    with open(path, "a") as log:
        log.write(task(7, 18, 21)[60:])
    assert [d.task for d in follower.poll()] == [7]
    assert follower.poll() == []


def test_the_follower_keeps_its_file_open_and_reads_a_truncated_or_replaced_log_from_its_start(tmp_path):
    path = tmp_path / "server.log"
    path.write_text(START + task(7, 18, 21))
    follower = LogFollower(path)
    assert [d.task for d in follower.poll()] == [7]
    path.write_text(START)  # truncated in place (a server restarted onto the same file)
    assert follower.poll() == []
    with open(path, "a") as log:
        log.write(task(8, 18, 21))
    assert [d.task for d in follower.poll()] == [8]
    replacement = tmp_path / "server.log.new"
    replacement.write_text(START + task(9, 18, 21) + task(10, 18, 21))
    replacement.replace(path)  # a new file under the name (rotated): longer than what was read, read whole
    assert [d.task for d in follower.poll()] == [9, 10]
    assert follower.poll() == []


def test_the_follower_looks_at_the_files_name_only_when_the_open_file_has_nothing_new(tmp_path, monkeypatch):
    """A poll that finds lines is one read (no stat of the name): the name is looked at when nothing new came,
    where it may name a rotated or truncated file."""
    import kvtrace.llama_server.log as log_module

    path = tmp_path / "server.log"
    path.write_text(START)
    follower = LogFollower(path)
    follower.poll()
    looks: list[str] = []
    real_stat = os.stat
    monkeypatch.setattr(log_module.os, "stat", lambda *a, **k: looks.append("stat") or real_stat(*a, **k))
    for number in (7, 8):
        with open(path, "a") as log:
            log.write(task(number, 18, 21))
        assert [d.task for d in follower.poll()] == [number]
    assert looks == []
    assert follower.poll() == []
    assert looks == ["stat"]


def test_a_task_is_placed_where_its_line_ends_so_a_request_sent_before_it_may_own_it(tmp_path, monkeypatch):
    # A request sent when the log ended at `sent` may own the tasks whose line ends past it, only those,
    # however the log is cut into pieces and whatever bytes (not ASCII, not UTF-8) come before.
    monkeypatch.setattr(LogFollower, "READ_BYTES", 7)
    path = tmp_path / "server.log"
    path.write_bytes(START.encode() + "naïve \xff line\n".encode("latin-1") + task(7, 18, 21).encode())
    follower = LogFollower(path)
    sent = follower.end()
    with open(path, "ab") as log:
        log.write(task(8, 18, 21).encode())
    first, second = follower.poll()
    data = path.read_bytes()
    for decision in (first, second):
        line = f"task {decision.task} | processing task, is_child = 0\n".encode()
        assert decision.logged_at == (path.stat().st_ino, data.index(line) + len(line))
    assert sent == (path.stat().st_ino, len(data) - len(task(8, 18, 21).encode()))
    assert [started_after(d, sent) for d in (first, second)] == [False, True]
    assert started_after(first, (0, 0))  # the log could not be read when the request went out


def launch(number: int, slot: int, marker: int) -> str:
    """The lines llama-server writes when it hands a task to a slot: its sampling parameters, then the task."""
    return (f"0.03.000.000 I slot launch_slot_: id  {slot} | task -1 | sampler params: \n"
            "\trepeat_last_n = 64, repeat_penalty = 1.000, frequency_penalty = 0.000, presence_penalty = 0.000\n"
            f"\tdry_multiplier = 0.000, dry_base = 1.750, dry_allowed_length = 2, dry_penalty_last_n = {marker}\n"
            f"0.03.000.001 I slot launch_slot_: id  {slot} | task {number} | processing task, is_child = 0\n")


def timings(number: int, slot: int, prompt: int, kept: int, generated: int) -> str:
    return (f"0.03.000.002 I slot   operator(): id  {slot} | task {number} | new prompt, n_ctx_slot = 1024, n_keep = 0, "
            f"task.n_tokens = {prompt}\n"
            f"0.03.000.003 I slot   operator(): id  {slot} | task {number} | cached n_tokens = {kept}, memory_seq_rm\n"
            # A prompt longer than a batch: later lines report progress, not what was kept.
            f"0.03.000.004 I slot   operator(): id  {slot} | task {number} | cached n_tokens = {kept + 64}, memory_seq_rm\n"
            f"0.03.000.005 I slot print_timing: id  {slot} | task {number} | prompt eval time =       4.26 ms /    "
            f"{prompt - kept} tokens (    0.30 ms per token,  3287.93 tokens per second)\n"
            f"0.03.000.006 I slot print_timing: id  {slot} | task {number} |        eval time =       9.88 ms /     "
            f"{generated} tokens (    1.41 ms per token,   708.50 tokens per second)\n")


def test_each_task_carries_its_sampling_marker_and_the_counts_an_answer_reports():
    # Two slots launched back to back, their lines interleaved as the server's threads write them.
    parser = feed(launch(40, 1, 1048577) + launch(41, 0, 64) + timings(41, 0, 30, 0, 8) + timings(40, 1, 90, 12, 5))
    first, second = parser.decisions[40], parser.decisions[41]
    assert (first.marker, first.slot) == (1048577, 1)
    assert (second.marker, second.slot) == (64, 0)
    assert (first.prompt_tokens, first.cached_tokens, first.evaluated_tokens, first.generated_tokens) == (90, 12, 78, 5)
    assert (second.prompt_tokens, second.cached_tokens, second.generated_tokens) == (30, 0, 8)


def test_a_marker_two_tasks_carry_is_left_ambiguous_not_guessed(tmp_path):
    # Two proxies in front of one server may send the same marker at once: neither task is taken.
    path = tmp_path / "server.log"
    path.write_text(START)
    provenance = TaskProvenance(LogFollower(path))
    mine, alone = (SimpleNamespace(marker=1048600, answer=None, task=None, match=None) for _ in range(2))
    provenance.sent(mine)
    with open(path, "a") as log:
        log.write(launch(40, 0, 1048600) + timings(40, 0, 30, 0, 8) + launch(41, 1, 1048600) + timings(41, 1, 30, 0, 8))
    provenance.sent(alone)
    with open(path, "a") as log:
        log.write(launch(42, 2, 1048600) + timings(42, 2, 30, 0, 8))
    answer = Fingerprint(30, 30, 8, None)
    provenance.find(mine, answer)
    provenance.find(alone, answer)
    assert (mine.match, mine.task) == (sc.TASK_MATCH_AMBIGUOUS, None)
    assert (alone.match, alone.task.task) == (sc.TASK_MATCH_MARKER, 42)  # the tasks before it was sent are not its


def test_the_servers_cache_listing_keeps_the_model_right_where_the_lines_alone_would_not():
    # A prompt saved from a slot the log never showed finishing: the lines say "length 40", the listing
    # says which entries the cache holds; the next restore of the known entry still names its task.
    listing = ("0.02.000.010 I srv        update:  - cache state: 2 prompts, 0.026 MiB (limits: 64.000 MiB)\n"
               "0.02.000.011 I srv        update:    - prompt 0x5600000a0:      21 tokens, checkpoints:  0,     0.011 MiB\n"
               "0.02.000.012 I srv        update:    - prompt 0x5600000b0:      40 tokens, checkpoints:  0,     0.020 MiB\n")
    log = (START + task(7, 18, 21) + task(8, 30, 33, lru_switch(21, [(21, 1, "0.048", "0.042")], None) + listing)
           + task(9, 30, 33, lru_switch(33, [(21, 18, "0.857", "0.562"), (40, 1, "0.025", "0.031"),
                                             (33, 1, "0.030", "0.031")], ("0.857", "0.562"))))
    restore = feed(log).decisions[9].restore
    assert (restore.source_task, restore.doubt) == (7, None)


def listing(*entries: tuple[str, int]) -> str:
    lines = f"0.02.000.010 I srv        update:  - cache state: {len(entries)} prompts, 0.026 MiB (limits: 64.000 MiB)\n"
    for address, length in entries:
        lines += (f"0.02.000.011 I srv        update:    - prompt {address}:      {length} tokens, checkpoints:  0,"
                  "     0.011 MiB\n")
    return lines


def test_two_alike_cached_prompts_are_told_apart_by_the_one_that_left_the_cache():
    # Tasks 1 and 2 leave alike states on slots 0 and 1; both go into the cache; a later restore
    # matches both equally, and the listing after it shows which one left.
    miss = [(21, 1, "0.048", "0.042")]
    log = (START + task(1, 18, 21, slot=0) + task(2, 18, 21, slot=1)
           + task(3, 30, 33, lru_switch(21, miss, None, slot=0) + listing(("0x5600000a0", 21)), slot=0)
           + task(4, 30, 33, lru_switch(21, miss * 2, None, slot=1) + listing(("0x5600000a0", 21), ("0x5600000b0", 21)),
                  slot=1)
           + task(5, 30, 33, lru_switch(33, [(21, 18, "0.857", "0.562")] * 2 + [(33, 1, "0.030", "0.031")],
                                        ("0.857", "0.562"), slot=0)
                  + listing(("0x5600000a0", 21), ("0x5600000c0", 33)), slot=0))
    restore = feed(log).decisions[5].restore
    assert (restore.source_task, restore.doubt) == (2, None)  # 0x...b0 left: task 2's state


def test_a_listing_that_leaves_the_models_order_midway_or_ends_short_keeps_each_known_entrys_origin():
    # Tasks 1 and 2 leave states of 21 and 33 tokens in the cache; the listings learn their addresses.
    # Then a listing shows a prompt between them the log never showed stored, or only the second, or
    # only the first: the entries the model knows keep their tasks, found by address.
    miss = [(21, 1, "0.048", "0.042")]
    stored = (START + task(1, 18, 21) + task(2, 30, 33, lru_switch(21, miss, None) + listing(("0x5600000a0", 21)))
              + task(3, 50, 53, lru_switch(33, miss, None) + listing(("0x5600000a0", 21), ("0x5600000b0", 33))))
    midway = stored + listing(("0x5600000a0", 21), ("0x5600000c0", 40), ("0x5600000b0", 33))
    short = stored + listing(("0x5600000b0", 33))
    found = ("0.909", "0.833")
    restore_midway = task(4, 36, 39, lru_switch(53, [(21, 1, "0.048", "0.042"), (40, 1, "0.025", "0.031"),
                                                     (33, 30, *found), (53, 1, "0.019", "0.028")], found))
    assert feed(midway + restore_midway).decisions[4].restore.source_task == 2
    restore_short = task(4, 36, 39, lru_switch(53, [(33, 30, *found), (53, 1, "0.019", "0.028")], found))
    restore = feed(short + restore_short).decisions[4].restore
    assert (restore.source_task, restore.doubt) == (2, None)
    first_only = stored + listing(("0x5600000a0", 21))
    restore_first = task(4, 24, 27, lru_switch(53, [(21, 18, "0.857", "0.750"), (53, 1, "0.019", "0.028")],
                                               ("0.857", "0.750")))
    restore = feed(first_only + restore_first).decisions[4].restore
    assert (restore.source_task, restore.doubt) == (1, None)


def model_state(parser: LogParser) -> tuple:
    """What a parser concluded: each task's decision and the model of the cache, comparable."""
    decisions = {number: (d.slot, d.selected_by, d.prompt_tokens, d.cached_tokens, d.looked_up,
                          d.restore and (d.restore.source_task, d.restore.length, d.restore.common_prefix,
                                         d.restore.doubt))
                 for number, d in parser.decisions.items()}
    return decisions, [(entry.length, entry.address, entry.source_task) for entry in parser._cache]


def test_the_follower_reads_blocks_of_the_cache_listing_as_feeding_each_line_would(tmp_path, monkeypatch):
    # A cache of 40 prompts stored one task at a time, listed whole after each update (as llama-server does);
    # a line of another thread inside one listing, a listing that leaves the model's order, and a restore
    # after them. Read in pieces of several sizes, the follower must conclude what feeding each line does.
    miss = [(21, 1, "0.048", "0.042")]
    log, entries = START + task(0, 18, 20 + 0), []
    for number in range(1, 41):
        entries.append((f"0x56{number:08x}", 20 + number - 1))
        updates = lru_switch(20 + number - 1, miss, None)
        if number % 10 == 0:  # two prompts stored before one listing: two lines of it new to the model
            entries.append((f"0x58{number:08x}", 300 + number))
            updates += lru_switch(300 + number, miss, None, slot=1)
        updates += listing(*entries)
        if number == 20:  # another thread's line in the middle of the listing
            lines = updates.splitlines(keepends=True)
            updates = "".join(lines[:-10] + ["0.02.000.011 I slot get_availabl: id  1 | task -1 | - skipping\n"]
                              + lines[-10:])
        log += task(number, 18 + number, 20 + number, updates)
    log += listing(*entries[:10], ("0x5700000000", 99), *entries[10:])  # a prompt the log never showed stored
    found = ("0.909", "0.833")
    candidates = [(length, 1, "0.019", "0.028") for _, length in entries[:10]] + [(99, 1, "0.01", "0.02")] + [
        (length, 30 if length == 45 else 1, *(found if length == 45 else ("0.019", "0.028")))
        for _, length in entries[10:]]
    log += task(41, 36, 39, lru_switch(60, candidates, found))
    expected = model_state(feed(log))
    assert expected[0][41][5][:2] == (25, 45) and len(expected[1]) >= 40  # the restore names task 25's state
    path = tmp_path / "server.log"
    path.write_text(log)
    for piece in (61, 997, 1 << 16):
        monkeypatch.setattr(LogFollower, "READ_BYTES", piece)
        follower = LogFollower(path)
        follower.poll()
        assert model_state(follower.parser) == expected, piece


def test_a_task_pushed_out_of_the_unclaimed_or_logged_again_is_no_longer_any_requests(tmp_path, monkeypatch):
    # Other proxies' tasks stay unclaimed here until newer ones push them out: a request whose marker one of
    # them carried does not take it. A server restarted numbers its tasks anew: the new task is the one found.
    monkeypatch.setattr(TaskProvenance, "WAIT_S", ())
    monkeypatch.setattr(TaskProvenance, "MAX_UNCLAIMED", 2)
    path = tmp_path / "server.log"
    path.write_text(START + launch(40, 0, 1048600) + launch(41, 0, 1048601) + launch(42, 0, 1048602)
                    + launch(43, 0, 1048603) + launch(43, 1, 1048604))
    provenance = TaskProvenance(LogFollower(path))
    requests = {marker: SimpleNamespace(marker=marker, answer=None, task=None, match=None, sent_at=(0, 0))
                for marker in (1048600, 1048603, 1048604)}
    with provenance._lock:
        for request in requests.values():
            provenance._wait(request)
    for request in requests.values():
        provenance.find(request, Fingerprint(None, None, None, None))
    assert {marker: (r.match, r.task and r.task.slot) for marker, r in requests.items()} == {
        1048600: (sc.TASK_MATCH_NONE, None), 1048603: (sc.TASK_MATCH_NONE, None),
        1048604: (sc.TASK_MATCH_MARKER, 1)}


class _CountedLock:
    """A lock that counts how often it was taken."""

    def __init__(self):
        self._lock, self.taken = threading.Lock(), 0

    def acquire(self, *args):
        self.taken += 1
        return self._lock.acquire(*args)

    def release(self):
        self._lock.release()

    __enter__ = acquire

    def __exit__(self, *exc):
        self.release()


def test_a_requests_way_through_the_provenance_takes_its_lock_five_times(tmp_path):
    # Dozens of connection and record threads share the lock: each time it is taken while another holds it
    # costs a thread switch. What one thread reads in one step (a dict's entry, an attribute) needs no lock.
    from kvtrace.recording.records import Correlation, RequestRecord

    path = tmp_path / "server.log"
    path.write_text(START)
    provenance = TaskProvenance(LogFollower(path))
    provenance._lock = counted = _CountedLock()
    provenance._deadline_due = threading.Condition(counted)
    requests = []
    for number in (7, 8):
        before = counted.taken
        request = SimpleNamespace(marker=provenance.next_marker(), answer=None, task=None, match=None,
                                  prompt_chain=None, sent_at=(0, 0))
        record = RequestRecord(Correlation("run"), "llama-server", 0, "0" * 16, "0" * 32, reused_tokens=10)
        provenance.sent(request)
        with open(path, "a") as log:
            log.write(launch(number, 0, request.marker) + timings(number, 0, 18, 10, 1)
                      + f"0.03.000.007 I slot      release: id  0 | task {number} | stop processing: n_tokens = 19\n")
        provenance.find(request, Fingerprint(18, 8, 1, None))

        def described(request=request, record=record):
            provenance.describe(request, record, 10)
            provenance.remember(request, record)

        provenance.when_settled(request, described)
        provenance.abandon(request)
        requests.append((request, record, counted.taken - before))
    (first, _, _), (second, record, taken) = requests
    assert (first.task.task, second.task.task, second.task.previous_task) == (7, 8, 7)
    assert record.config[sc.SERVER_TASK_MATCH] == sc.TASK_MATCH_MARKER and record.state_origin is not None
    assert taken == 5  # the request sent, the log's tasks added, the match, its record settled and remembered


def test_every_literal_the_parser_looks_for_holds_a_word_of_its_first_screen():
    """A line without any of ``SCREEN_WORDS`` is passed over unread: a literal added without its word
    would never be seen."""
    from kvtrace.llama_server import log as parser_module

    assert parser_module._Screened.literals
    uncovered = [literal for literal in parser_module._Screened.literals
                 if not any(word in literal for word in parser_module.SCREEN_WORDS)]
    assert uncovered == []
