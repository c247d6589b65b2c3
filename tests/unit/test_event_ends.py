"""Where a stream's last whole event ends, as the proxy's relay finds it before cutting a chunk."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtrace.proxy.app import _last_event_end


def by_definition(buffer: bytes) -> int:
    lf, crlf = buffer.rfind(b"\n\n"), buffer.rfind(b"\r\n\r\n")
    return max(lf + 2 if lf != -1 else 0, crlf + 4 if crlf != -1 else 0)


@settings(max_examples=500, deadline=None, database=None)
@given(buffer=st.lists(st.sampled_from([b"a", b"\r", b"\n", b"\r\n", b"\n\n", b"\r\n\r\n", b"data: {}"]),
                       max_size=30).map(b"".join))
def test_the_last_event_ends_after_the_last_blank_line_whichever_line_ends_the_stream_uses(buffer):
    assert _last_event_end(buffer) == by_definition(buffer)


def test_a_crlf_event_after_lf_ones_and_an_lf_event_after_crlf_ones():
    assert _last_event_end(b"data: 1\n\ndata: 2\r\n\r\ndata: 3") == len(b"data: 1\n\ndata: 2\r\n\r\n")
    assert _last_event_end(b"data: 1\r\n\r\ndata: 2\n\ndata: 3") == len(b"data: 1\r\n\r\ndata: 2\n\n")
    assert _last_event_end(b"data: 1\r\n\r\n") == len(b"data: 1\r\n\r\n")
    assert _last_event_end(b"data: 1\r\n") == 0
