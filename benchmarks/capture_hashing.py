"""Cost of hashed capture on the engine thread: one request's chosen, top-1 and runner-up ids.

Compares, for outputs of several lengths, side by side in one run:

* ``token alone (memo)`` — the earlier scheme: one keyed BLAKE2b per distinct token id, memoised
  for the life of the key (fast, but a substitution cipher of every conversation);
* ``blake2b per place``  — one keyed BLAKE2b per (prompt hash, position, id);
* ``capture policy``     — ``CapturePolicy.output_token_ids``, what the recorder calls: one SHAKE256
  call per request for per-position keys, then a vectorised Even–Mansour step over all three arrays.

Prints microseconds per request and per output token (best of --repeat rounds), and the policy's
cost relative to the memoised scheme.

    python benchmarks/capture_hashing.py [--lengths 1 16 64 256 1024] [--requests 300] [--repeat 5]
"""

from __future__ import annotations

import argparse
import hashlib
import random
import struct
import time

from kvtrace.recording.capture import CapturePolicy


def token_alone(key: bytes):
    memo: dict[int, int] = {}

    def hash_ids(context: str, *arrays):
        out = []
        for tokens in arrays:
            hashed = []
            for t in tokens:
                h = memo.get(t)
                if h is None:
                    digest = hashlib.blake2b(struct.pack("<q", t), key=key, digest_size=8).digest()
                    h = memo[t] = int.from_bytes(digest, "little") >> 1
                hashed.append(h)
            out.append(hashed)
        return out

    return hash_ids


def blake2b_per_place(key: bytes):
    pack = struct.Struct("<qq").pack

    def hash_ids(context: str, *arrays):
        base = hashlib.blake2b(context.encode(), key=key, digest_size=8)
        out = []
        for tokens in arrays:
            hashed = []
            for i, t in enumerate(tokens):
                h = base.copy()
                h.update(pack(i, t))
                hashed.append(int.from_bytes(h.digest(), "little") >> 1)
            out.append(hashed)
        return out

    return hash_ids


def capture_policy(key: bytes):
    policy = CapturePolicy("hashed", key)
    return policy.output_token_ids


def best_seconds(fn, requests, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        for context, chosen, top1, runner_up in requests:
            fn(context, chosen, top1, runner_up)
        best = min(best, time.perf_counter() - t)
    return best / len(requests)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1, 16, 64, 256, 1024])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    key = hashlib.blake2b(b"benchmark", digest_size=32).digest()
    rng = random.Random(3)
    arms = {"token alone (memo)": token_alone(key), "blake2b per place": blake2b_per_place(key),
            "capture policy": capture_policy(key)}
    print(f"{'tokens':>6}  " + "  ".join(f"{name:>26}" for name in arms) + "  policy/memo")
    for length in args.lengths:
        requests = []
        for i in range(args.requests):
            chosen = [rng.randrange(32000) for _ in range(length)]
            requests.append((f"{rng.getrandbits(64):016x}", chosen, list(chosen),
                             [rng.randrange(32000) for _ in range(length)]))
        seconds = {name: best_seconds(fn, requests, args.repeat) for name, fn in arms.items()}
        cells = [f"{s * 1e6:9.1f} us/req {s / length * 1e6:6.2f} us/tok" for s in seconds.values()]
        ratio = seconds["capture policy"] / seconds["token alone (memo)"]
        print(f"{length:>6}  " + "  ".join(cells) + f"  {ratio:10.2f}x")


if __name__ == "__main__":
    main()
