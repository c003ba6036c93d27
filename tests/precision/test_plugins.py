"""The precision plugins as a user meets them: chosen in ``trainer.plugins`` (YAML or flag) or by a plain
``trainer.precision``, the options that moved there refused with their new name, and ``model.memory`` switching the
base format of the trainer and of the written config together. (Each plugin's fit, exact resume and export:
tests/precision/test_quant.py.)"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from helpers import run_cli, write_config

from lightning_lora.errors import ConfigError
from lightning_lora.precision import BF16, FP8, NF4, PRECISIONS, FP8Compute, for_trainer_precision


def _main_error(capsys: pytest.CaptureFixture[str], args: list[str]) -> str:
    from lightning_lora.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    ("option", "value", "named"),
    [
        ("quantization", {"mode": "nf4"}, "lightning_lora.precision.NF4"),
        ("base_dtype", "fp16", "16-mixed"),
    ],
)
def test_a_moved_option_names_its_replacement(
    tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path, capsys: pytest.CaptureFixture[str], option, value, named
) -> None:
    config = write_config(tmp_path, tiny_flux_dir, photos_dir, **{f"model.{option}": value})
    err = _main_error(capsys, ["fit", "--config", str(config)])
    assert f"model.{option} is no longer an option" in err and named in err, err
    assert len(err.strip().splitlines()) == 1  # one line, no parser dump
    clean = write_config(tmp_path, tiny_flux_dir, photos_dir)
    err = _main_error(capsys, ["fit", "--config", str(clean), "--model.quantization.mode", "fp8"])
    assert "model.quantization is no longer an option" in err and "FP8Compute" in err, err
    assert not (tmp_path / "run").exists()


def test_a_precision_and_a_plugin_together_are_refused(
    tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plugin = {"class_path": "lightning_lora.precision.FP8"}
    config = write_config(tmp_path, tiny_flux_dir, photos_dir, **{"trainer.plugins": plugin})  # beside 32-true
    err = _main_error(capsys, ["fit", "--config", str(config)])
    assert "trainer.precision: 32-true and trainer.plugins: FP8 both set the precision" in err, err


def test_the_plugin_is_named_on_the_command_line(tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path) -> None:
    """``--trainer.plugins lightning_lora.precision.X`` with ``init_args`` flags, as Lightning users write plugins;
    the model's recipe and the trainer then hold the same plugin object."""
    from lightning_lora.cli.fit import LoraCLI

    config = write_config(tmp_path, tiny_flux_dir, photos_dir, **{"trainer.precision": None})
    args = ["--config", str(config), "--trainer.plugins", "lightning_lora.precision.NF4"]
    cli = LoraCLI(args=[*args, "--trainer.plugins.double_quant", "false"], run=False)
    precision = cli.model.recipe.precision
    assert precision == NF4(double_quant=False) and cli.trainer.precision_plugin is precision
    assert cli.model.recipe.source.dtype == torch.bfloat16 and cli.model.hparams["precision"] == precision.spec()
    default = LoraCLI(args=["--config", str(config)], run=False)  # neither: a bf16 base under bf16 autocast
    assert default.model.recipe.precision == BF16() and default.trainer.precision == "bf16-mixed"


def test_a_model_option_the_plugin_cannot_take_stops_before_loading(
    tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    overrides = {"trainer.precision": None, "trainer.plugins": {"class_path": "lightning_lora.precision.NF4"}}
    config = write_config(tmp_path, tiny_flux_dir, photos_dir, **overrides, **{"model.lora.variant": "lokr"})
    err = _main_error(capsys, ["fit", "--config", str(config)])
    assert "model.lora.variant: lokr" in err and "lightning_lora.precision.FP8" in err, err
    assert not (tmp_path / "cache").exists()  # nothing cached, nothing loaded


FP16_ON_CPU = "ignore:torch.cuda.amp.GradScaler is enabled, but CUDA is not available"
"""fp16 autocast's gradient scaler is made for CUDA, as Lightning's 16-mixed makes it; this machine has no GPU."""


@pytest.mark.filterwarnings(FP16_ON_CPU)
@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed", "32-true", "bf16-true", "16-true", "64-true"])
def test_a_plain_trainer_precision_is_the_bf16_plugin_or_refused(precision: str) -> None:
    if precision.endswith("-true") and precision != "32-true":
        with pytest.raises(ConfigError, match=rf"trainer.precision: {precision} is not supported.*plugins"):
            for_trainer_precision(precision)
        return
    plugin = for_trainer_precision(precision)
    assert plugin == BF16(dtype={"bf16-mixed": "bf16", "16-mixed": "fp16", "32-true": "fp32"}[precision])
    assert plugin.precision == precision and plugin.autocasts is (precision != "32-true")
    assert (plugin.scaler is not None) is (precision == "16-mixed")  # fp16 autocast needs a gradient scaler


@pytest.mark.filterwarnings(FP16_ON_CPU)
@pytest.mark.parametrize(
    ("alias", "dtype"), [("32", "fp32"), (32, "fp32"), ("16", "fp16"), (16, "fp16"), ("bf16", "bf16")]
)
def test_lightnings_precision_aliases_are_what_they_stand_for(alias: object, dtype: str) -> None:
    """Lightning documents ``32``, ``16`` and ``bf16`` as ``32-true``, ``16-mixed`` and ``bf16-mixed`` (a YAML
    ``precision: 32`` is the number): each is the same plugin as its full name."""
    assert for_trainer_precision(alias) == BF16(dtype=dtype)  # type: ignore[arg-type]


def test_the_64_alias_is_refused_for_what_it_does() -> None:
    """``64`` means ``64-true``: refused for casting the base to float64, not with the 16-bit LoRA's reason."""
    with pytest.raises(ConfigError, match=r"trainer.precision: 64 \(64-true\) is not supported.*float64") as refused:
        for_trainer_precision("64")
    assert "bf16" not in str(refused.value).split("Use ")[0]


def test_a_precision_alias_on_the_command_line_plans(tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path) -> None:
    """``--trainer.precision 32`` (a full-fp32 request) plans a float32 base instead of being refused."""
    from lightning_lora.cli.plan import PlanCLI

    config = write_config(tmp_path, tiny_flux_dir, photos_dir)
    cli = PlanCLI(args=["--config", str(config), "--trainer.precision", "32"], run=False)
    assert cli.model.recipe.precision == BF16(dtype="fp32")


def test_autocast_follows_the_dtype_on_the_bound_device() -> None:
    bf16, fp32 = BF16(), BF16(dtype="fp32")
    for plugin in (bf16, fp32):
        plugin.bind(torch.device("cpu"))
    layer = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with bf16.forward_context():
        assert layer(x).dtype == torch.bfloat16
    with fp32.forward_context():
        assert layer(x).dtype == torch.float32


@pytest.mark.filterwarnings(FP16_ON_CPU)
def test_a_plugin_is_a_value_that_round_trips_through_its_spec() -> None:
    """The recipe compares plugins, ``model.memory`` swaps their class keeping the rest, and the written config holds
    the spec: all three agree."""
    plugin = NF4(double_quant=False, dtype="fp16", skip=["proj_out"])
    spec = plugin.spec()
    assert spec["class_path"] == "lightning_lora.precision.NF4"
    assert PRECISIONS["NF4"](**spec["init_args"]) == plugin and hash(NF4(**spec["init_args"])) == hash(plugin)
    assert plugin != NF4(dtype="fp16", skip=["proj_out"]) and plugin != FP8(dtype="fp16")
    fp8 = plugin.as_format("FP8Compute")
    assert isinstance(fp8, FP8Compute) and fp8.dtype == "fp16" and fp8.skip == ["proj_out"]
    assert fp8.base_dtype == torch.float16 and BF16(dtype="fp32").base_dtype == torch.float32
    with pytest.raises(ConfigError, match=r"trainer.plugins: BF16\(dtype='fp64'\)"):
        BF16(dtype="fp64")  # type: ignore[arg-type]


def test_memory_auto_switches_the_trainers_plugin_and_the_written_config(
    tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only an FP8 base fits the (fake) card: the run trains with the FP8 plugin (the trainer's too, keeping the
    config's fp32 dtype), config.yaml names it under trainer.plugins, and that config runs again as written."""
    from lightning_lora import hardware
    from lightning_lora.plan import search

    monkeypatch.setattr(hardware, "free_memory_gib", lambda device: 24.0)
    fits = lambda recipe, data, optimizer="AdamW", shards=1, ema_copies=0: SimpleNamespace(  # noqa: E731
        run_peak=18.0 if isinstance(recipe.precision, FP8) else 30.0
    )
    monkeypatch.setattr(search, "plan_for", fits)
    config = write_config(tmp_path, tiny_flux_dir, photos_dir, **{"trainer.max_steps": 2, "model.memory": "auto"})
    cli = run_cli(["fit", "--config", str(config)])
    precision = cli.model.recipe.precision
    assert precision == FP8(dtype="fp32") and cli.trainer.precision_plugin is precision
    assert any(type(m).__name__ == "FP8Linear" for m in cli.model.denoiser.modules())
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["trainer"]
    assert saved["precision"] is None
    assert saved["plugins"][-1] == {"class_path": "lightning_lora.precision.FP8", "init_args": precision.options()}
    monkeypatch.setattr(hardware, "free_memory_gib", lambda device: 80.0)  # the written config is the choice itself
    written = str(tmp_path / "run" / "config.yaml")
    again = run_cli(
        ["fit", "--config", written, "--model.memory", "as_configured", "--trainer.default_root_dir", str(tmp_path)]
    )
    assert again.model.recipe.precision == FP8(dtype="fp32")


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_gradients_of_a_fused_optimizer_are_clipped_without_a_gradient_scaler(dtype: str) -> None:
    """``torch.optim.AdamW(fused=True)`` steps every LoRA tensor in one kernel, and it may unscale gradients itself:
    Lightning's mixed precision then refused ``trainer.gradient_clip_val`` outright. Without a gradient scaler (bf16,
    fp32) the gradients are the true ones: clipped by their norm as for any optimizer."""
    params = [torch.nn.Parameter(torch.zeros(3, 4)), torch.nn.Parameter(torch.zeros(5))]
    for p in params:
        p.grad = torch.full_like(p, 3.0)
    optimizer = torch.optim.AdamW(params, lr=1e-3, fused=True)
    assert optimizer._step_supports_amp_scaling  # what Lightning's refusal reads
    BF16(dtype=dtype).clip_gradients(optimizer, 1.0)  # type: ignore[arg-type]
    norm = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in params]))  # type: ignore[union-attr]
    assert norm.item() == pytest.approx(1.0, rel=1e-5)


@pytest.mark.filterwarnings("ignore:torch.cuda.amp.GradScaler is enabled, but CUDA is not available")
def test_a_fused_optimizer_with_a_gradient_scaler_is_still_refused_clipping() -> None:
    """With fp16's gradient scaler the gradients would be clipped while still scaled: Lightning's refusal stands."""
    plugin = BF16(dtype="fp16")
    assert plugin.scaler is not None
    param = torch.nn.Parameter(torch.zeros(4))
    param.grad = torch.ones(4)
    with pytest.raises(RuntimeError, match="fused"):
        plugin.clip_gradients(torch.optim.AdamW([param], fused=True), 1.0)
