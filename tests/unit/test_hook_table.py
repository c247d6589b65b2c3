"""patches/hooks.py, shared by every engine package: the hook table, the call-through wrapper, the version gate.

The "engine" is a module made up per test: put in ``sys.modules`` (imported before ``patch()``)
or written to disk and imported afterwards, as an engine's submodules are.
"""

from __future__ import annotations

import importlib
import itertools
import logging
import sys
import textwrap
import types

import pytest

from kvtrace.patches.hooks import EngineVersion, Hook, HookFailures, HookTable, observing

ENGINE_SOURCE = textwrap.dedent("""
    class Engine:
        def step(self, x):
            return x + 1


    def load(name):
        return f"loaded {name}"
""")

_names = itertools.count()


def unique_name() -> str:
    return f"kvtrace_fake_engine_{next(_names)}_{id(_names)}"


@pytest.fixture
def imported_engine():
    """An engine module imported before the table is installed."""
    name = unique_name()
    module = types.ModuleType(name)
    exec(ENGINE_SOURCE, module.__dict__)
    sys.modules[name] = module
    yield module
    del sys.modules[name]


@pytest.fixture
def engine_on_disk(tmp_path, monkeypatch):
    """The name of an engine module that is importable but not imported yet."""
    name = unique_name()
    (tmp_path / f"{name}.py").write_text(ENGINE_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


class Calls:
    """A wrapper that counts its calls and tags results, so a test sees whether (and how often) it ran."""

    def __init__(self):
        self.count = 0

    def __call__(self, wrapped, instance, args, kwargs):
        self.count += 1
        return ("traced", wrapped(*args, **kwargs))


def table_for(module_name: str, *targets: str) -> tuple[HookTable, Calls]:
    calls = Calls()
    return HookTable("fake", [Hook(module_name, target, calls) for target in targets], HookFailures("fake")), calls


def test_install_wraps_an_imported_module_and_restore_puts_the_originals_back(imported_engine):
    original_step, original_load = imported_engine.Engine.__dict__["step"], imported_engine.load
    table, calls = table_for(imported_engine.__name__, "Engine.step", "load")
    table.install()
    assert imported_engine.Engine().step(1) == ("traced", 2)
    assert imported_engine.load("m") == ("traced", "loaded m")
    table.restore()
    assert imported_engine.Engine.__dict__["step"] is original_step and imported_engine.load is original_load
    assert imported_engine.Engine().step(1) == 2 and calls.count == 2


def test_a_module_imported_after_install_is_wrapped_on_import(engine_on_disk):
    table, _ = table_for(engine_on_disk, "Engine.step")
    table.install()
    try:
        module = importlib.import_module(engine_on_disk)
        assert module.Engine().step(1) == ("traced", 2)
    finally:
        table.restore()
    assert module.Engine().step(1) == 2


def test_a_module_imported_after_restore_is_left_alone(engine_on_disk):
    table, _ = table_for(engine_on_disk, "Engine.step")
    table.install()
    table.restore()
    assert importlib.import_module(engine_on_disk).Engine().step(1) == 2


def test_install_is_idempotent_and_works_again_after_restore(imported_engine):
    table, calls = table_for(imported_engine.__name__, "Engine.step")
    table.install()
    table.install()
    assert imported_engine.Engine().step(1) == ("traced", 2) and calls.count == 1  # wrapped once
    table.restore()
    table.restore()
    assert imported_engine.Engine().step(1) == 2
    table.install()
    assert imported_engine.Engine().step(1) == ("traced", 2)
    table.restore()


def test_an_attribute_this_engine_version_lacks_is_skipped_with_a_warning(imported_engine, caplog):
    table, _ = table_for(imported_engine.__name__, "Engine.renamed_in_this_version", "load")
    with caplog.at_level(logging.WARNING, logger="kvtrace"):
        table.install()
    try:
        assert imported_engine.load("m") == ("traced", "loaded m")  # the other hooks still apply
        assert "has no Engine.renamed_in_this_version; that hook is skipped" in caplog.text
    finally:
        table.restore()


def test_a_second_table_does_not_wrap_an_attribute_twice(imported_engine):
    first, first_calls = table_for(imported_engine.__name__, "load")
    second, second_calls = table_for(imported_engine.__name__, "load")
    first.install()
    second.install()
    try:
        assert imported_engine.load("m") == ("traced", "loaded m")
        assert (first_calls.count, second_calls.count) == (1, 0)
    finally:
        second.restore()
        first.restore()


def test_observing_returns_the_engines_result_even_when_the_observation_fails(caplog):
    failures = HookFailures("fake")
    seen = []

    def observe(result, instance, args, kwargs):
        seen.append(result)
        raise ValueError("observation bug")

    wrapper = observing(failures, "load", observe)
    with caplog.at_level(logging.WARNING, logger="kvtrace"):
        assert wrapper(lambda name: f"loaded {name}", None, ("m",), {}) == "loaded m"
    assert seen == ["loaded m"] and "fake instrumentation error in load" in caplog.text

    def failing_engine():
        raise OSError("engine failure")

    with pytest.raises(OSError, match="engine failure"):
        wrapper(failing_engine, None, (), {})
    assert seen == ["loaded m"]  # nothing to observe when the engine raised


def test_the_version_gate_admits_the_supported_range_and_says_why_not(caplog):
    version = EngineVersion(engine="fake", distributions=("fake-engine",), specifier=">=0.3,<0.4",
                            module="kvtrace_no_such_engine")
    assert version.installed() == ""
    assert version.supported() == {"fake-engine": ">=0.3,<0.4"}
    assert version.gate("0.3.1") and version.gate("0.3.2rc1")
    with caplog.at_level(logging.WARNING, logger="kvtrace"):
        assert not version.gate("0.4.0")
        assert not version.gate()  # the installed version: none
    assert "fake 0.4.0 is not supported (kvtrace supports fake-engine >=0.3,<0.4)" in caplog.text
    assert "fake (not installed) is not supported" in caplog.text
