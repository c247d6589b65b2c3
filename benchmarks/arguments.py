"""What the benchmark scripts' command lines share."""

from __future__ import annotations

import argparse


def positive_integers(text: str) -> list[int]:
    """A comma-separated list of integers, each at least 1 (``--batch 1,8,32``, ``--concurrency 1,8``)."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"each value must be at least 1: {text!r}")
    return values
