"""Capture policy: what of the token content leaves the engine.

Token ids are content.  Modes:

* ``ids``    — plain token ids (research runs);
* ``hashed`` — every generated token id (chosen, top-1, runner-up) replaced by
  a keyed 63-bit hash *of the token in its place*: the request's prompt hash
  and the token's position in the output (the default);
* ``none``   — no per-token ids at all (margins and aggregate hashes stay).

Why the place and not the token alone: a hash of the token id alone is a
substitution cipher of every conversation — the most frequent hashes are the
most frequent tokens, and a tokenizer's statistics recover much of the text.
Hashed in its place, a token compares equal exactly where kvtrace compares
tokens — the same position of two requests whose prompts agree (forks, the
cache-hit vs recompute reference of the margin and flip analyses), and the
chosen vs top-1 id of one position — and is unlinkable everywhere else.
Prompt token ids are recorded with ``ids`` capture only: under ``hashed``
their place would be the prompt itself, so they would say nothing the prompt
hash does not.  The output hash is keyed by the prompt hash for the same
reason: equal outputs of different prompts must not hash alike.

Prompt hashes (128-bit: the place of every token, so two prompts must never
share one), output hashes and block hashes are keyed hashes in every mode;
prompt text is never captured.  Text the client or the upstream wrote that
reaches a record anyway (an error message that repeats the input, sampling
``stop`` strings) is kept with ``ids`` capture, keyed-hashed with ``hashed``
and dropped with ``none``.  docs/privacy.md says what each mode stores.
"""

from __future__ import annotations

import hashlib
import json
import struct
from array import array
from typing import Any, NamedTuple, Optional, Sequence

import numpy as np

from kvtrace import semconv as sc
from kvtrace.recording.packed_arrays import INT64, unpack

_HASH_BYTES = 8
_PROMPT_HASH_BYTES = 16
"""Prompt hashes are 128-bit: at 64 bits, a billion distinct prompts would give ~3 % odds that two of
them share a hash, and with it the keys of every token placed under it."""
_TOKEN_BYTES = 8
_OUTPUT_DOMAIN = b"kvtrace.output"
_TEXT_DOMAIN = b"kvtrace.text"
"""BLAKE2b personalisations (at most 16 bytes): these hashes are apart from every other keyed hash."""
CLIENT_TEXT_SETTINGS = ("stop",)
"""Sampling settings whose values are text the client wrote."""

# --- hashing a token in its place -----------------------------------------------------
#
# hash(context, i, id) = E_i(id) & (2**63 - 1), where E_i is a two-round Even–Mansour cipher
#
#     E_i(x) = P(P(x ^ k0_i) ^ k1_i) ^ k2_i
#
# over P, SplitMix64's output function (a bijection of 64-bit words with full avalanche), and
# (k0_i, k1_i, k2_i) are 192 bits of SHAKE256(deployment key || domain || context) at offset 24*i, the
# context being the request's 128-bit prompt hash (hex): prompts that shared a context would share keys.
#
# Why this shape: this runs on the engine thread for every generated token.  A keyed BLAKE2b per
# (position, id) costs ~1 µs per call in CPython (~2.3 µs per output token for chosen, top-1 and
# runner-up, measured), and SipHash written in numpy ~100-600 µs per request in ufunc overhead.
# Here the secret part is one call of a standard PRF per request (SHAKE256 keyed by prefix, the
# construction of KMAC; its output is a prefix-stable stream, so position i gets the same keys
# whatever the output length), and the per-token part is a few integer operations: in the compiled
# twin (``_placehash.c``, one call over all three arrays) ~0.1 µs per output token, most of it
# SHAKE's 24 bytes; in numpy (where it was not built) ~15 array operations, ~20 µs per request plus
# ~0.25 µs per output token.
#
# Why it is safe: every (context, position) has its own unpredictable 192-bit key, used only for
# the few ids that occur there (chosen, top-1 and runner-up, and the same ids again when the same
# prompt is sent again) — the setting in which Even–Mansour hides its input (provably so for an
# ideal permutation, far beyond a few thousand uses per key).  The outer key k2 means the public
# P cannot be peeled off, so two ids of one position reveal no relation between them (with
# `P(x ^ k)` alone, two hashes would give away `x ^ y`).  Even someone who broke the mixer's
# structure for one position would learn that position's key and nothing more: no key repeats
# across positions or prompts, so nothing links them.  P is a bijection, so distinct ids of one
# position never share a hash before the top bit is cleared (63 bits: the Int64 columns keep -1
# for "no token").

_PLACE_DOMAIN = b"kvtrace.output_token_at_position\0"
_ROUNDS = 2
_U64 = np.uint64
_MIX_1, _MIX_2 = _U64(0xBF58476D1CE4E5B9), _U64(0x94D049BB133111EB)
_SHIFT_30, _SHIFT_27, _SHIFT_31 = _U64(30), _U64(27), _U64(31)
_LOW_63 = _U64(0x7FFFFFFFFFFFFFFF)
_MISSING = -1
"""A negative id means "no token here" (e.g. no runner-up reported); it stays -1 in every mode."""


def _mix(z: np.ndarray, scratch: np.ndarray) -> None:
    """SplitMix64's output function, in place (uint64 arithmetic wraps, as it should)."""
    np.right_shift(z, _SHIFT_30, out=scratch)
    z ^= scratch
    z *= _MIX_1
    np.right_shift(z, _SHIFT_27, out=scratch)
    z ^= scratch
    z *= _MIX_2
    np.right_shift(z, _SHIFT_31, out=scratch)
    z ^= scratch


class OutputTokenIds(NamedTuple):
    """A request's generated ids as they may leave the process (parallel sequences of ints: lists with
    ``ids`` capture, ``array('q')`` when hashed, which the spool packs without touching an element)."""

    chosen: Sequence[int]
    top1: Sequence[int]
    runner_up: Sequence[int]


CHAIN_MEMO_BLOCKS = 16_384
"""Prompt blocks whose chained hash :meth:`CapturePolicy.block_hashes_packed` remembers (about 400 bytes
each, all let go when full): a conversation's next prompt repeats the last one, whose blocks were hashed
for the last span."""


class CapturePolicy:
    def __init__(self, mode: str, key: bytes):
        self.mode = mode
        self._key = hashlib.blake2b(key, digest_size=32).digest()  # normalise any key length to 32 bytes
        self._place_stream = hashlib.shake_256(self._key + _PLACE_DOMAIN)
        self._keyed: dict[tuple[int, bytes], Any] = {}
        self._chain_memo: dict[bytes, tuple[bytes, bytes, str]] = {}
        """A block's parent hash → (the block's tokens last hashed after it, its hash, as hex)."""

    def _keyed_state(self, size: int, domain: bytes) -> Any:
        """A BLAKE2b state with the key already absorbed, copied for each hash: keying a new one costs a
        compression and the constructor's arguments, half of hashing a 16-token block."""
        state = self._keyed.get((size, domain))
        if state is None:
            state = self._keyed[size, domain] = hashlib.blake2b(key=self._key, digest_size=size, person=domain)
        return state

    def _digest(self, payload: bytes, parent: bytes = b"", size: int = _HASH_BYTES, domain: bytes = b"") -> bytes:
        hashed = self._keyed_state(size, domain).copy()
        hashed.update(parent)
        hashed.update(payload)
        return hashed.digest()

    def hash_tokens(self, tokens: Sequence[int]) -> str:
        """Keyed 128-bit hash of a whole token sequence (prompt hash, cache-key hash)."""
        return self.hash_packed(pack_tokens(tokens))

    def hash_packed(self, packed: bytes) -> str:
        """:meth:`hash_tokens` of tokens already packed by :func:`pack_tokens`."""
        return self._digest(packed, size=_PROMPT_HASH_BYTES).hex()

    def output_hash(self, prompt_hash: Optional[str], tokens: Sequence[int]) -> str:
        """Keyed hash of a request's generated ids under its prompt hash: the same output hashes alike
        only under the same prompt (a one-token output hashed alone would be a substitution cipher)."""
        return self._digest(pack_tokens(tokens), (prompt_hash or "").encode() + b"\0", domain=_OUTPUT_DOMAIN).hex()

    def client_text(self, context: Optional[str], text: str) -> Optional[str]:
        """Text the client or the upstream wrote, as this policy lets it leave the process: as it is
        with ``ids`` capture, ``None`` with ``none``, and with ``hashed`` its keyed hash under the
        request's prompt hash (``context``), so that, like a token, it compares equal only in its place:
        hashed alone, a few common texts (stop strings, error messages) would be told by their counts."""
        if self.mode == sc.CAPTURE_IDS:
            return text
        if self.mode == sc.CAPTURE_NONE:
            return None
        return self._digest(text.encode("utf-8", "surrogatepass"), (context or "").encode() + b"\0",
                            domain=_TEXT_DOMAIN).hex()

    def error_text(self, context: Optional[str], error: str, detail: Optional[str]) -> str:
        """A span's status message: kvtrace's own words (``error``) and, as :meth:`client_text` lets
        it, the engine's or upstream's text (``detail``), which may repeat the client's input."""
        if not detail:
            return error
        kept = self.client_text(context, detail)
        if kept is None:
            return f"{error} (message not captured)"
        if self.mode == sc.CAPTURE_IDS:
            return f"{error}: {kept}"
        return f"{error} (message keyed-hashed: {kept})"

    def sampling_settings(self, context: Optional[str], settings: dict[str, Any]) -> dict[str, Any]:
        """A request's sampling settings with the client's text in them (``stop`` strings) as
        :meth:`client_text` lets it leave: kept, keyed-hashed (one hash of the whole value) or left out."""
        if self.mode == sc.CAPTURE_IDS or settings.keys().isdisjoint(CLIENT_TEXT_SETTINGS):
            return settings
        kept = dict(settings)
        for name in CLIENT_TEXT_SETTINGS:
            if name in kept:
                text = self.client_text(context, json.dumps(kept.pop(name), sort_keys=True, ensure_ascii=False))
                if text is not None:
                    kept[name] = text
        return kept

    def block_hashes(self, tokens: Sequence[int], block_size: int) -> list[str]:
        """Chained keyed hashes over full blocks of ``block_size`` tokens.

        Block i's hash covers block i's tokens and block i-1's hash, so equal
        hashes mean equal prefixes (like vLLM's block hashes).  A trailing
        partial block is not hashed.
        """
        return self.block_hashes_packed(pack_tokens(tokens), block_size)

    def block_hashes_packed(self, packed: bytes, block_size: int) -> list[str]:
        """:meth:`block_hashes` of tokens already packed by :func:`pack_tokens`.

        A block that follows the same parent hash as a block hashed before, with the same tokens, takes
        that hash from memory (a look-up and a comparison of its bytes, a quarter of hashing it): a
        conversation's turns, each the last prompt and more, hash only what is new.
        """
        width = block_size * _TOKEN_BYTES
        keyed = self._keyed_state(_HASH_BYTES, b"").copy
        memo = self._chain_memo
        if len(memo) > CHAIN_MEMO_BLOCKS:
            memo.clear()  # one dict operation: another thread reading it meanwhile finds less, never wrong
        out: list[str] = []
        parent = b""
        for start in range(0, len(packed) - width + 1, width):
            block = packed[start : start + width]
            known = memo.get(parent)
            if known is not None and known[0] == block:
                parent = known[1]
                out.append(known[2])
                continue
            hashed = keyed()
            hashed.update(parent)
            hashed.update(block)
            digest = hashed.digest()
            text = digest.hex()
            memo[parent] = (block, digest, text)
            parent = digest
            out.append(text)
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

    def prompt_token_ids(self, tokens: Sequence[int]) -> Optional[list[int]]:
        """Prompt token ids as this policy lets them leave the process: with ``ids`` capture only."""
        if self.mode == sc.CAPTURE_IDS:
            return [int(t) for t in tokens]
        return None

    def output_token_ids(self, context: Optional[str], chosen: Sequence[int], top1: Sequence[int],
                         runner_up: Sequence[int]) -> Optional[OutputTokenIds]:
        """Generated ids as this policy lets them leave the process (``None``: not at all).

        ``context`` is the request's (128-bit) prompt hash.  With ``hashed`` capture the
        i-th entry of every list is hashed under the key of (context, i), so a
        chosen token equal to the top-1 token stays equal, and the same token
        at the same position of a request with the same prompt hash gets the
        same hash.  Without a context there is nothing to tie a token to that
        another run could share: no ids leave (outputs compare by hash).
        """
        if self.mode == sc.CAPTURE_IDS:
            return OutputTokenIds([int(t) for t in chosen], [int(t) for t in top1], [int(t) for t in runner_up])
        if self.mode == sc.CAPTURE_NONE or not context:
            return None
        return OutputTokenIds(*self.hash_at_positions(context, (chosen, top1, runner_up)))

    def hash_at_positions(self, context: str, arrays: Sequence[Sequence[int]]) -> list[array]:
        """Each array's i-th id hashed under the key of (``context``, i), as ``array('q')``; see the
        comment above."""
        length = max(map(len, arrays), default=0)
        if length == 0:
            return [array(INT64) for _ in arrays]
        stream = self._place_stream.copy()
        stream.update(context.encode())
        keys = stream.digest(8 * (_ROUNDS + 1) * length)
        if COMPILED is not None:
            return [unpack(hashed, INT64) for hashed in COMPILED.encrypt_ids(keys, arrays)]
        return encrypt_numpy(keys, arrays)


def encrypt_numpy(keys: bytes, arrays: Sequence[Sequence[int]]) -> list[array]:
    """``_placehash.encrypt_ids`` in numpy, as ``array('q')``: the same bits (tests hold them equal)."""
    length = len(keys) // (8 * (_ROUNDS + 1))
    per_position = np.frombuffer(keys, dtype="<u8").reshape(length, _ROUNDS + 1).T
    if all(len(a) == length for a in arrays):  # the common case: one pass over all of them
        return [array(INT64, row) for row in _encrypt(np.array(arrays, dtype=np.int64), per_position).tolist()]
    return [array(INT64, _encrypt(np.array(a, dtype=np.int64), per_position[:, : len(a)]).tolist()) if len(a)
            else array(INT64) for a in arrays]


def _encrypt(ids: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """E_i(id) & (2**63 - 1) along the last axis of ``ids`` (``keys``: rounds + 1 rows, one column per i)."""
    z = ids.view(_U64) ^ keys[0]
    scratch = np.empty_like(z)
    for r in range(1, _ROUNDS + 1):
        _mix(z, scratch)
        z ^= keys[r]
    z &= _LOW_63
    hashed = z.view(np.int64)
    missing = ids < 0
    if missing.any():
        hashed[missing] = _MISSING
    return hashed


def _load_compiled():
    try:
        # Deferred: an optional extension; where it was not built (no C compiler) numpy does the same.
        from kvtrace.recording import _placehash
    except ImportError:
        return None
    return _placehash


COMPILED = _load_compiled()
"""The compiled twin of :func:`encrypt_numpy`, ``None`` where it was not built."""


def pack_tokens(tokens: Sequence[int]) -> bytes:
    """Token ids as little-endian int64, what every hash of token ids reads (numpy integers pack as they
    are: struct takes __index__)."""
    return struct.pack(f"<{len(tokens)}q", *tokens)
