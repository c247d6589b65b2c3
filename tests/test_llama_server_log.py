"""Reading llama-server's own log: which task restored which earlier task's state, and where the log
cannot say. The lines are llama-server's (-lv 4), as tests/test_proxy_llama_server.py sees them
from a real server; here the cases a short test run rarely shows."""

from __future__ import annotations

from kvtrace.outside.llama_server_log import LogFollower, LogParser

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


def lru_switch(saved: int, candidates: list[tuple[int, int, str, str]], found: tuple[str, str] | None) -> str:
    lines = ("0.02.000.000 I slot get_availabl: id  0 | task -1 | selected slot by LRU, t_last = 1\n"
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
