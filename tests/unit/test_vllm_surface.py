"""kvtrace's vLLM surface: the names its hooks rely on, checked in vLLM's source and at patch time.

The checker reads source as AST, so these tests build a small vLLM tree of their own: one that holds
every declared name, then the same tree with one name taken away.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import types
import zipfile
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvtrace.patches import hooks
from kvtrace.patches.hooks import Hook, HookFailures, HookTable
from kvtrace.patches.vllm import surface_check
from kvtrace.patches.vllm.surface import SURFACE, Target, target
from kvtrace.recording.counters import SpanCounters


def write_vllm_tree(root: Path, surface=SURFACE, leave_out: tuple[str, ...] = ()) -> Path:
    """A vLLM source tree under ``root`` that holds every target of ``surface`` except those whose
    ``module:name`` is in ``leave_out`` (a module whose targets are all left out is not written)."""
    targets = [t for t in surface if str(t) not in leave_out]
    modules: dict[str, dict] = defaultdict(lambda: {"classes": defaultdict(list), "functions": []})
    for t in targets:
        owner, _, method = t.name.partition(".")
        if method:
            params = ", ".join(("self",) + t.params + ("*args", "**kwargs"))
            body = "".join(f"        {name} = None\n" for name in t.frame_locals) or "        pass\n"
            modules[t.module]["classes"][owner].append(f"    def {method}({params}):\n{body}")
        elif t.attributes:
            modules[t.module]["classes"][owner].append(
                "    def __init__(self):\n" + "".join(f"        self.{a} = None\n" for a in t.attributes))
        elif owner[0].isupper():
            modules[t.module]["classes"][owner].append("    pass\n")
        else:
            modules[t.module]["functions"].append(f"def {owner}(*args, **kwargs):\n    pass\n")
    names = set(modules) | {"vllm"}
    for name in list(names):
        parts = name.split(".")
        names.update(".".join(parts[:i]) for i in range(1, len(parts)))
    for name in names:
        is_package = any(other.startswith(name + ".") for other in names)
        path = root.joinpath(*name.split(".")) / "__init__.py" if is_package else \
            root.joinpath(*name.split(".")).with_suffix(".py")
        path.parent.mkdir(parents=True, exist_ok=True)
        module = modules.get(name)
        text = ""
        if module:
            for owner, members in module["classes"].items():
                # a class declared by several targets (methods here, attributes there) is one class;
                # the second __init__ of a class with attributes adds to the first's
                text += f"class {owner}:\n" + "".join(members) + "\n"
            text += "".join(module["functions"])
        path.write_text(text)
    (root / "vllm" / "_version.py").write_text("__version__ = version = '0.99.0'\n")
    return root


def run_check(path: Path) -> tuple[int, str]:
    out = _Lines()
    code = surface_check.main([str(path)], out=out)
    return code, out.text


class _Lines:
    def __init__(self):
        self.text = ""

    def write(self, text: str) -> None:
        self.text += text


def test_a_vllm_tree_with_every_declared_name_passes(tmp_path):
    code, text = run_check(write_vllm_tree(tmp_path))
    assert code == 0, text
    assert "vLLM 0.99.0: every feature has its targets" in text
    assert "MISSING" not in text


def test_the_same_tree_as_a_wheel_passes(tmp_path):
    tree = write_vllm_tree(tmp_path / "tree")
    wheel = tmp_path / "vllm-0.99.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for file in tree.rglob("*.py"):
            archive.write(file, file.relative_to(tree).as_posix())
    assert run_check(wheel)[0] == 0
    assert run_check(tree / "vllm")[0] == 0  # an installed package directory


def test_a_renamed_frame_function_fails_the_check_naming_it_and_eviction_attribution(tmp_path):
    code, text = run_check(write_vllm_tree(tmp_path, leave_out=(
        "vllm.v1.core.kv_cache_manager:KVCacheManager.allocate_slots",)))
    assert code == 1
    assert ("MISSING  vllm.v1.core.kv_cache_manager:KVCacheManager.allocate_slots: KVCacheManager has no "
            "allocate_slots (turns off: eviction attribution)") in text
    assert "1 feature(s) lost: eviction attribution" in text


def test_a_parameter_moved_to_another_position_fails_the_check(tmp_path):
    store = target("vllm.v1.core.block_pool", "BlockPool.cache_full_blocks")
    swapped = store.params[:2] + (store.params[3], store.params[2]) + store.params[4:]
    surface = [Target(t.module, t.name, t.feature, t.alternative, swapped) if t is store else t for t in SURFACE]
    code, text = run_check(write_vllm_tree(tmp_path, surface=surface))
    assert code == 1
    assert "parameter 2 is num_full_blocks, not num_cached_blocks" in text


def test_an_attribute_vllm_no_longer_sets_fails_the_check(tmp_path):
    request = target("vllm.v1.request", "Request")
    surface = [Target(t.module, t.name, t.feature, attributes=tuple(a for a in t.attributes if a != "block_hashes"))
               if t is request else t for t in SURFACE]
    code, text = run_check(write_vllm_tree(tmp_path, surface=surface))
    assert code == 1 and "vllm.v1.request:Request: no attribute block_hashes" in text


def test_vllm_without_the_v1_runner_passes_on_the_v2_sampler_and_fails_without_either(tmp_path):
    v1 = tuple(str(t) for t in SURFACE if t.alternative == "V1 runner")
    v2 = tuple(str(t) for t in SURFACE if t.alternative == "V2 runner")
    code, text = run_check(write_vllm_tree(tmp_path / "v2-only", leave_out=v1))
    assert code == 0, text
    assert "absent   vllm.v1.worker.gpu_model_runner:GPUModelRunner._sample" in text
    code, text = run_check(write_vllm_tree(tmp_path / "neither", leave_out=v1 + v2))
    assert code == 1 and "1 feature(s) lost: per-token margins" in text


USED_OUTSIDE_THE_HOOK_TABLE = {
    "vllm.v1.core.kv_cache_utils:get_block_hash": "called (common.bare), never wrapped",
    "vllm.v1.outputs:AsyncModelRunnerOutput.get_output": "overridden by worker.py's subclass of vLLM's output",
    "vllm.v1.core.sched.scheduler:Scheduler.update_from_output": "wrapped on each mp scheduler (worker.receive_rows)",
}
"""Callable surface targets kvtrace reaches without a hook of the table, and how."""


def test_the_hook_table_wraps_or_checks_every_callable_the_surface_declares_and_nothing_else():
    from kvtrace.patches import vllm as vllm_patch

    table = {f"{h.module}:{h.target}": h.feature for h in vllm_patch.HOOKS.hooks + vllm_patch.HOOKS.checks}
    callables = {str(t) for t in SURFACE if "." in t.name or t.name[0].islower()}  # methods and functions
    assert set(table) == callables - set(USED_OUTSIDE_THE_HOOK_TABLE)
    assert set(USED_OUTSIDE_THE_HOOK_TABLE) <= callables
    for name, feature in table.items():  # a missing target's warning names what the surface says it feeds
        module, _, attribute = name.partition(":")
        assert feature == target(module, attribute).turns_off, name


def test_a_path_that_is_not_vllm_exits_2_with_one_line_and_no_traceback(tmp_path):
    garbage = tmp_path / "vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    garbage.write_bytes(b"not a zip")
    for path in (garbage, tmp_path / "nowhere", tmp_path):
        done = subprocess.run([sys.executable, "-m", "kvtrace.patches.vllm.surface_check", str(path)],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, done.stderr
        assert done.stdout == "" and len(done.stderr.splitlines()) == 1 and "Traceback" not in done.stderr


# --- at patch time ------------------------------------------------------------------------------


@pytest.fixture
def counters(monkeypatch):
    """The recorder's counters, as a hook failure or a missing target reaches them."""
    counters = SpanCounters()
    monkeypatch.setattr(hooks, "get_recorder", lambda: SimpleNamespace(pipeline=SimpleNamespace(counters=counters)))
    return counters


@pytest.fixture
def old_block_pool():
    """A stand-in vLLM module whose BlockPool lacks the eviction method (as a release that renamed it)."""
    name = "kvtrace_fake_vllm_block_pool"
    module = types.ModuleType(name)
    exec("class BlockPool:\n    def cache_full_blocks(self, *args):\n        return 'stored'\n"
         "class KVCacheManager:\n    pass\n", module.__dict__)
    sys.modules[name] = module
    yield module
    del sys.modules[name]


def test_a_missing_hook_target_warns_once_naming_it_and_its_feature_and_is_counted(old_block_pool, counters,
                                                                                   caplog):
    name = old_block_pool.__name__
    table = HookTable("vllm", [
        Hook(name, "BlockPool.cache_full_blocks", lambda wrapped, instance, args, kwargs: "traced",
             feature="prefix-cache provenance (who stored each block)"),
        Hook(name, "BlockPool._maybe_evict_cached_block", lambda *a: None, feature="eviction attribution"),
    ], HookFailures("vllm"), checks=[Hook(name, "KVCacheManager.allocate_slots", None, feature="eviction attribution")])
    with caplog.at_level(logging.WARNING, logger="kvtrace"):
        table.install()
        table.restore()
        table.install()  # patched again in the same process: no second warning
    try:
        assert old_block_pool.BlockPool().cache_full_blocks() == "traced"  # the other hooks still apply
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert warnings == [
            f"kvtrace: vllm {name} has no BlockPool._maybe_evict_cached_block; that hook is skipped and eviction "
            "attribution is off (counted in hooks_missing)",
            f"kvtrace: vllm {name} has no KVCacheManager.allocate_slots; that hook is skipped and eviction "
            "attribution is off (counted in hooks_missing)",
        ]
        assert counters.snapshot()["hooks_missing"] == 2
    finally:
        table.restore()


def test_a_checked_target_that_exists_is_left_unwrapped_and_silent(old_block_pool, counters, caplog):
    def allocate_slots(self, request, *args):
        return "allocated"

    old_block_pool.KVCacheManager.allocate_slots = allocate_slots
    table = HookTable("vllm", [], HookFailures("vllm"),
                      checks=[Hook(old_block_pool.__name__, "KVCacheManager.allocate_slots", None, feature="x")])
    with caplog.at_level(logging.WARNING, logger="kvtrace"):
        table.install()
    table.restore()
    assert old_block_pool.KVCacheManager.__dict__["allocate_slots"] is allocate_slots
    assert not caplog.records and counters.snapshot()["hooks_missing"] == 0
