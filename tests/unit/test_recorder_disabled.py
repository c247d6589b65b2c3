"""With recording disabled, asking for the process recorder is a look at the environment: engine hooks
and the proxy ask on every call or request, and reading every setting (the hash key's file among
them) cost about 90 µs each time."""

from __future__ import annotations

from kvtrace.config import Settings
from kvtrace.recording import recorder as recorder_module


def test_a_disabled_process_gets_no_recorder_without_its_settings_being_read(monkeypatch):
    reads: list[int] = []
    real_from_env = Settings.from_env.__func__

    def counted(cls, environ=None):
        reads.append(1)
        return real_from_env(cls, environ)

    monkeypatch.setattr(Settings, "from_env", classmethod(counted))
    monkeypatch.setenv("KVTRACE_DISABLED", "1")
    assert [recorder_module.get_recorder() for _ in range(3)] == [None] * 3
    assert reads == []

    monkeypatch.delenv("KVTRACE_DISABLED")  # asked each time: enabled again, a recorder is made
    made = recorder_module.get_recorder()
    assert made is not None and reads == [1]
