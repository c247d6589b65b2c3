"""The engine versions kvtrace supports are written once, in each patch module.

A user who installs ``kvtrace[vllm]`` or ``kvtrace[llama]`` must get an engine
version the patch accepts, and ``opentelemetry-instrument`` must check the same
ranges. pyproject.toml cannot import the patches, so its extras are a copy:
this test makes the copy fail CI the moment it drifts.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from kvtrace.patches import ENGINES, supported_requirements

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def patch_ranges() -> dict[str, SpecifierSet]:
    """Distribution name -> the versions its engine patch accepts."""
    ranges = {}
    for module, _ in ENGINES.values():
        for distribution, specifier in importlib.import_module(module).supported_versions().items():
            ranges[distribution] = SpecifierSet(specifier)
    return ranges


def extras() -> dict[str, list[Requirement]]:
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    return {name: [Requirement(r) for r in reqs] for name, reqs in project["optional-dependencies"].items()}


def test_each_engine_extra_installs_exactly_the_versions_its_patch_supports():
    ranges = patch_ranges()
    engine_extras = {name: [r for r in reqs if r.name in ranges]
                     for name, reqs in extras().items() if name != "test"}
    engine_extras = {name: reqs for name, reqs in engine_extras.items() if reqs}
    assert {"llama", "server", "vllm"} <= set(engine_extras)
    for name, reqs in engine_extras.items():
        for req in reqs:
            assert req.specifier == ranges[req.name], (
                f"pyproject extra {name!r} asks for {req}, but the {req.name} patch supports {ranges[req.name]}")


def test_the_engine_pinned_for_tests_is_a_supported_version():
    ranges = patch_ranges()
    pinned = [r for r in extras()["test"] if r.name in ranges]
    assert pinned
    for req in pinned:
        (version,) = [s.version for s in req.specifier]
        assert ranges[req.name].contains(version, prereleases=True), f"{req} is outside {ranges[req.name]}"


def test_the_opentelemetry_instrumentor_checks_the_patch_ranges():
    from kvtrace.instrumentor import KvtraceInstrumentor

    checked = {Requirement(r).name: Requirement(r).specifier
               for r in KvtraceInstrumentor().instrumentation_dependencies()}
    assert checked == patch_ranges()
    assert [Requirement(r).name for r in supported_requirements()] == list(checked)
