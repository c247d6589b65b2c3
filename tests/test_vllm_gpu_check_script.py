"""``benchmarks/gpu_check.py`` runs only where a GPU is lent, so its ``--cpu`` mode runs it here: every
configuration (the V2 runner and async scheduling too, tests/vllm_cpu_runners.py), so a GPU's few minutes
are not lost to the script itself."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("triton")

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.py"


def test_every_configuration_runs_traced_and_untraced_with_nothing_cut(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--cpu", "--batch", "3", "--max-tokens", "4", "--rounds", "1",
                           "--model", str(tmp_path / "model")], capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {line.split()[0]: line.split() for line in done.stdout.splitlines()
            if line.split() and line.split()[0] in ("v2-async", "v2-sync", "v1-async", "v1-sync")}
    assert sorted(rows) == ["v1-async", "v1-sync", "v2-async", "v2-sync"], done.stdout
    for config, (_, batch, untraced, ratio, peak, syncs, errors, margin_diff, cut) in rows.items():
        assert batch == "3" and float(untraced) > 0 and float(ratio) > 0 and peak == "-", config
        assert syncs == errors == cut == "0", config
        assert float(margin_diff) < 1e-4, config  # kvtrace's margins against vLLM's own logprobs=2
