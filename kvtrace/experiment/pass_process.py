"""The child side of an isolated pass: ``python -m kvtrace.experiment.pass_process FD PASS_JSON``.

It patches llama-cpp-python (vLLM patches itself through kvtrace's plugin entry point when the
pass starts its engine), runs the pass through this process's recorder (configured by the
inherited ``KVTRACE_*`` environment), shuts the recorder down so every finished request is in the
spool, and only then writes its result to FD: a result in the parent's hands means the spool is
complete. Ctrl-C (forwarded by the parent) stops between requests, as an in-process run did.
"""

from __future__ import annotations

import os
import resource
import sys
from typing import Optional

from kvtrace.experiment.isolation import PassResult, PassSpec, progress_message, result_message
from kvtrace.experiment import runner, vllm_pass
from kvtrace.patches import llama_cpp as llama_patch
from kvtrace.recording.recorder import get_recorder


def main(argv: Optional[list[str]] = None) -> int:
    fd, spec_json = sys.argv[1:] if argv is None else argv
    report = os.fdopen(int(fd), "w", buffering=1)
    spec = PassSpec.from_json(spec_json)
    if spec.plan.engine == "vllm":
        run_engine_pass = vllm_pass.run_pass
    else:
        llama_patch.patch()
        run_engine_pass = runner.run_pass
    recorder = get_recorder()
    result = PassResult()

    def progress(text: str) -> None:
        report.write(progress_message(text, result) + "\n")

    try:
        run_engine_pass(spec.plan, spec.model, spec.key, spec.run_id, result, progress)
    except KeyboardInterrupt:
        result.interrupted = True
    except BrokenPipeError:
        return 1  # the parent is gone: nobody waits for this pass (what it recorded is still flushed)
    finally:
        if recorder is not None:
            recorder.shutdown()
    result.peak_rss_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    report.write(result_message(result) + "\n")
    report.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
