"""The newest vLLM kvtrace supports still has every name kvtrace's hooks rely on.

Reads the release's own wheel (the CUDA build, fetched once with ``pip download --no-deps`` into
``~/.cache/kvtrace/vllm-wheels``) as AST: vLLM need not be importable, or installed at all.  Under
CI a wheel that cannot be fetched fails the test (tests/conftest.py turns skips into failures).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

from kvtrace.patches.vllm.common import SUPPORTED

NEWEST_CHECKED = "0.34.0"
"""The newest vLLM release checked; ``SUPPORTED`` ends right after its series."""

WHEELS = Path.home() / ".cache" / "kvtrace" / "vllm-wheels"


def test_the_supported_range_ends_with_the_release_that_was_checked():
    major, minor, _ = NEWEST_CHECKED.split(".")
    supported = SpecifierSet(SUPPORTED)
    assert NEWEST_CHECKED in supported
    assert f"{major}.{int(minor) + 1}.0" not in supported, (
        f"vLLM {SUPPORTED} admits a series newer than {NEWEST_CHECKED}: check it and raise NEWEST_CHECKED")


def newest_wheel() -> Path:
    found = sorted(WHEELS.glob(f"vllm-{NEWEST_CHECKED}-*.whl"))
    if found:
        return found[0]
    WHEELS.mkdir(parents=True, exist_ok=True)
    done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                           f"vllm=={NEWEST_CHECKED}", "-d", str(WHEELS)], capture_output=True, text=True, timeout=1500)
    found = sorted(WHEELS.glob(f"vllm-{NEWEST_CHECKED}-*.whl"))
    if not found:
        pytest.skip(f"could not download vllm=={NEWEST_CHECKED}: {done.stderr.strip().splitlines()[-1:]}")
    return found[0]


@pytest.mark.slow
@pytest.mark.timeout(1800)  # a first run downloads the wheel (about 240 MB)
def test_the_newest_supported_vllm_has_every_name_the_hooks_rely_on():
    done = subprocess.run([sys.executable, "-m", "kvtrace.patches.vllm.surface_check", str(newest_wheel())],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"vLLM {NEWEST_CHECKED}: every feature has its targets" in done.stdout
