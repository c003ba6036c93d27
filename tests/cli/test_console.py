"""What the console shows: our lines on stdout (errors alone on stderr), no library chatter, each LoRA file named once,
our warnings as one plain line, and the demo's progress bar (in a log: a line every tenth of the run). In-process."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import yaml
from helpers import REPO, write_config

from lightning_lora.cli import main
from lightning_lora.cli.console import Console

LIBRARY_LINES = re.compile(r"Seed set|GPU available|TPU available|litlogger|torchvision|Tip:|UserWarning")


def _demo_config(tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path, steps: int) -> Path:
    """configs/tiny_cpu.yaml as ``make demo`` runs it (its progress bar, callbacks and LoRA formats), on the test's
    tiny model and photos, ``steps`` steps long."""
    config = yaml.safe_load((REPO / "configs" / "tiny_cpu.yaml").read_text())
    config["trainer"].update(default_root_dir=str(tmp_path / "run"), max_steps=steps)
    config["trainer"]["callbacks"] = [
        c for c in config["trainer"]["callbacks"] if "SampleImages" not in c["class_path"]
    ]
    config["model"]["pretrained"] = str(tiny_flux_dir)
    config["data"].update(images=str(photos_dir), cache_dir=str(tmp_path / "cache"))
    path = tmp_path / "demo.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_the_demo_shows_its_progress_and_one_stream(
    tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The demo config shows a progress bar (here not a terminal: plain lines); the cache summary, the start summary,
    the progress and the run summary are on stdout in that order, with no library line; stderr is empty; each LoRA file
    is named once (the summary)."""
    main(["fit", "--config", str(_demo_config(tmp_path, tiny_flux_dir, photos_dir, steps=10))])  # exit status 0
    out, err = capsys.readouterr()
    assert not err.strip(), err
    assert not LIBRARY_LINES.search(out), LIBRARY_LINES.search(out)
    progress = [line for line in out.splitlines() if line.startswith("step ")]
    assert progress[0].startswith("step 1/10  loss ") and progress[-1].startswith("step 10/10  loss "), progress
    assert len(progress) == 10 and "0:00 left" in progress[-1]
    order = [out.index(text) for text in ("images found:", "Training: steps 0 -> 10", "step 1/10", "Run folder:")]
    assert order == sorted(order), out
    lora = tmp_path / "run" / "lora" / "demo-lora.kohya.safetensors"
    assert lora.is_file() and out.count(str(lora)) == 1, out
    # diffusers' kohya FLUX converter reads FLUX.1's widths only: the tiny model's kohya file is not said to load there
    assert f"{lora}  (loads in ComfyUI, kohya's sd-scripts)" in out, out
    assert "First optimizer step" not in out  # nothing compiled: nothing to say


def test_cache_prints_no_library_line(
    tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``cache`` printed 6 library lines (Seed set, GPU available, TPU, the litlogger tip, transformers' torchvision
    notes); they go to the run log, as during ``fit``."""
    config = write_config(tmp_path, tiny_flux_dir, photos_dir)
    with pytest.raises(SystemExit) as exit_info:
        main(["cache", "--config", str(config)])
    assert exit_info.value.code == 0
    out, err = capsys.readouterr()
    assert out.startswith("Cache ") and "latents:" in out, out
    assert not LIBRARY_LINES.search(out + err), out + err
    assert not err.strip(), err
    assert "Seed set to 7" in (tmp_path / "run" / "lightning-lora.log").read_text()


def test_our_warning_is_one_plain_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A warning of lightning-lora printed with its source path first (``.../model/assembly.py:73: UserWarning``): one
    plain line on stdout, and the run log keeps where it came from."""
    source = str(Path(__file__).parents[2] / "lightning_lora" / "model" / "assembly.py")
    with Console() as console, warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn_explicit("model: FP8 on a CPU runs slowly", UserWarning, source, 73)
        console.attach(tmp_path)
    out, err = capsys.readouterr()
    assert out == "warning: model: FP8 on a CPU runs slowly\n" and not err
    assert f"({source}:73)" in (tmp_path / "lightning-lora.log").read_text()
