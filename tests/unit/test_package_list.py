"""The wheel holds the packages pyproject.toml's ``[tool.setuptools] packages`` names, and only those:
a package folder the list forgot would install without its modules. Folders of data only (SQL) are listed
too, each with the files its ``package-data`` names, so that setuptools ships them without a warning."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
ROOTS = {"kvtrace": ROOT / "kvtrace", **{name: ROOT / path for name, path in SETUPTOOLS["package-dir"].items()}}


def package_folders() -> set[str]:
    """Every folder holding an ``__init__.py`` under kvtrace/ and the folders ``package-dir`` maps in."""
    return {".".join([name, *init.parent.relative_to(folder).parts])
            for name, folder in ROOTS.items() for init in folder.rglob("__init__.py")}


def data_folders() -> set[str]:
    """Folders without Python under the package roots, named as packages; each must hold files its
    ``package-data`` patterns name, or the wheel would lack them."""
    data = set()
    for name, root in ROOTS.items():
        for folder in [root, *root.rglob("*")]:
            if not folder.is_dir() or folder.name == "__pycache__" or any(folder.glob("*.py")):
                continue
            package = ".".join([name, *folder.relative_to(root).parts])
            patterns = SETUPTOOLS["package-data"].get(package, [])
            assert any(any(folder.glob(p)) for p in patterns), f"{package}: no file its package-data names"
            data.add(package)
    return data


def test_every_package_folder_is_listed_and_every_listed_package_is_a_folder():
    listed = set(SETUPTOOLS["packages"])
    assert package_folders() | data_folders() == listed
