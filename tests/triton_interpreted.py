"""Runs in a child process of tests/test_vllm_row_kernel.py: Triton chooses its interpreter when it is
imported, so the child sets ``TRITON_INTERPRET=1`` (:func:`start`) before anything imports Triton."""

from __future__ import annotations

import os


def start() -> None:
    os.environ["TRITON_INTERPRET"] = "1"


def device_rows(logits, ids, sampled=None):
    """``row_stats.device_rows`` with CPU tensors sent to the kernel: its rows as lists, and whether the
    kernel stayed in use (a failed launch would have turned it off and taken the torch path)."""
    from kvtrace.patches.vllm import row_stats

    row_stats.KERNEL_DEVICES.add("cpu")
    stats = row_stats.device_rows(logits, ids, sampled)
    return stats.tolist(), "cpu" in row_stats.KERNEL_DEVICES
