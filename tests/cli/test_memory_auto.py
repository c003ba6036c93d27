"""``model.memory: auto``: fit measures the GPU's free memory and takes the fastest settings that fit, says so, writes
them into config.yaml, and a resume keeps them. The device is faked (this machine has no GPU)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from helpers import run_cli, write_config

from lightning_lora.data.recipe import DataRecipe
from lightning_lora.families import Flux
from lightning_lora.families.base import ModelSource
from lightning_lora.lora import LoraOptions
from lightning_lora.model.recipe import ModelRecipe
from lightning_lora.plan import choose_for_memory, plan_for


@pytest.mark.parametrize("gib", [8, 12, 16, 24, 32])
def test_the_fastest_settings_that_fit_each_card(gib: int) -> None:
    """FLUX.1-dev in bf16 at 512x512, rank 16 (as flux_4090.yaml without its memory options): each card gets settings
    the planner says fit, and nothing faster fits (the settings are tried fastest first)."""
    recipe = ModelRecipe(Flux(), ModelSource("black-forest-labs/FLUX.1-dev"), LoraOptions(rank=16))
    data = DataRecipe(resolutions=(512,), batch_size=1)
    fit = choose_for_memory(recipe, data, gib)
    assert fit is not None and fit.peak_gib <= 0.95 * gib
    chosen = recipe.replace(**fit.changes)
    assert plan_for(chosen, data).run_peak == pytest.approx(fit.peak_gib)  # the steps and the samples
    # The bf16 base (22 GiB) needs a 32 GB card; 24 and 16 GB take FP8, smaller ones NF4.
    expected = {32: "BF16", 24: "FP8", 16: "FP8", 12: "NF4", 8: "NF4"}[gib]
    assert type(chosen.precision).__name__ == expected, fit.flags
    assert chosen.lora == recipe.lora  # never another adapter, batch or image: the same training


def _fake_device(monkeypatch: pytest.MonkeyPatch, free_gib: float) -> None:
    """A GPU with ``free_gib`` free, on which this tiny model needs 30 GiB as configured and 18 with checkpointing."""
    from lightning_lora import hardware
    from lightning_lora.plan import search

    monkeypatch.setattr(hardware, "free_memory_gib", lambda device: free_gib)
    monkeypatch.setattr(
        search,
        "plan_for",
        lambda recipe, data, optimizer="AdamW", shards=1, ema_copies=0: SimpleNamespace(
            run_peak=18.0 if recipe.gradient_checkpointing else 30.0
        ),
    )


def test_fit_sizes_itself_writes_the_choice_and_a_resume_keeps_it(
    tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    config = write_config(tmp_path, tiny_flux_dir, photos_dir, **{"trainer.max_steps": 2, "model.memory": "auto"})
    _fake_device(monkeypatch, 24.0)
    with caplog.at_level("INFO"):
        cli = run_cli(["fit", "--config", str(config)])
    assert cli.model.recipe.gradient_checkpointing is True and cli.model.recipe.checkpoint_every == 3
    assert "model.memory: auto: 24.0 GiB free" in caplog.text and "--model.gradient_checkpointing true" in caplog.text
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["model"]
    assert saved["gradient_checkpointing"] is True and saved["checkpoint_every"] == 3  # a rerun of it is the same
    # A resume on an emptier card keeps the run's settings (the checkpoint holds them).
    _fake_device(monkeypatch, 80.0)
    resumed = run_cli(["fit", "--config", str(config), "--ckpt_path", "last", "--trainer.max_steps", "3"])
    assert resumed.trainer.global_step == 3
    assert resumed.model.recipe.gradient_checkpointing is True and resumed.model.recipe.checkpoint_every == 3


def test_nothing_that_fits_is_one_clear_line(
    tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    from lightning_lora.cli import main

    config = write_config(tmp_path, tiny_flux_dir, photos_dir, **{"model.memory": 4.0})
    _fake_device(monkeypatch, 80.0)  # a number in the config wins over the measurement
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(config)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "model.memory: 4.0: no setting that keeps this training fits in 4 GiB" in err and "plan" in err, err
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize("gib", [0.0, -3.0, float("nan"), float("inf")])
def test_a_memory_that_is_no_card_size_is_refused(tiny_flux_dir: Path, gib: float) -> None:
    from lightning_lora.errors import ConfigError
    from lightning_lora.module import LoraModule

    with pytest.raises(ConfigError, match="model.memory: .* GiB must be positive"):
        LoraModule(pretrained=str(tiny_flux_dir), memory=gib)
