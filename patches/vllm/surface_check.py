"""Check a vLLM source tree against kvtrace's vLLM surface (:mod:`.surface`), without importing vLLM.

Usage::

    python -m kvtrace.patches.vllm.surface_check PATH

``PATH`` is a vLLM wheel (``vllm-0.34.0-...whl``, e.g. from ``pip download --no-deps vllm==0.34.0``),
an extracted tree holding ``vllm/``, or an installed ``vllm`` package directory.  The source is read
as AST, so a CUDA wheel is checked on a machine without CUDA.  One line per target (``ok`` or
``MISSING`` with why and the feature it turns off), then one per feature.

Exit codes: 0 every feature has its targets (an alternative that is absent is fine when another one
is there); 1 a feature lacks a target; 2 ``PATH`` is not a vLLM wheel or source tree.
"""

from __future__ import annotations

import ast
import re
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

from kvtrace.patches.vllm.surface import SURFACE, Target


class NotVllmSource(Exception):
    """The path is neither a vLLM wheel nor a tree with vLLM's Python source."""


class VllmSource:
    """vLLM's Python modules, read from a wheel or a directory, parsed on first use."""

    def __init__(self, read: Callable[[str], Optional[str]], version: str):
        self._read = read
        self.version = version
        self._trees: dict[str, Optional[ast.Module]] = {}

    @classmethod
    def open(cls, path: Path) -> "VllmSource":
        if path.is_file():
            try:
                wheel = zipfile.ZipFile(path)
            except (zipfile.BadZipFile, OSError) as exc:
                raise NotVllmSource(f"{path} is not a wheel ({exc})") from None
            names = set(wheel.namelist())
            if "vllm/__init__.py" not in names:
                raise NotVllmSource(f"{path} holds no vllm/__init__.py: not a vLLM wheel")
            found = re.match(r"vllm(?:_cpu)?-([^-]+)-", path.name)

            def read_member(relative: str) -> Optional[str]:
                return wheel.read(relative).decode("utf-8") if relative in names else None

            source = cls(read_member, found.group(1) if found else "")
        elif path.is_dir():
            root = path.parent if (path / "__init__.py").is_file() and path.name == "vllm" else path
            if not (root / "vllm" / "__init__.py").is_file():
                raise NotVllmSource(f"{path} has no vllm/__init__.py: not a vLLM source tree or package")

            def read_file(relative: str) -> Optional[str]:
                file = root / relative
                return file.read_text(encoding="utf-8") if file.is_file() else None

            source = cls(read_file, "")
        else:
            raise NotVllmSource(f"{path} does not exist")
        source.version = source.version or source._version_file()
        return source

    def _version_file(self) -> str:
        text = self._read("vllm/_version.py") or ""
        found = re.search(r"""^__version__\s*=\s*version\s*=\s*['"]([^'"]+)['"]""", text, re.M) or \
            re.search(r"""^__version__\s*=\s*['"]([^'"]+)['"]""", text, re.M)
        return found.group(1) if found else "unknown"

    def is_package(self, name: str) -> bool:
        return self._read(name.replace(".", "/") + "/__init__.py") is not None

    def module(self, name: str) -> Optional[ast.Module]:
        """The parsed module ``name`` (``None`` when the tree has no such module)."""
        if name not in self._trees:
            relative = name.replace(".", "/")
            text = self._read(relative + ".py")
            if text is None:
                text = self._read(relative + "/__init__.py")
            self._trees[name] = ast.parse(text) if text is not None else None
        return self._trees[name]


def _top_level(tree: ast.Module) -> Iterable[ast.stmt]:
    """A module's statements, those inside top-level ``if`` / ``try`` blocks too."""
    pending = list(tree.body)
    while pending:
        node = pending.pop(0)
        if isinstance(node, ast.If):
            pending[:0] = node.body + node.orelse
        elif isinstance(node, ast.Try):
            pending[:0] = node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body]
        else:
            yield node


def _bound_names(node: ast.stmt) -> list[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, ast.Assign):
        return [n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return [(a.asname or a.name).split(".")[0] for a in node.names]
    return []


@dataclass
class Found:
    """What the tree holds for a name: a class, a function, or a name bound some other way."""

    node: Optional[ast.AST]
    module: str


class Checker:
    """Resolves :class:`~.surface.Target` names in a :class:`VllmSource`."""

    def __init__(self, source: VllmSource):
        self.source = source

    def problem(self, target: Target) -> Optional[str]:
        """Why ``target`` does not hold in this tree (``None`` when it does)."""
        tree = self.source.module(target.module)
        if tree is None:
            return f"no module {target.module}"
        owner_name, _, attr = target.name.partition(".")
        owner = self._lookup(tree, target.module, owner_name)
        if owner is None:
            return f"no {owner_name} in {target.module}"
        if attr:
            if not isinstance(owner.node, ast.ClassDef):
                return f"{owner_name} is not a class"
            member = self._member(owner, attr)
            if member is None:
                return f"{owner_name} has no {attr}"
            function = member
        else:
            function = owner.node
        missing = []
        if target.params or target.frame_locals:
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                return f"{target.name} is not a function kvtrace can read parameters of"
            params = [a.arg for a in function.args.posonlyargs + function.args.args]
            if attr:
                params = params[1:]  # self
            for index, name in enumerate(target.params):
                if index >= len(params) or params[index] != name:
                    got = params[index] if index < len(params) else "nothing"
                    missing.append(f"parameter {index} is {got}, not {name}")
            local_names = set(params) | {a.arg for a in function.args.kwonlyargs} | {
                n.id for n in ast.walk(function) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
            missing += [f"no local {name}" for name in target.frame_locals if name not in local_names]
        if target.attributes:
            if not isinstance(owner.node, ast.ClassDef) or attr:
                return f"{target.name} is not a class"
            held = self._attributes(owner)
            missing += [f"no attribute {name}" for name in target.attributes if name not in held]
        return "; ".join(missing) or None

    def _lookup(self, tree: ast.Module, module: str, name: str, depth: int = 0) -> Optional[Found]:
        """``name`` bound at the top of ``module``, followed through ``from x import name``."""
        for node in _top_level(tree):
            if name not in _bound_names(node):
                continue
            if isinstance(node, ast.ImportFrom) and depth < 4:
                origin = self._resolve_import(module, node)
                imported = next(a.name for a in node.names if (a.asname or a.name) == name)
                origin_tree = self.source.module(origin) if origin else None
                if origin_tree is not None:
                    found = self._lookup(origin_tree, origin, imported, depth + 1)
                    if found is not None:
                        return found
                return Found(None, module)  # bound by an import the tree cannot follow: the name exists
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                return Found(node, module)
            return Found(None, module)
        return None

    def _resolve_import(self, module: str, node: ast.ImportFrom) -> Optional[str]:
        if not node.level:
            return node.module
        package = module.split(".")
        base = package if self.source.is_package(module) else package[:-1]
        base = base[:len(base) - (node.level - 1)]
        return ".".join(base + ([node.module] if node.module else []))

    def _bases(self, owner: Found) -> list[Found]:
        bases = []
        tree = self.source.module(owner.module)
        for base in owner.node.bases:
            if isinstance(base, ast.Name) and tree is not None:
                found = self._lookup(tree, owner.module, base.id)
                if found is not None and isinstance(found.node, ast.ClassDef):
                    bases.append(found)
        return bases

    def _member(self, owner: Found, name: str, depth: int = 0) -> Optional[ast.AST]:
        for node in owner.node.body:
            if name in _bound_names(node):
                return node
        for base in self._bases(owner) if depth < 6 else []:
            member = self._member(base, name, depth + 1)
            if member is not None:
                return member
        return None

    def _attributes(self, owner: Found, depth: int = 0) -> set[str]:
        """Names an instance of the class has: class-body names (fields, methods, properties) and
        ``self.name`` assigned in its methods, its bases' too."""
        names: set[str] = set()
        for node in owner.node.body:
            names.update(_bound_names(node))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for inner in ast.walk(node):
                    targets = inner.targets if isinstance(inner, ast.Assign) else \
                        [inner.target] if isinstance(inner, (ast.AnnAssign, ast.AugAssign)) else []
                    for assigned in targets:
                        for part in ast.walk(assigned):
                            if isinstance(part, ast.Attribute) and isinstance(part.value, ast.Name) \
                                    and part.value.id == "self":
                                names.add(part.attr)
        for base in self._bases(owner) if depth < 6 else []:
            names |= self._attributes(base, depth + 1)
        return names


@dataclass
class Result:
    target: Target
    problem: Optional[str]


def check(source: VllmSource, surface: Sequence[Target] = SURFACE) -> tuple[list[Result], dict[str, bool]]:
    """Each target's problem (``None``: holds) and, per feature, whether it is available."""
    checker = Checker(source)
    results = [Result(t, checker.problem(t)) for t in surface]
    features: dict[str, bool] = {}
    for feature in dict.fromkeys(t.feature for t in surface):
        mine = [r for r in results if r.target.feature == feature]
        required_ok = all(r.problem is None for r in mine if not r.target.alternative)
        alternatives = dict.fromkeys(r.target.alternative for r in mine if r.target.alternative)
        any_ok = not alternatives or any(
            all(r.problem is None for r in mine if r.target.alternative == a) for a in alternatives)
        features[feature] = required_ok and any_ok
    return results, features


def main(argv: Optional[Sequence[str]] = None, out=None) -> int:
    out = out or sys.stdout
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv in (["-h"], ["--help"]):
        print(__doc__.strip(), file=out)
        return 0
    if len(argv) != 1:
        print("usage: python -m kvtrace.patches.vllm.surface_check PATH (a vLLM wheel or source tree)",
              file=sys.stderr)
        return 2
    try:
        source = VllmSource.open(Path(argv[0]))
        results, features = check(source)
    except NotVllmSource as exc:
        print(f"kvtrace surface check: {exc}", file=sys.stderr)
        return 2
    except (SyntaxError, UnicodeDecodeError, OSError) as exc:
        print(f"kvtrace surface check: cannot read {argv[0]}: {exc}", file=sys.stderr)
        return 2
    print(f"vLLM {source.version}: kvtrace's surface ({len(results)} targets)", file=out)
    for result in results:
        target = result.target
        if result.problem is None:
            print(f"  ok       {target}", file=out)
        else:
            kind = "absent  " if target.alternative and features[target.feature] else "MISSING "
            print(f"  {kind} {target}: {result.problem} (turns off: {target.turns_off})", file=out)
    for feature, available in features.items():
        print(f"{'ok' if available else 'MISSING':8} {feature}", file=out)
    lost = [f for f, ok in features.items() if not ok]
    print(f"vLLM {source.version}: " + (f"{len(lost)} feature(s) lost: {', '.join(lost)}" if lost
                                        else "every feature has its targets"), file=out)
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main())
