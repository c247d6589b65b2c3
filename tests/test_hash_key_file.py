"""The deployment key in the data home: whoever reads it can confirm guessed prompts, so it is made
readable by its owner only from its first byte (whatever the umask), an existing one others can read
is warned about, and a key too short to be secret is refused with one line before an engine starts."""

from __future__ import annotations

import logging
import os
import stat
import subprocess
import sys

import pytest

from kvtrace.config import load_hash_key
from kvtrace.errors import BadSetting


@pytest.fixture
def data_home(kvtrace_env, monkeypatch):
    monkeypatch.delenv("KVTRACE_HASH_KEY")
    return kvtrace_env / "data" / "kvtrace"


def test_a_new_key_is_owner_only_even_under_a_permissive_umask(data_home):
    previous = os.umask(0)
    try:
        key = load_hash_key()
    finally:
        os.umask(previous)
    path = data_home / "hash.key"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(key) == 32 and path.read_bytes() == key
    assert load_hash_key() == key  # kept: every later process hashes alike
    assert sorted(p.name for p in data_home.iterdir()) == ["hash.key"]  # no half-made file left


def test_processes_that_start_together_agree_on_one_key(data_home):
    read = "from kvtrace.config import load_hash_key; print(load_hash_key().hex())"
    children = [subprocess.Popen([sys.executable, "-c", read], stdout=subprocess.PIPE, text=True) for _ in range(6)]
    keys = {child.communicate(timeout=120)[0].strip() for child in children}
    assert len(keys) == 1 and bytes.fromhex(keys.pop()) == (data_home / "hash.key").read_bytes()


def test_a_key_file_others_can_read_is_used_with_a_warning_once(data_home, caplog):
    data_home.mkdir(parents=True)
    path = data_home / "hash.key"
    path.write_bytes(b"k" * 32)
    path.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="kvtrace"):
        assert load_hash_key() == b"k" * 32
        assert load_hash_key() == b"k" * 32
    warnings = [r.getMessage() for r in caplog.records if "can be read by other users" in r.getMessage()]
    assert len(warnings) == 1 and f"chmod 600 {path}" in warnings[0]


def test_a_key_file_too_short_to_be_secret_is_refused(data_home):
    data_home.mkdir(parents=True)
    (data_home / "hash.key").write_bytes(b"12345678")
    with pytest.raises(BadSetting, match="holds 8 bytes, fewer than 16"):
        load_hash_key()
    run = subprocess.run([sys.executable, "-m", "kvtrace.cli", "run", "--", sys.executable, "-c", "pass"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert "hash key file" in run.stderr
