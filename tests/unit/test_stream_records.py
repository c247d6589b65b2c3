"""A streamed (or whole) answer's record reads what it read before the reading was made cheaper: every
case of stream_cases.py against the readings kept in data/stream_records.json, written by the tree
before (``python tests/unit/stream_cases.py > tests/unit/data/stream_records.json`` from that tree)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stream_cases import cases, reading

EXPECTED = json.loads((Path(__file__).parent / "data" / "stream_records.json").read_text())
CASES = cases()


def test_every_case_has_a_kept_reading():
    assert sorted(CASES) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(CASES))
def test_an_answer_is_read_into_the_same_record_as_before(name):
    assert json.loads(json.dumps(reading(*CASES[name]))) == EXPECTED[name]


def test_a_malformed_event_is_passed_over_and_the_events_around_it_still_read():
    read = reading(*CASES["a malformed event"])
    assert read["exchange"]["token_ids"] == [100, 101]
