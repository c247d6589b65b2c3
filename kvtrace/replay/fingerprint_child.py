"""The model-cache search's reading process: ``python -m kvtrace.replay.fingerprint_child FD SPEC_JSON``.

Started by ``model_lookup`` through ``isolation.run_child``, so a file that crashes or hangs llama.cpp
ends only the search. The spec names the files in the order to read them and the fingerprint wanted;
it reports each file's fingerprint and stops at the first that matches.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable, Optional

from kvtrace.experiment.isolation import serve_child
from kvtrace.replay.engine import file_fingerprint
from kvtrace.replay.model_lookup import FingerprintResult


def read_until_found(spec_json: str, result: FingerprintResult, progress: Callable[[str], None]) -> None:
    spec = json.loads(spec_json)
    for path in spec["paths"]:
        progress(f"reading the fingerprint of {path}")
        result.fingerprints[path] = found = file_fingerprint(Path(path))
        result.requests += 1
        if found == spec["wanted"]:
            return


def main(argv: Optional[list[str]] = None) -> int:
    result = FingerprintResult()
    return serve_child(sys.argv[1:] if argv is None else argv, result,
                       lambda spec_json, progress: read_until_found(spec_json, result, progress))


if __name__ == "__main__":
    sys.exit(main())
