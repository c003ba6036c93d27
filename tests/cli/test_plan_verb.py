"""The ``lightning-lora plan`` command: a run's memory plan from its config, for every family, without training and
without writing anything. The planner itself is tested in tests/plan/test_plan.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import write_config

from lightning_lora.cli import main


@pytest.mark.parametrize("fixture", ["tiny_flux_dir", "tiny_sdxl_dir", "tiny_sd15_dir"])
def test_plan_verb(tmp_path: Path, photos_dir: Path, capsys, request: pytest.FixtureRequest, fixture: str) -> None:
    family = {"tiny_flux_dir": "Flux", "tiny_sdxl_dir": "SDXL", "tiny_sd15_dir": "SD15"}[fixture]
    config = write_config(
        tmp_path,
        request.getfixturevalue(fixture),
        photos_dir,
        **{"model.family": {"class_path": f"lightning_lora.families.{family}"}, "data.resolution": 64},
    )
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--config", str(config), "--vram", "0.01"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "training peak" in out and "does NOT fit in 0.01 GiB" in out
    assert not (tmp_path / "run").exists()  # planning writes nothing


def test_plan_verb_plans_each_gpu_of_a_sharded_base(
    tmp_path: Path, photos_dir: Path, tiny_flux_dir: Path, capsys
) -> None:
    """``trainer.strategy: fsdp`` over ``trainer.devices: 2`` is planned per GPU, sharded (the numbers are
    tests/plan/test_plan.py's); DDP over 2 GPUs is not (each GPU holds the whole base)."""

    def report(**options: object) -> str:
        config = write_config(tmp_path, tiny_flux_dir, photos_dir, **{"data.resolution": 64, **options})
        with pytest.raises(SystemExit) as exit_info:
            main(["plan", "--config", str(config)])
        assert exit_info.value.code == 0
        return capsys.readouterr().out

    assert "sharded over" not in report(**{"trainer.devices": 2})
    assert "sharded over 2 GPUs (trainer.strategy: fsdp)" in report(
        **{"trainer.strategy": "fsdp", "trainer.devices": 2}
    )


@pytest.mark.parametrize(
    "args", [["--vram", "-3"], ["--vram", "0"], ["--vram", "nan"], ["--vram", "inf"], ["--gpu", "RTX 0GB"]]
)
def test_a_card_size_that_is_no_memory_is_one_line(
    tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path, capsys, args: list[str]
) -> None:
    """``--vram -3`` got "does NOT fit in -3 GiB" and ``--vram inf`` "fits": no verdict means anything there."""
    config = write_config(tmp_path, tiny_flux_dir, photos_dir)
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--config", str(config), *args])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    lines = [line for line in (captured.out + captured.err).splitlines() if line]
    assert len(lines) == 1 and f"{args[0]} " in lines[0] and "is not a card's memory" in lines[0], lines
