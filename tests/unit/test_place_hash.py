"""Generated token ids hashed in their place: the compiled helper, its numpy twin and the stored hashes agree.

A hash that changed between versions would make a run recorded before an upgrade look forked
from every run recorded after it, so the values themselves are pinned, not only the two
implementations against each other.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvtrace.recording import capture
from kvtrace.recording.capture import CapturePolicy, encrypt_numpy

KEY = b"deployment key"

# Hashes written by the release before the compiled helper, for prompt [1, 2, 3] under KEY.
PINNED_IDS = ([7, 8, 2**62, -1], [7, 9, 0, 5], [9, -1, 1, 4])
PINNED_HASHES = (
    [2094516970779847597, 5708299883339700205, 7792778412523520214, -1],
    [2094516970779847597, 92404071727064432, 7393052468213980691, 7813144138520808002],
    [4590765804561816697, -1, 4544437284733167835, 4018417306167806589],
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


def test_hashes_are_the_ones_earlier_releases_stored(policy):
    context = policy.hash_tokens([1, 2, 3])
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
