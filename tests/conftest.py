"""Shared fixtures: an isolated kvtrace environment per test, recorders, embedded databases;
and the rule that under CI nothing is skipped."""

from __future__ import annotations

import os

import pytest

# --- Under CI a skip is a failure ------------------------------------------------------
# Skips here only ever mean "an engine, an extra, Chromium or the Alertmanager is missing".
# Locally that is a convenience; in CI (`CI=true`, where .ci/run installs all of them) it means the install is
# broken, and a green run with the engine skipped would hide exactly that.


def under_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def fail_instead_of_skipping(report) -> None:
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    reason = reason.removeprefix("Skipped: ")
    report.outcome = "failed"
    report.longrepr = f"skipped under CI=true, where every engine and extra must be installed: {reason}"


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    """A module-level ``pytest.importorskip`` skips the whole file at collection."""
    report = yield
    if report.skipped and under_ci():
        fail_instead_of_skipping(report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """``skipif`` marks and ``importorskip`` in a test or fixture skip one test."""
    report = yield
    if report.skipped and not hasattr(report, "wasxfail") and under_ci():
        fail_instead_of_skipping(report)
    return report


# --- An isolated kvtrace environment per test -----------------------------------------


@pytest.fixture(autouse=True)
def kvtrace_env(tmp_path, monkeypatch):
    """Every test gets its own data dir, spool dir and database URL; ids captured in the clear; and
    runs in its own folder, as a user's command does, so that a child Python a test starts imports
    the installed kvtrace (a clone's root would put its kvtrace/ folder first on sys.path)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.setenv("KVTRACE_SPOOL_DIR", str(tmp_path / "spool"))
    monkeypatch.setenv("KVTRACE_CLICKHOUSE_URL", f"chdb://{tmp_path / 'db'}")
    monkeypatch.setenv("KVTRACE_CAPTURE", "ids")
    monkeypatch.setenv("KVTRACE_HASH_KEY", "test-deployment-key")
    for name in ("KVTRACE_EXPORTER", "KVTRACE_RUN_ID", "KVTRACE_EPISODE_ID", "KVTRACE_TURN", "KVTRACE_DISABLED",
                 "KVTRACE_ARM", "KVTRACE_ENGINES", "KVTRACE_ENABLED", "KVTRACE_CLICKHOUSE_URL_FILE",
                 "KVTRACE_LLAMA_REPACK"):
        monkeypatch.delenv(name, raising=False)
    from kvtrace.recording.recorder import set_recorder

    # The process recorder reads its settings once: one made during a test must not outlive the
    # test's environment (its spool directory is gone afterwards).
    set_recorder(None)
    yield tmp_path
    stale = set_recorder(None)
    if stale is not None:
        stale.pipeline.shutdown()


@pytest.fixture
def spool_dir(kvtrace_env):
    return kvtrace_env / "spool"


@pytest.fixture
def spool_recorder(spool_dir):
    """A recorder writing to this test's spool (flush with recorder.pipeline.force_flush())."""
    from kvtrace.config import Settings
    from kvtrace.recording.recorder import Recorder, set_recorder
    from kvtrace.recording.exporters.spool import SpoolExporter

    recorder = Recorder(Settings.from_env(), exporter=SpoolExporter(spool_dir))
    previous = set_recorder(recorder)
    yield recorder
    set_recorder(previous)
    recorder.shutdown()


@pytest.fixture
def db(kvtrace_env):
    """A fresh embedded ClickHouse (chDB) with the kvtrace schema; closed after the test.

    chDB opens one on-disk path per process at a time, hence the close.
    """
    from kvtrace.collectors.schema import init_schema
    from kvtrace.db import connect

    client = connect(f"chdb://{kvtrace_env / 'db'}")
    init_schema(client)
    yield client
    client.close()


# --- llama.cpp: generated models, a patched engine, in-memory recorders ---------------


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory):
    """The tiny random-weight Llama GGUF (F32), generated once per test session."""
    pytest.importorskip("llama_cpp")
    from kvtrace.testmodels.llama_gguf import make_model

    return make_model(tmp_path_factory.mktemp("models") / "tiny-F32.gguf", "F32", "tiny")


@pytest.fixture
def memory_recorder(kvtrace_env):
    """A recorder exporting to memory; read spans with ``finished_requests(recorder)``."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from kvtrace.config import Settings
    from kvtrace.recording.recorder import Recorder, set_recorder

    recorder = Recorder(Settings.from_env(), exporter=InMemorySpanExporter())
    previous = set_recorder(recorder)
    yield recorder
    set_recorder(previous)
    recorder.shutdown()


@pytest.fixture
def llama_patched():
    """llama-cpp-python instrumented for the test, restored afterwards."""
    from kvtrace.patches import llama_cpp as patch

    assert patch.patch()
    yield patch
    patch.unpatch()


@pytest.fixture
def make_llama(tiny_gguf):
    """Factory for ``Llama`` objects on the tiny model with explicit, test-friendly settings.

    Loaded the way kvtrace loads its own engines (the weight repack off), so tests run the same
    kernels on every CPU.
    """
    from kvtrace.patches.llama_cpp.repack import load_llama

    created = []

    def make(**overrides):
        params = dict(model_path=str(tiny_gguf), n_ctx=512, n_batch=64, n_ubatch=64, n_threads=1,
                      n_threads_batch=1, seed=7, verbose=False)
        params.update(overrides)
        llm = load_llama(**params)
        created.append(llm)
        return llm

    yield make
    for llm in created:
        llm.close()


@pytest.fixture
def finished_requests():
    """Callable: flush a recorder and return its request spans as (attributes, events, span) tuples."""

    def read(recorder):
        recorder.pipeline.force_flush()
        spans = sorted(recorder.pipeline.exporter.get_finished_spans(), key=lambda s: s.start_time)
        return [(dict(s.attributes), [(e.name, dict(e.attributes)) for e in s.events], s) for s in spans]

    return read
