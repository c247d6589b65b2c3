"""The child side of an isolated pass: ``python -m kvtrace.experiment.pass_process FD PASS_JSON``.

It patches llama-cpp-python (vLLM patches itself through kvtrace's plugin entry point when the
pass starts its engine), runs the pass through this process's recorder (configured by the
inherited ``KVTRACE_*`` environment), shuts the recorder down so every finished request is in the
spool, and only then writes its result to FD: a result in the parent's hands means the spool is
complete. Ctrl-C (forwarded by the parent) stops between requests, as an in-process run did.
"""

from __future__ import annotations

import sys
from typing import Optional

from kvtrace.experiment import runner, vllm_pass
from kvtrace.experiment.isolation import PassResult, PassSpec, serve_child
from kvtrace.patches import llama_cpp as llama_patch
from kvtrace.recording.recorder import get_recorder


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec = PassSpec.from_json(argv[1])
    if spec.plan.engine == "vllm":
        run_engine_pass = vllm_pass.run_pass  # vLLM loads kvtrace's plugin itself
    else:
        llama_patch.patch()
        run_engine_pass = runner.run_pass
    recorder = get_recorder()
    result = PassResult()

    def job(_spec_json: str, progress) -> None:
        run_engine_pass(spec.plan, spec.model, spec.key, spec.run_id, result, progress)

    return serve_child(argv, result, job, finish=recorder.shutdown if recorder is not None else lambda: None)


if __name__ == "__main__":
    sys.exit(main())
