"""The child side of an isolated pass: ``python -m kvtrace.experiment.pass_process FD PASS_JSON``.

It patches llama-cpp-python, runs the pass through this process's recorder (configured by the
inherited ``KVTRACE_*`` environment), shuts the recorder down so every finished request is in the
spool, and only then writes its result to FD: a result in the parent's hands means the spool is
complete. Ctrl-C (forwarded by the parent) stops between requests, as an in-process run did.
"""

from __future__ import annotations

import sys
from typing import Optional

from kvtrace.experiment.isolation import PassResult, PassSpec, serve_child
from kvtrace.experiment.runner import run_pass
from kvtrace.patches import llama_cpp as llama_patch
from kvtrace.recording.recorder import get_recorder


def main(argv: Optional[list[str]] = None) -> int:
    llama_patch.patch()
    recorder = get_recorder()
    result = PassResult()

    def job(spec_json: str, progress) -> None:
        spec = PassSpec.from_json(spec_json)
        run_pass(spec.plan, spec.model, spec.key, spec.run_id, result, progress)

    return serve_child(sys.argv[1:] if argv is None else argv, result, job,
                       finish=recorder.shutdown if recorder is not None else lambda: None)


if __name__ == "__main__":
    sys.exit(main())
