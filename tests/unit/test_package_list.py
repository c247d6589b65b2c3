"""The wheel holds the packages pyproject.toml's ``[tool.setuptools] packages`` names, and only those:
a package folder the list forgot would install without its modules."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def package_folders() -> set[str]:
    """Every folder holding an ``__init__.py`` under kvtrace/ and the folders ``package-dir`` maps in."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    roots = {"kvtrace": ROOT / "kvtrace", **{name: ROOT / path for name, path in setuptools["package-dir"].items()}}
    return {".".join([name, *init.parent.relative_to(folder).parts])
            for name, folder in roots.items() for init in folder.rglob("__init__.py")}


def test_every_package_folder_is_listed_and_every_listed_package_is_a_folder():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    assert package_folders() == listed
