"""What installing the package takes.

* Every third-party module the package imports is declared in pyproject.toml: one imported when a module of the package
  is imported, as a dependency; one imported only inside a function (an optional feature), in the extra that names it
  (:data:`OPTIONAL`). Import names map to distributions through ``importlib.metadata.packages_distributions()``.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_lora"

#: Modules the package imports only inside the function of an optional feature -> the extra that installs them.
OPTIONAL = {"bitsandbytes": "bnb", "xformers": "xformers", "skimage": "demo"}


def pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib", reason="Python 3.11+ reads pyproject.toml")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _name(requirement: str) -> str:
    """The normalized distribution name of a requirement (``"PyYAML>=5.4"`` -> ``pyyaml``)."""
    match = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement)
    assert match, requirement
    return re.sub(r"[-_.]+", "-", match[0]).lower()


def third_party_imports(source: str) -> dict[str, bool]:
    """Top-level names of the third-party modules ``source`` imports -> whether an import of it runs when the module
    itself is imported (not only inside a function or under ``if TYPE_CHECKING:``)."""
    found: dict[str, bool] = {}

    def visit(node: ast.AST, eager: bool) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            eager = False
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        for name in names:
            top = name.partition(".")[0]
            if top not in sys.stdlib_module_names and top != "lightning_lora":
                found[top] = found.get(top, False) or eager
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for statement in node.body:
                visit(statement, False)
            for statement in node.orelse:
                visit(statement, eager)
            return
        for child in ast.iter_child_nodes(node):
            visit(child, eager)

    visit(ast.parse(source), True)
    return found


def package_imports() -> dict[str, bool]:
    imported: dict[str, bool] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for name, eager in third_party_imports(path.read_text()).items():
            imported[name] = imported.get(name, False) or eager
    return imported


def undeclared(imported: dict[str, bool], dependencies: list[str], extras: dict[str, list[str]]) -> list[str]:
    """One line per imported module that the dependencies (or an :data:`OPTIONAL` one's extra) do not declare."""
    installed = importlib.metadata.packages_distributions()
    core = {_name(r) for r in dependencies}
    problems = []
    for module, eager in sorted(imported.items()):
        # a module not installed here (xformers: GPU only) is taken to be its distribution's name
        distributions = {_name(d) for d in installed.get(module, [module])}
        extra = OPTIONAL.get(module)
        if extra is None:
            if not distributions & core:
                problems.append(f"{module} ({', '.join(sorted(distributions))}) is imported but not a dependency")
        elif eager:
            problems.append(f"{module} is imported with the package, but only the extra {extra} installs it")
        elif not distributions & {_name(r) for r in extras.get(extra, [])}:
            problems.append(f"{module} ({', '.join(sorted(distributions))}) is not in the extra {extra}")
    return problems


def test_every_module_the_package_imports_is_declared() -> None:
    project = pyproject()
    imported = package_imports()
    assert {"torch", "yaml", "tqdm", "typing_extensions", "tokenizers", "bitsandbytes"} <= set(imported), imported
    assert undeclared(imported, project["dependencies"], project["optional-dependencies"]) == []


def test_an_undeclared_import_is_found() -> None:
    """The check above can fail: without PyYAML in the dependencies the package's ``import yaml`` is reported, and an
    optional module imported at the top of a module, or missing from its extra, is too."""
    project = pyproject()
    dependencies = [r for r in project["dependencies"] if _name(r) != "pyyaml"]
    problems = undeclared(package_imports(), dependencies, project["optional-dependencies"])
    assert problems == ["yaml (pyyaml) is imported but not a dependency"], problems

    source = "import bitsandbytes\nfrom tqdm.auto import tqdm\n\ndef f():\n    import skimage.data\n"
    imported = third_party_imports(source)
    assert imported == {"bitsandbytes": True, "tqdm": True, "skimage": False}
    problems = undeclared(imported, ["torch>=2.7"], {"bnb": ["bitsandbytes"], "demo": []})
    assert problems == [
        "bitsandbytes is imported with the package, but only the extra bnb installs it",
        "skimage (scikit-image) is not in the extra demo",
        "tqdm (tqdm) is imported but not a dependency",
    ], problems


def test_type_checking_and_relative_imports_are_not_runtime_imports() -> None:
    source = (
        "from typing import TYPE_CHECKING\nfrom . import sibling\nfrom lightning_lora.io import atomic_write\n"
        "if TYPE_CHECKING:\n    import numpy\nelse:\n    import PIL\n"
    )
    assert third_party_imports(source) == {"numpy": False, "PIL": True}
