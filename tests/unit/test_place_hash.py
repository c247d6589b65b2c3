"""Generated token ids hashed in their place: the compiled helper, its numpy twin and the stored hashes agree.

A hash that changed between versions would make a run recorded before an upgrade look forked
from every run recorded after it, so the values themselves are pinned, not only the two
implementations against each other (a change of them is a change of the docs/privacy.md scheme).
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvtrace.recording import capture
from kvtrace.recording.capture import CapturePolicy, encrypt_numpy

KEY = b"deployment key"

# Hashes of the 128-bit prompt-hash context (earlier releases placed tokens under a 64-bit prompt hash,
# whose hashes compare with none of these), for prompt [1, 2, 3] under KEY.
PINNED_PROMPT_HASH = "df761e2b4d01d7b5e33011859c91083b"
PINNED_IDS = ([7, 8, 2**62, -1], [7, 9, 0, 5], [9, -1, 1, 4])
PINNED_HASHES = (
    [8765039313435853461, 3267352345394795200, 6273265719429295009, -1],
    [8765039313435853461, 1666480101052370876, 1883005927551290974, 5033409480854916474],
    [8737887234612177402, -1, 4970619545628697881, 417996104270515321],
)


def compiled_module():
    return pytest.importorskip("kvtrace.recording._placehash",
                               reason="the compiled helper was not built (no C compiler at install)")


@pytest.fixture(params=["compiled", "numpy"])
def policy(request, monkeypatch):
    if request.param == "numpy":
        monkeypatch.setattr(capture, "COMPILED", None)
    else:
        monkeypatch.setattr(capture, "COMPILED", compiled_module())
    return CapturePolicy("hashed", KEY)


def test_hashes_stay_the_ones_this_scheme_stores(policy):
    context = policy.hash_tokens([1, 2, 3])
    assert context == PINNED_PROMPT_HASH  # 128 bits: the place of every token hashed under it
    hashed = policy.output_token_ids(context, *PINNED_IDS)
    assert tuple(list(ids) for ids in hashed) == PINNED_HASHES


def test_the_compiled_helper_and_numpy_give_the_same_bits():
    compiled = compiled_module()
    rng = random.Random(5)
    for case in range(200):
        length = rng.choice([1, 2, 7, 100, 513])
        keys = rng.randbytes(24 * length)
        arrays = []
        for _ in range(3):
            n = length if case % 4 else rng.randrange(length + 1)  # sometimes shorter than the keys
            ids = [rng.choice([-1, 0, rng.randrange(2**15), rng.randrange(2**63)]) for _ in range(n)]
            arrays.append(np.array(ids, dtype=np.int64) if case % 5 == 0 else ids)  # numpy ints too
        expected = [list(a) for a in encrypt_numpy(keys, arrays)]
        assert [np.frombuffer(b, dtype="<i8").tolist() for b in compiled.encrypt_ids(keys, arrays)] == expected


def test_bad_ids_raise_a_python_error_not_a_crash():
    compiled = compiled_module()
    keys = bytes(24 * 2)
    with pytest.raises(OverflowError):
        compiled.encrypt_ids(keys, [[2**64]])
    with pytest.raises(TypeError):
        compiled.encrypt_ids(keys, [["7"]])
    with pytest.raises(ValueError):
        compiled.encrypt_ids(keys, [[1, 2, 3]])  # more ids than keyed positions
