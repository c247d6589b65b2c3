"""Build llama.cpp's own HTTP server (``llama-server``) from the llama-cpp-python sdist, once.

The sdist pip compiles llama-cpp-python from carries the whole llama.cpp tree under
``vendor/llama.cpp``, ``tools/server/`` included, so the server the tests (and users who want
the engine of the study) run is the same llama.cpp as the Python engine. Only the
``llama-server`` target is built, statically linked, with tests, examples, the web UI, curl and
OpenSSL off: nothing is fetched at build time and one file is all there is to keep.

The binary is cached under ``$XDG_CACHE_HOME/kvtrace/llama-server-<version>-<key>/`` where the
key covers the compiler, the CMake options and the CPU's feature flags (the build targets this
CPU, ``GGML_NATIVE``). With the binary there, :func:`ensure_llama_server` returns at once; the
build (about 10 minutes on 2 cores) runs at the lowest CPU priority, under a file lock so two
processes never build the same key at once.

``python -m kvtrace.llama_server.build`` prints the binary's path (building it first if
needed); ``KVTRACE_LLAMA_SERVER`` names a binary to use instead.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Mapping, Optional

from kvtrace.errors import KvtraceError

PACKAGE = "llama-cpp-python"
TARGET = "llama-server"
BINARY_ENV = "KVTRACE_LLAMA_SERVER"

CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    # One self-contained file: the cache keeps the binary and nothing else.
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_APP=OFF",
    # The web UI would be built with npm or downloaded; the API needs neither.
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
)
BUILD_JOBS = 2


class LlamaServerBuildFailed(KvtraceError):
    """The sdist could not be fetched or llama-server did not compile."""


def sdist_version() -> str:
    """The installed llama-cpp-python's version: the server is built from the same llama.cpp."""
    try:
        return metadata.version(PACKAGE)
    except metadata.PackageNotFoundError:
        raise LlamaServerBuildFailed(
            f"{PACKAGE} is not installed, so there is no version to build llama-server from; "
            f"install kvtrace[llama] or pass --version") from None


def _compiler_identity() -> str:
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or ""
    if not compiler:
        raise LlamaServerBuildFailed("no C++ compiler found (install g++ or set CXX)")
    try:
        first_line = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                                    timeout=30).stdout.splitlines()[:1]
    except (OSError, subprocess.SubprocessError) as exc:
        raise LlamaServerBuildFailed(f"cannot run the C++ compiler {compiler}: {exc}") from None
    return f"{compiler} {''.join(first_line)}"


def _cpu_flags() -> str:
    # GGML_NATIVE compiles for this CPU: a binary built elsewhere might use instructions it lacks.
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return ""


def cache_root(environ: Optional[Mapping[str, str]] = None) -> Path:
    env = os.environ if environ is None else environ
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvtrace"


def build_dir_for(version: str, environ: Optional[Mapping[str, str]] = None) -> Path:
    """Where the binary of this version, compiler, option set and CPU lives."""
    key = hashlib.sha256("\n".join((_compiler_identity(), " ".join(CMAKE_OPTIONS), _cpu_flags()))
                         .encode()).hexdigest()[:12]
    return cache_root(environ) / f"{TARGET}-{version}-{key}"


def cached_llama_server(version: Optional[str] = None) -> Optional[Path]:
    """``KVTRACE_LLAMA_SERVER`` or the cached build for this machine, without building; ``None`` if neither."""
    named = os.environ.get(BINARY_ENV)
    if named:
        path = Path(named)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise LlamaServerBuildFailed(f"{BINARY_ENV}={named} is not an executable file")
        return path
    binary = build_dir_for(version or sdist_version()) / "bin" / TARGET
    return binary if binary.is_file() else None


def ensure_llama_server(version: Optional[str] = None, *, log=None) -> Path:
    """The path of a runnable llama-server: ``KVTRACE_LLAMA_SERVER``, the cached one, or a fresh build."""
    found = cached_llama_server(version)
    if found is not None:
        return found
    version = version or sdist_version()
    home = build_dir_for(version)
    binary = home / "bin" / TARGET
    home.mkdir(parents=True, exist_ok=True)
    with open(home / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building this very key
        if not binary.is_file():
            _build(version, home, binary, log or (lambda message: print(message, file=sys.stderr)))
    return binary


def _run(command: list[str], what: str, cwd: Optional[Path] = None) -> None:
    result = subprocess.run(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if result.returncode != 0:
        tail = "\n".join(result.stdout.splitlines()[-30:])
        raise LlamaServerBuildFailed(f"{what} failed (exit {result.returncode}):\n{tail}")


def _build(version: str, home: Path, binary: Path, log) -> None:
    for tool in ("cmake",):
        if shutil.which(tool) is None:
            raise LlamaServerBuildFailed(f"{tool} is not installed; it is needed to build {TARGET}")
    with tempfile.TemporaryDirectory(prefix="build-", dir=home) as scratch:
        scratch_dir = Path(scratch)
        log(f"{TARGET}: fetching the {PACKAGE} {version} sdist")
        _run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
              f"{PACKAGE}=={version}", "-d", str(scratch_dir)], "pip download")
        archives = sorted(scratch_dir.glob("*.tar.gz"))
        if not archives:
            raise LlamaServerBuildFailed(f"pip download left no sdist archive in {scratch_dir}")
        with tarfile.open(archives[0]) as archive:
            archive.extractall(scratch_dir, filter="data")
        sources = next(scratch_dir.glob("*/vendor/llama.cpp"), None)
        if sources is None or not (sources / "tools" / "server").is_dir():
            raise LlamaServerBuildFailed(f"the {PACKAGE} {version} sdist carries no vendor/llama.cpp/tools/server")
        build = scratch_dir / "build"
        log(f"{TARGET}: configuring llama.cpp from {PACKAGE} {version}")
        _run(["cmake", "-S", str(sources), "-B", str(build), *CMAKE_OPTIONS], "cmake configure")
        log(f"{TARGET}: compiling (about 10 minutes on 2 cores, at the lowest CPU priority)")
        _run(["nice", "-n", "19", "cmake", "--build", str(build), "--target", TARGET, "-j", str(BUILD_JOBS)],
             "cmake build")
        built = build / "bin" / TARGET
        if not built.is_file():
            raise LlamaServerBuildFailed(f"the build finished without {built}")
        binary.parent.mkdir(parents=True, exist_ok=True)
        staged = binary.with_name(f".{TARGET}.partial")
        shutil.copy2(built, staged)
        os.replace(staged, binary)  # appears whole or not at all
    log(f"{TARGET}: built {binary}")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvtrace.llama_server.build",
                                     description=f"Print the path of {TARGET}, building it once if needed.")
    parser.add_argument("--version", help=f"{PACKAGE} sdist version (default: the installed one)")
    args = parser.parse_args(argv)
    try:
        print(ensure_llama_server(args.version))
    except KvtraceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
