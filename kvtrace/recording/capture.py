"""Capture policy: what of the token content leaves the engine.

Token ids are content.  Modes:

* ``ids``    — plain token ids (research runs);
* ``hashed`` — every token id replaced by a keyed hash (63-bit integer), so
  equality across runs survives but content cannot be recovered without the
  deployment key (the default);
* ``none``   — no per-token ids at all (margins and aggregate hashes stay).

Prompt hashes and block hashes are keyed hashes in every mode; prompt text is
never captured.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Optional, Sequence

from kvtrace import semconv as sc

_HASH_BYTES = 8


class CapturePolicy:
    def __init__(self, mode: str, key: bytes):
        self.mode = mode
        self._key = hashlib.blake2b(key, digest_size=32).digest()  # normalise any key length to 32 bytes
        self._token_memo: dict[int, int] = {}

    def _digest(self, payload: bytes, parent: bytes = b"") -> bytes:
        return hashlib.blake2b(parent + payload, key=self._key, digest_size=_HASH_BYTES).digest()

    def hash_tokens(self, tokens: Sequence[int]) -> str:
        """Keyed hash of a whole token sequence (prompt hash, cache-key hash)."""
        return self._digest(_pack(tokens)).hex()

    def block_hashes(self, tokens: Sequence[int], block_size: int) -> list[str]:
        """Chained keyed hashes over full blocks of ``block_size`` tokens.

        Block i's hash covers block i's tokens and block i-1's hash, so equal
        hashes mean equal prefixes (like vLLM's block hashes).  A trailing
        partial block is not hashed.
        """
        packed = _pack(tokens)  # once: each block is a slice of the same bytes
        width = block_size * _TOKEN_BYTES
        out: list[str] = []
        parent = b""
        for start in range(0, len(packed) - width + 1, width):
            parent = self._digest(packed[start : start + width], parent)
            out.append(parent.hex())
        return out

    def engine_hash(self, engine_hash_hex: str) -> str:
        """A content hash computed by the engine itself (vLLM's block hashes), as it may leave the process.

        Unchanged with ``ids`` capture, so it matches the engine's own events;
        keyed otherwise: an engine's unkeyed hash of token ids lets anyone
        confirm a guessed prompt.  Equal inputs still give equal outputs.
        """
        if self.mode == sc.CAPTURE_IDS:
            return engine_hash_hex
        return self._digest(engine_hash_hex.encode(), b"engine:").hex()

    def token_ids(self, tokens: Sequence[int]) -> Optional[list[int]]:
        """Token ids as this policy lets them leave the process (``None``: not at all)."""
        if self.mode == sc.CAPTURE_IDS:
            return [int(t) for t in tokens]
        if self.mode == sc.CAPTURE_NONE:
            return None
        memo = self._token_memo
        out = []
        for t in tokens:
            h = memo.get(t)
            if h is None:
                h = int.from_bytes(self._digest(struct.pack("<q", int(t))), "little") >> 1
                memo[t] = h
            out.append(h)
        return out


_TOKEN_BYTES = 8


def _pack(tokens: Sequence[int]) -> bytes:
    """Token ids as little-endian int64 (numpy integers pack as they are: struct takes __index__)."""
    return struct.pack(f"<{len(tokens)}q", *tokens)
