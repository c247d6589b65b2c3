"""What one experiment runs: the grid of formats × arms × repeats × orders, and its run ids."""

from __future__ import annotations

from dataclasses import dataclass

from kvtrace.testmodels.llama_gguf import QUANTS

ARMS = ("off", "reuse", "prompt-cache", "restore")
"""off: ``reset()`` before every request (full recompute); reuse: in-context KV prefix reuse;
prompt-cache: ``reset()`` then a ``LlamaRAMCache`` restore; restore: reuse, plus a control that
snapshots the state before each request and replays it (must reproduce the request exactly)."""

ORDERS = ("canonical", "shuffled")


@dataclass(frozen=True)
class Plan:
    formats: tuple[str, ...] = ("Q4_0", "Q8_0")
    arms: tuple[str, ...] = ("off", "reuse")
    episodes: int = 16
    turns: int = 4
    tokens: int = 24
    repeats: int = 1
    orders: tuple[str, ...] = ("canonical",)
    seed: int = 0
    prefix: str = "exp"
    n_ctx: int = 1024
    n_threads: int = 1

    def __post_init__(self):
        if not self.formats or not self.arms or not self.orders:
            raise ValueError("formats, arms and orders each need at least one entry")
        for fmt in self.formats:
            if fmt not in QUANTS:
                raise ValueError(f"unknown weight format {fmt!r}; choose from {', '.join(QUANTS)}")
        for arm in self.arms:
            if arm not in ARMS:
                raise ValueError(f"unknown arm {arm!r}; choose from {', '.join(ARMS)}")
        for order in self.orders:
            if order not in ORDERS:
                raise ValueError(f"unknown order {order!r}; choose from {', '.join(ORDERS)}")
        if min(self.episodes, self.turns, self.tokens, self.repeats, self.n_ctx, self.n_threads) < 1:
            raise ValueError("episodes, turns, tokens, repeats, n_ctx and threads must be at least 1")

    def run_id(self, fmt: str, arm: str, repeat: int, order: str) -> str:
        return f"{self.prefix}/{fmt}/{arm}/r{repeat}/{order}"

    def passes(self):
        """(format, arm, repeat, order) in execution order."""
        for fmt in self.formats:
            for repeat in range(self.repeats):
                for order in self.orders:
                    for arm in self.arms:
                        yield fmt, arm, repeat, order
