"""``kvtrace import`` of logs with hostile values: each bad line is reported as FILE:LINE and skipped.

A log written by some other harness can carry timestamps in milliseconds, NaN or 1e300, text where
``top_logprobs`` belongs, or ids beyond int64.  Each such line is reported with its place and
reason, the rest is imported, and nothing stored can break a later query: the books balance
(requests stored + lines rejected == lines written) and ``kvtrace runs`` still answers.
"""

from __future__ import annotations

import copy
import json
import math
import time

import pytest

from kvtrace.cli import main

NOW = time.time()


def exchange(turn: int, **top) -> dict:
    """One logged chat request/response with two tokens and top-2 logprobs."""
    content = [{"token": word, "logprob": -0.1, "bytes": list(word.encode()),
                "top_logprobs": [{"token": word, "logprob": -0.1}, {"token": "x", "logprob": -0.9}]}
               for word in ("Hello", " there")]
    return {"episode_id": "e0", "request_index": turn, "timestamp": NOW + turn,
            "request": {"model": "m", "messages": [{"role": "user", "content": f"turn {turn}"}],
                        "logprobs": True, "top_logprobs": 2},
            "response": {"object": "chat.completion", "model": "m",
                         "choices": [{"index": 0, "logprobs": {"content": content}, "finish_reason": "stop"}],
                         "usage": {"prompt_tokens": 5, "completion_tokens": 2}}, **top}


def _change(change):
    def make(turn):
        line = copy.deepcopy(exchange(turn))
        change(line)
        return line

    return make


def _token(**fields):
    return _change(lambda line: line["response"]["choices"][0]["logprobs"]["content"][0].update(fields))


def _completion_top(top):
    def change(line):
        line["request"] = {"model": "m", "prompt": "p", "logprobs": 2}
        line["response"] = {"object": "text_completion", "model": "m", "choices": [{"index": 0, "logprobs": {
            "tokens": ["a", "b"], "token_logprobs": [-0.1, -0.2], "top_logprobs": top}}]}

    return _change(change)


HOSTILE = {
    "timestamp NaN": (_change(lambda line: line.update(timestamp=math.nan)), "not a finite number"),
    "timestamp 1e300": (_change(lambda line: line.update(timestamp=1e300)), "too large to be a time"),
    "timestamp negative": (_change(lambda line: line.update(timestamp=-5)), "before 1970"),
    "timestamp in the year 50000 (ISO)": (_change(lambda line: line.update(timestamp="50000-01-01T00:00:00")),
                                          "neither epoch"),
    "timestamp a list": (_change(lambda line: line.update(timestamp=[1])), "neither epoch"),
    "top_logprobs text": (_token(top_logprobs="Hello"), "top_logprobs must be a list"),
    "top_logprobs a number": (_token(top_logprobs=5), "top_logprobs must be a list"),
    "top_logprobs a list of text": (_token(top_logprobs=["Hello", "x"]), "top_logprobs must be a list of objects"),
    "completions top_logprobs a list of lists": (_completion_top([["a", -0.1]], ), "top_logprobs"),
    "completions top_logprobs text values": (_completion_top([{"a": "high"}, None]), "logprob"),
    "logprob NaN": (_token(logprob=math.nan), "finite"),
    "token id above int64": (_token(id=2**64), "token id"),
    "prompt token ids above int64": (
        _change(lambda line: line["response"].update(prompt_token_ids=[1, 2**63])), "prompt token id"),
    "request_index above int32": (_change(lambda line: line.update(request_index=2**40)), "request_index"),
    "response choices text": (_change(lambda line: line["response"].update(choices="none")), "choices"),
    "logprobs content a number": (
        _change(lambda line: line["response"]["choices"][0]["logprobs"].update(content=3)), "logprobs"),
}


def test_each_hostile_line_is_reported_by_place_and_reason_and_the_rest_imported(tmp_path, capsys):
    lines = [exchange(0)]
    expected_problems = {}
    for case, (make, reason) in HOSTILE.items():
        lines.append(make(len(lines)))
        expected_problems[len(lines)] = (case, reason)
        lines.append(exchange(len(lines)))
    path = tmp_path / "agent.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))

    assert main(["-q", "import", str(path), "--run-id", "agent"]) == 1

    err = capsys.readouterr().err
    assert "Traceback" not in err
    for number, (case, reason) in expected_problems.items():
        reported = [line for line in err.splitlines() if line.startswith(f"kvtrace: error: {path}:{number}: ")]
        assert len(reported) == 1 and reason in reported[0], (case, reported, err)
    good = len(lines) - len(HOSTILE)
    assert f"imported {good} request(s)" in err and f"{len(HOSTILE)} line(s) rejected" in err

    assert main(["runs", "--format", "json"]) == 0
    (run,) = json.loads(capsys.readouterr().out)
    assert run["run_id"] == "agent"
    stored = run["requests"]
    assert stored + len(HOSTILE) == len(lines)


@pytest.mark.parametrize("unit, timestamp", [("seconds", 1_718_000_000.25), ("milliseconds", 1_718_000_000_250),
                                             ("microseconds", 1_718_000_000_250_000),
                                             ("nanoseconds", 1_718_000_000_250_000_000)])
def test_epoch_timestamps_in_any_unit_land_at_the_same_time(unit, timestamp, tmp_path, capsys):
    line = exchange(0)
    line["timestamp"] = timestamp
    path = tmp_path / f"{unit}.jsonl"
    path.write_text(json.dumps(line) + "\n")

    assert main(["-q", "import", str(path), "--run-id", unit]) == 0
    assert main(["query", "runs", "--format", "json"]) == 0
    (run,) = json.loads(capsys.readouterr().out)
    assert run["first_seen"].startswith("2024-06-10T06:13:20.25")


def test_a_file_of_garbage_is_reported_by_its_first_lines_and_a_count(tmp_path, capsys):
    path = tmp_path / "garbage.jsonl"
    path.write_text("".join(f"garbage {i}\n" for i in range(10_000)) + json.dumps(exchange(0)) + "\n")

    assert main(["-q", "import", str(path), "--run-id", "garbage"]) == 1

    err = capsys.readouterr().err.splitlines()
    assert "Traceback" not in "\n".join(err)
    listed = [line for line in err if line.startswith(f"kvtrace: error: {path}:")]
    assert [line.split(": ")[2] for line in listed] == [f"{path}:{n}" for n in range(1, 51)]
    assert "kvtrace: error: ... and 9,950 more line(s) rejected (the first 50 are shown)" in err
    assert any("imported 1 request(s)" in line and "10000 line(s) rejected" in line for line in err)
    assert len(err) < 60
