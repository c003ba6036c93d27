"""The CPU demo's entry point (:mod:`lightning_lora.cli.demo`), as ``make demo`` runs it."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.mark.subprocess
def test_the_demo_prints_its_two_lines(tmp_path: Path) -> None:
    """`make demo`'s first step, as it runs: the tiny pipelines and photos are written, and the console shows where
    they are and nothing else (no library note, no save progress bar)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "lightning_lora.cli.demo", "--out", str(tmp_path / ".demo")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = (done.stdout + done.stderr).splitlines()
    assert [line.split(":")[0] for line in lines] == ["demo model", "demo photos"], lines
    assert (tmp_path / ".demo" / "tiny-flux" / "model_index.json").is_file()


TINY_CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("tiny_*_cpu.yaml"))


@pytest.mark.parametrize("config", TINY_CONFIGS, ids=[p.stem for p in TINY_CONFIGS])
def test_every_tiny_config_trains_on_what_the_demo_writes(config: Path) -> None:
    """A tiny config names only what the demo writes (:func:`lightning_lora.cli.demo.prepare`): a tiny pipeline of a
    registered family, the photos, and the edit pairs (the photos' negatives, their controls the photos, matched by
    name); its fixed sample controls are demo photos."""
    import yaml

    from lightning_lora.cli.demo import PHOTOS, tiny_models

    doc = yaml.safe_load(config.read_text())
    pretrained = doc["model"]["pretrained"]
    assert pretrained.removeprefix(".demo/") in tiny_models()
    family = tiny_models()[pretrained.removeprefix(".demo/")]
    assert doc["model"]["family"]["class_path"] == f"lightning_lora.families.{family.__name__}"
    images = doc["data"]["images"]
    folders = [f if isinstance(f, dict) else {"path": f} for f in (images if isinstance(images, list) else [images])]
    for folder in folders:
        controls = folder.get("controls", [])
        assert (folder["path"], controls) in ((".demo/photos", []), (".demo/edits", [".demo/photos"])), folder
    assert family.editing.takes_controls or not any(f.get("controls") for f in folders)
    sampler = next(c for c in doc["trainer"]["callbacks"] if c["class_path"].endswith("SampleImages"))["init_args"]
    for paths in sampler.get("controls") or []:
        assert all(p.startswith(".demo/photos/") and Path(p).stem in PHOTOS and p.endswith(".png") for p in paths)
    if family.editing.needs_controls or family.editing.prompt_sees_controls:  # each sample draws from a photo
        assert len(sampler["controls"]) == len(sampler["prompts"]) and all(sampler["controls"])
