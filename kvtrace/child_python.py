"""The command line for a Python child process of kvtrace's: ``python -m MODULE`` that imports the
installed kvtrace whatever the working directory.

A plain ``python -m`` puts the working directory first on ``sys.path``; run from a clone of kvtrace's
repository, the child would import the clone's ``kvtrace/`` folder (which lacks the ``patches``,
``collectors`` and ``queries`` an install maps in), and anywhere else a module planted in the working
directory would run inside kvtrace's child.  ``-P`` (Python 3.11+) leaves it out; on 3.10 the child
drops it itself before it imports anything of ours.
"""

from __future__ import annotations

import sys

# Python 3.10 has no -P: ``-c`` puts '' (the working directory) first; drop it, then run the module.
_RUN_MODULE_WITHOUT_WORKING_DIRECTORY = (
    "import runpy, sys; del sys.path[0]; del sys.argv[0]; "
    "runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)")


def python_module_command(module: str, *arguments: str) -> list[str]:
    """``[python, …, module, *arguments]``: run ``module`` as ``__main__`` in a fresh interpreter (this
    one's executable), with the working directory kept off ``sys.path``."""
    if sys.version_info >= (3, 11):
        return [sys.executable, "-P", "-m", module, *arguments]
    return [sys.executable, "-c", _RUN_MODULE_WITHOUT_WORKING_DIRECTORY, module, *arguments]
