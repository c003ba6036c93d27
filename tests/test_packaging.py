"""What installing the package takes.

* Every third-party module the package imports is declared in pyproject.toml: one imported when a module of the package
  is imported, as a dependency; one imported only inside a function (an optional feature), in the extra that names it
  (:data:`OPTIONAL`). Import names map to distributions through ``importlib.metadata.packages_distributions()``.
* The Makefile's two installs: ``make demo`` installs the package with the demo extra only, ``make test`` the dev
  extras, in either order in one clone, with TORCH=cpu / keep / TORCH_INDEX as the Makefile's header says. The targets
  run for real with stub tools (a ``python`` that makes a venv of stubs and logs every call), so the stamps' logic
  is what is tested, in a second.
* The README's one-line installs per hardware name the torch releases the project tests.
"""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
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


# ------------------------------------------------------------------------------------------------ make demo / make test

#: ``python`` for the Makefile: logs its call; as ``python -m venv DIR`` it makes DIR/bin with itself as every tool.
STUB = """#!/bin/sh
echo "$(basename "$0") $*" >> "$MAKE_LOG"
if [ "$1" = "-m" ] && [ "$2" = "venv" ]; then
    eval "venv=\\${$#}"
    mkdir -p "$venv/bin"
    for tool in python lightning-lora ruff mypy; do cp "$0" "$venv/bin/$tool"; done
fi
"""


@pytest.fixture
def make(tmp_path: Path) -> Callable[..., list[str]]:
    """``make(target, *variables)``: run ``make`` on a copy of the Makefile with the stub tools, return the calls."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    for name in ("Makefile", "pyproject.toml", "constraints-cpu.txt"):
        shutil.copy(ROOT / name, tmp_path / name)
    python = tmp_path / "stub" / "python3"
    python.parent.mkdir()
    python.write_text(STUB)
    python.chmod(0o755)
    log = tmp_path / "calls.log"

    def run(target: str, *variables: str) -> list[str]:
        log.write_text("")
        done = subprocess.run(
            ["make", "-s", target, f"PYTHON={python}", *variables],
            cwd=tmp_path,
            env={**os.environ, "MAKE_LOG": str(log)},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        return log.read_text().splitlines()

    return run


def _installs(calls: list[str]) -> list[str]:
    return [call for call in calls if " pip install " in call]


TOOLS = ("ruff ", "mypy", "python -m pytest")


@pytest.mark.subprocess
def test_make_demo_installs_the_demo_extra_and_make_test_then_adds_the_dev_extras(
    make: Callable[..., list[str]], tmp_path: Path
) -> None:
    calls = make("demo")
    assert calls[0] == "python3 -m venv .venv"
    assert _installs(calls) == [
        "python -m pip install --disable-pip-version-check -q -c constraints-cpu.txt torch -e .[demo]"
    ]
    assert any(call.startswith("lightning-lora fit --config configs/tiny_cpu.yaml") for call in calls)
    assert not any(call.startswith(TOOLS) for call in calls), calls
    calls = make("test")
    assert not any("venv" in call for call in calls)
    assert [call.split()[-1] for call in _installs(calls)] == [".[dev]"]
    assert all(any(call.startswith(tool) for call in calls) for tool in TOOLS), calls
    assert _installs(make("demo")) == [] and _installs(make("test")) == []
    # a changed pyproject.toml installs again, each target its own extras
    later = time.time() + 10
    os.utime(tmp_path / "pyproject.toml", (later, later))
    assert [call.split()[-1] for call in _installs(make("demo"))] == [".[demo]"]
    assert [call.split()[-1] for call in _installs(make("test"))] == [".[dev]"]


@pytest.mark.subprocess
def test_make_test_alone_installs_the_dev_extras_which_cover_the_demo(make: Callable[..., list[str]]) -> None:
    calls = make("test")
    assert calls[0] == "python3 -m venv .venv"
    assert [call.split()[-1] for call in _installs(calls)] == [".[dev]"]
    calls = make("demo")
    assert _installs(calls) == [] and any(call.startswith("lightning-lora fit") for call in calls), calls


@pytest.mark.subprocess
def test_make_keeps_the_torch_options(make: Callable[..., list[str]]) -> None:
    """TORCH=keep: a venv that sees the system's torch and no constraint on it; TORCH_INDEX: pip also reads that
    index. (Each run starts a new venv: the stamps live in it.)"""
    calls = make("demo", "TORCH=keep", "VENV=keep")
    assert calls[0] == "python3 -m venv --system-site-packages keep"
    assert _installs(calls) == ["python -m pip install --disable-pip-version-check -q -e .[demo]"]
    calls = make("test", "TORCH_INDEX=https://download.pytorch.org/whl/cpu", "VENV=index")
    assert _installs(calls) == [
        "python -m pip install --disable-pip-version-check -q -c constraints-cpu.txt torch "
        "--extra-index-url https://download.pytorch.org/whl/cpu -e .[dev]"
    ]


def test_the_install_lines_name_the_torch_the_project_tests() -> None:
    """The README's one-line installs (wherever the docs move them) install a torch the project tests, from an index
    pytorch.org names after its CUDA / ROCm / CPU build, then the project with extras that exist: 2.13.0 from the CPU
    index, as CI pins it (constraints-cpu.txt), and the GPU machine's torch from the CUDA index of its build
    (BENCHMARKS.md: "torch 2.11.0+cu130")."""
    pattern = (
        r"pip install torch==(\S+) --index-url https://download\.pytorch\.org/whl/(cpu|cu\d+|rocm[\d.]+) "
        r"&& pip install -e '\.\[([a-z,]+)\]'"
    )
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]
    lines = [m.groups() for doc in docs for m in re.finditer(pattern, doc.read_text())]
    assert {index.rstrip("0123456789.") for _, index, _ in lines} == {"cpu", "cu", "rocm"}, lines
    ci = re.fullmatch(r"torch==(\S+)\+cpu", (ROOT / "constraints-cpu.txt").read_text().strip())
    gpu = set(re.findall(r"torch (\d+\.\d+\.\d+)\+(cu\d+)", (ROOT / "BENCHMARKS.md").read_text()))
    assert ci and gpu
    floor = re.fullmatch(r"torch>=(\d+)\.(\d+)", next(r for r in pyproject()["dependencies"] if r.startswith("torch")))
    assert floor
    extras = pyproject()["optional-dependencies"]
    for version, index, wanted in lines:
        if index == "cpu":
            assert version == ci[1], (version, index)
        else:
            assert version in {v for v, _ in gpu} and (index.startswith("rocm") or (version, index) in gpu), index
        assert tuple(int(part) for part in version.split(".")[:2]) >= (int(floor[1]), int(floor[2]))
        assert set(wanted.split(",")) <= set(extras), wanted
