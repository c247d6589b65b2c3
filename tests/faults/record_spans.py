"""A host process that records synthetic request spans through kvtrace's process recorder, then exits.

    python record_spans.py N [TOKENS]

Settings come from the environment, as in an engine process; the recorder is
created lazily by ``get_recorder()`` (as an engine hook does) and shut down by
its ``atexit`` hook when the script ends. No engine is needed: the records are
filled like ``kvtrace selfcheck`` fills them.
"""

import sys

from kvtrace import semconv
from kvtrace.recording.recorder import get_recorder


def main() -> int:
    spans = int(sys.argv[1])
    tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 16
    recorder = get_recorder()
    if recorder is None:
        print("untraced", flush=True)
        return 0
    for i in range(spans):
        record = recorder.start_request("fault_test", model="synthetic")
        record.prompt_token_ids = [(i * 7 + j) % 32000 for j in range(40)]
        record.prompt_tokens = record.recomputed_tokens = 40
        record.cache_layer = semconv.LAYER_NONE
        for t in range(tokens):
            record.add_token(t, t, t + 1, 0.25 + t / 1000, -0.5)
        recorder.finish(record)
    print(f"finished {spans}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
