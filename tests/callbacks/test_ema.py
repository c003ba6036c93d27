"""The EMA of the LoRA and the best LoRA in a tiny run: both measured and drawn beside the raw weights, in every
layout, post-hoc EMA from the snapshots, and a run stopped and resumed that ends with the same files, bit for bit.

One reference run (6 steps of tiny FLUX, a checkpoint every step) with a ``LoraEMA`` keeping snapshots every 2 steps,
a ``FixedEvalLoss`` every 2 steps (its drift prompts the family's) and a ``LoraExport`` writing both layouts and the
best LoRA; the other tests read what it wrote.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from helpers import REPO, fit_in_subprocess, resume_config, run_cli, write_config
from helpers.resume import assert_same_run
from safetensors.torch import load_file

from lightning_lora import ema
from lightning_lora.callbacks import FixedEvalLoss, LoraEMA, LoraExport
from lightning_lora.cli.export import main as export_main
from lightning_lora.cli.fit import main as fit_main
from lightning_lora.errors import ConfigError
from lightning_lora.export import checkpoint_lora, export_lora, read_metadata
from lightning_lora.lora import adapter_state

STEPS = 6
CALLBACKS: list[dict[str, Any]] = [
    {"class_path": "lightning_lora.callbacks.LoraEMA", "init_args": {"decay": 0.8, "snapshot_every": 2}},
    {"class_path": "lightning_lora.callbacks.FixedEvalLoss", "init_args": {"every_n_steps": 2}},
    {
        "class_path": "lightning_lora.callbacks.LoraExport",
        "init_args": {"formats": ["diffusers", "kohya"], "best": True},
    },
    {
        "class_path": "lightning_lora.callbacks.SampleImages",
        "init_args": {"prompts": ["a photo of sks cat"], "every_n_steps": 0, "steps": 2, "height": 32, "width": 32},
    },
]
FILES = ("lora", "lora.ema", "lora.best")
LAYOUTS = (".safetensors", ".kohya.safetensors")


def _config(root: Path, model_dir: Path, photos: Path, name: str, cache: Path | None = None) -> Path:
    """A :func:`helpers.resume_config` run of :data:`STEPS` steps with :data:`CALLBACKS` (``cache``: another run's
    cache folder, whose entries it reuses)."""
    return resume_config(root, model_dir, photos, name, steps=STEPS, cache=cache, callbacks=CALLBACKS)


def _scalars(run: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run), size_guidance={"images": 0}).Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, tiny_flux_dir: Path, photos_dir: Path) -> Path:
    """The reference run's config (its run folder is beside it, ``run/``)."""
    root = tmp_path_factory.mktemp("ema")
    config = _config(root, tiny_flux_dir, photos_dir, "a")
    cli = run_cli(["fit", "--config", str(config)])
    assert cli.trainer.global_step == STEPS
    return config


def test_eval_loss_and_drift_for_raw_and_ema_weights_in_tensorboard(reference: Path) -> None:
    run = reference.parent / "run"
    scalars = _scalars(run)
    for tag in ("eval/loss", "eval/loss_ema", "eval/drift", "eval/drift_ema"):
        assert [step for step, _ in scalars[tag]] == [0, 2, 4, 6], tag
    # Before the first step the EMA is the raw LoRA; after, it lags behind it.
    assert scalars["eval/loss_ema"][0] == scalars["eval/loss"][0]
    assert all(a != b for (_, a), (_, b) in zip(scalars["eval/loss"][1:], scalars["eval/loss_ema"][1:], strict=True))
    # ...and in the HParams table, beside the run's options.
    assert {"hp/eval_loss", "hp/eval_loss_ema", "hp/eval_drift", "hp/eval_drift_ema"} <= set(scalars)
    samples = sorted(p.name for p in (run / "samples").iterdir())
    assert samples == ["step000000_00.png", "step000006_00.png", "step000006_00_ema.png"]


def test_raw_ema_and_best_lora_in_every_layout(reference: Path) -> None:
    lora = reference.parent / "run" / "lora"
    for stem in FILES:
        for suffix in LAYOUTS:
            assert (lora / f"{stem}{suffix}").is_file(), f"{stem}{suffix}"
    raw, averaged = load_file(lora / "lora.safetensors"), load_file(lora / "lora.ema.safetensors")
    assert raw.keys() == averaged.keys() and any(not torch.equal(raw[k], averaged[k]) for k in raw)
    # The best LoRA is the LoRA of the step with the lowest counted eval/loss.
    evaluation = _scalars(reference.parent / "run")["eval/loss"]
    best_step = min(evaluation, key=lambda sv: sv[1])[0]
    assert read_metadata(lora / "lora.best.safetensors")["lightning_lora.steps"] == str(best_step)
    assert read_metadata(lora / "lora.safetensors")["lightning_lora.training_precision"] == "fp32"


def test_export_ema_from_the_checkpoint_is_the_runs_ema_file(reference: Path, tmp_path: Path) -> None:
    last = reference.parent / "run" / "checkpoints" / "last.ckpt"
    out = tmp_path / "ema.safetensors"
    assert export_main([str(last), "--ema", "--format", "diffusers", "--out", str(out)]) == 0
    written, exported = load_file(reference.parent / "run" / "lora" / "lora.ema.safetensors"), load_file(out)
    assert written.keys() == exported.keys() and all(torch.equal(written[k], exported[k]) for k in written)
    assert read_metadata(out)["lightning_lora.ema"].startswith("EMA of decay 0.8 at step 6")


@pytest.mark.parametrize("layout", ["diffusers", "kohya"])
def test_posthoc_ema_of_a_tracked_width_matches_it(reference: Path, tmp_path: Path, layout: str, capsys) -> None:
    """``export --ema-sigma-rel 0.1`` rebuilds the power-function EMA of width 0.10 from the snapshots (steps 2, 4)
    and the checkpoint's averages (step 6); the run tracked that width directly, and its LoRA written the same way is
    the same to float32 rounding (the least squares give it weight 1 up to ~1e-12)."""
    run = reference.parent / "run"
    assert sorted(p.name for p in (run / "ema").iterdir()) == [ema.snapshot_name(s) for s in (2, 4, 6)]
    last = run / "checkpoints" / "last.ckpt"
    out = tmp_path / f"phema-{layout}.safetensors"
    assert export_main([str(last), "--ema-sigma-rel", "0.1", "--format", layout, "--out", str(out)]) == 0
    assert "post-hoc EMA: sigma_rel 0.1 after 6 steps, from 6 power-function EMAs" in capsys.readouterr().out
    state, options, family, info = checkpoint_lora(last)
    saved = torch.load(last, weights_only=True)["callbacks"]["LoraEMA"]
    tracked = adapter_state(saved["power"][saved["sigma_rels"].index(0.1)])
    direct = tmp_path / "direct.safetensors"
    export_lora(tracked, direct, format=layout, lora=options, family=family, info={})  # type: ignore[arg-type]
    rebuilt, expected = load_file(out), load_file(direct)
    assert rebuilt.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(rebuilt[key], value, rtol=1e-5, atol=1e-7, msg=key)
    raw = load_file(run / "lora" / f"lora{LAYOUTS[layout == 'kohya']}")  # the raw LoRA differs: not a vacuous match
    assert raw.keys() == rebuilt.keys() and any(not torch.allclose(raw[k], rebuilt[k]) for k in raw)


def test_stopped_and_resumed_with_ema_and_best_is_exact(
    reference: Path, tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path
) -> None:
    """Stopped at step 3 (between two snapshots and two evaluations) and resumed: the same LoRA, EMA and best LoRA,
    the same snapshots and losses, bit for bit."""
    config = _config(tmp_path, tiny_flux_dir, photos_dir, "b", cache=reference.parent.parent / "cache")
    run_cli(["fit", "--config", str(config), "--trainer.max_steps", "3"])
    cli = run_cli(["fit", "--config", str(config), "--ckpt_path", "last"])
    assert cli.trainer.global_step == STEPS
    _assert_same_outputs(reference, config, after_step=3)


@pytest.mark.subprocess
def test_killed_and_resumed_with_ema_and_best_is_exact(
    reference: Path, tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path
) -> None:
    """SIGKILL before batch 5 (after the step-4 snapshot, evaluation and best LoRA, and step 5's checkpoint), then
    ``--ckpt_path last`` without the kill switch: the same files as the run that never stopped."""
    kill = {"class_path": "helpers.crash.KillAt", "init_args": {"batch": 5}}
    cache, callbacks = reference.parent.parent / "cache", [*CALLBACKS, kill]
    config = resume_config(tmp_path, tiny_flux_dir, photos_dir, "k", steps=STEPS, cache=cache, callbacks=callbacks)
    killed = fit_in_subprocess(config)
    assert killed.returncode == -9, f"expected SIGKILL, got {killed.returncode}: {killed.stderr[-2000:]}"
    data = yaml.safe_load(config.read_text())
    data["trainer"]["callbacks"] = [c for c in data["trainer"]["callbacks"] if "KillAt" not in c["class_path"]]
    config.write_text(yaml.safe_dump(data))
    assert run_cli(["fit", "--config", str(config), "--ckpt_path", "last"]).trainer.global_step == STEPS
    _assert_same_outputs(reference, config, after_step=5)


def _assert_same_outputs(reference: Path, config: Path, after_step: int) -> None:
    """The run of ``config`` wrote what the reference run wrote: the LoRA, EMA and best files in both layouts, the
    snapshots, bit for bit; the same losses and EMA metrics after ``after_step``."""
    assert_same_run(reference, config, after_step=after_step)
    a, b = reference.parent / "run", config.parent / "run"
    for stem in FILES:
        for suffix in LAYOUTS:
            first, second = load_file(a / "lora" / f"{stem}{suffix}"), load_file(b / "lora" / f"{stem}{suffix}")
            assert first.keys() == second.keys()
            assert all(torch.equal(first[k], second[k]) for k in first), f"{stem}{suffix} differs after resume"
    assert sorted(p.name for p in (a / "ema").iterdir()) == sorted(p.name for p in (b / "ema").iterdir())
    for snapshot in (a / "ema").iterdir():
        first, second = load_file(snapshot), load_file(b / "ema" / snapshot.name)
        assert all(torch.equal(first[k], second[k]) for k in first), snapshot.name
    curves = _scalars(a), _scalars(b)
    for tag in ("eval/loss_ema", "eval/drift_ema"):
        later = [v for s, v in curves[0][tag] if s > after_step]
        assert later and [v for s, v in curves[1][tag] if s > after_step] == later, tag


def test_options_are_typed_and_refused_with_the_fix() -> None:
    with pytest.raises(ConfigError, match=r"LoraEMA.decay: 1.5 must be between 0 and 1"):
        LoraEMA(decay=1.5)
    with pytest.raises(ConfigError, match=r"LoraEMA.sigma_rels: 0.5 is not a power-function EMA width"):
        LoraEMA(sigma_rels=(0.5,), snapshot_every=10)
    with pytest.raises(ConfigError, match="LoraEMA.snapshot_every: -1"):
        LoraEMA(snapshot_every=-1)
    with pytest.raises(ConfigError, match="FixedEvalLoss.patience: 3 evaluations, but every_n_steps is 0"):
        FixedEvalLoss(patience=3)
    assert LoraEMA(snapshot_every=5).copies == 3 and LoraEMA().copies == 1
    assert LoraExport(weights="ema", best=True).best


@pytest.mark.parametrize(
    ("callbacks", "message"),
    [
        (
            [{"class_path": "lightning_lora.callbacks.LoraExport", "init_args": {"weights": "ema"}}],
            "LoraExport.weights: ema needs a LoraEMA callback",
        ),
        (
            [{"class_path": "lightning_lora.callbacks.FixedEvalLoss", "init_args": {"monitor": "eval/loss_ema"}}],
            "FixedEvalLoss.monitor: eval/loss_ema needs a LoraEMA callback",
        ),
        (
            [{"class_path": "lightning_lora.callbacks.FixedEvalLoss", "init_args": {"monitor": "val/loss"}}],
            "FixedEvalLoss.monitor: val/loss needs held-out images",
        ),
    ],
    ids=["ema-file-without-ema", "ema-monitor-without-ema", "val-monitor-without-held-out-images"],
)
def test_an_option_that_cannot_work_is_one_line_before_training(
    reference: Path, tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path, capsys, callbacks: list[Any], message: str
) -> None:
    cache = reference.parent.parent / "cache"  # the reference run's: nothing to encode
    config = resume_config(tmp_path, tiny_flux_dir, photos_dir, "c", steps=2, cache=cache, callbacks=callbacks)
    assert fit_main(["fit", "--config", str(config)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert not (config.parent / "run" / "checkpoints").exists()


def test_plan_counts_the_emas_copies_of_the_lora(
    tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``lightning-lora plan`` with a ``LoraEMA`` keeping snapshots (read from the config's callbacks, none built):
    three float32 copies of the LoRA (the EMA and two power-function EMAs) in the training peak, the snapshots' disk
    in a note."""
    from lightning_lora.cli import main
    from lightning_lora.data.recipe import DataRecipe
    from lightning_lora.families.base import ModelSource
    from lightning_lora.families.flux import Flux
    from lightning_lora.lora import LoraOptions
    from lightning_lora.model.recipe import ModelRecipe
    from lightning_lora.plan import plan_for, search

    ema_callback = {"class_path": "lightning_lora.callbacks.LoraEMA", "init_args": {"snapshot_every": 2}}
    config = write_config(tmp_path, tiny_flux_dir, photos_dir, **{"trainer.callbacks": [ema_callback]})
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--config", str(config)])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0, out
    assert re.search(r"^  EMA of the LoRA \(fp32\) +\d+\.\d\d GiB$", out, re.MULTILINE), out
    assert "LoraEMA: 3 float32 copies of the LoRA on the GPU (counted above); a snapshot of" in out
    assert "on disk every 2 steps, 4 by trainer.max_steps" in out  # write_config: 8 steps
    recipe = ModelRecipe(Flux(), ModelSource(str(tiny_flux_dir)), LoraOptions(rank=4))
    plain, averaged = plan_for(recipe, DataRecipe()), plan_for(recipe, DataRecipe(), ema_copies=3)
    assert plain.ema == 0 and averaged.ema == pytest.approx(3 * plain.lora) and plain.lora > 0
    assert averaged.peak_gib == pytest.approx(plain.peak_gib + 3 * plain.lora)
    assert averaged.sampling_peak == pytest.approx(plain.sampling_peak + 4 * plain.lora)  # and the raw LoRA aside
    # the search (plan's suggestions, model.memory) plans with them too
    chosen = [search.choose_for_memory(recipe, DataRecipe(), 80.0, ema_copies=n) for n in (0, 3)]
    assert [c.peak_gib if c else None for c in chosen] == [plain.run_peak, averaged.run_peak], chosen


@pytest.mark.parametrize(
    ("callback", "options"),
    [
        ("LoraEMA", ("decay", "sigma_rels", "snapshot_every", "dirname")),
        ("FixedEvalLoss", ("drift_prompts", "monitor", "patience", "min_delta", "check_bf16_base")),
        ("LoraExport", ("weights", "best")),
    ],
)
def test_fit_help_names_the_options(callback: str, options: tuple[str, ...], capsys) -> None:
    """``fit --help`` lists the callbacks (its ``--trainer.callbacks`` subclasses) and ``--trainer.callbacks.help``
    gives each one's typed options, as for every Lightning callback."""
    with pytest.raises(SystemExit) as exit_info:
        fit_main(["fit", "--trainer.callbacks.help", f"lightning_lora.callbacks.{callback}"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0, out
    for option in options:
        assert f"--trainer.callbacks.{option} " in out, option
    if callback == "LoraEMA":
        with pytest.raises(SystemExit):
            fit_main(["fit", "--help"])
        assert "lightning_lora.LoraEMA" in capsys.readouterr().out.replace("\n", "").replace(" ", "")


SHIPPED = sorted(p for p in (REPO / "configs").glob("*.yaml") if not p.name.startswith("tiny_"))
_COMMENTED_KEY = re.compile(r"^(\s+)# (\s*(?:- )?[a-z_]+:(?: .*)?)$")


def test_shipped_configs_keep_the_last_and_the_best_lora() -> None:
    for config in SHIPPED:
        callbacks = yaml.safe_load(config.read_text())["trainer"]["callbacks"]
        exports = [c for c in callbacks if c["class_path"] == "lightning_lora.callbacks.LoraExport"]
        assert len(exports) == 1 and exports[0]["init_args"].get("best") is True, config.name


def test_a_shipped_configs_commented_keys_turn_each_feature_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """``flux_4090.yaml`` with its commented keys uncommented: the EMA callback with snapshots, the monitor, patience
    and drift prompts, held-out images; the config parses with every one of them set."""
    shipped = (REPO / "configs" / "flux_4090.yaml").read_text().splitlines()
    lines = [_COMMENTED_KEY.sub(r"\1\2", line) for line in shipped]
    config = tmp_path / "flux_4090_all.yaml"
    config.write_text("\n".join(lines) + "\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        fit_main(["fit", "--config", str(config), "--print_config"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0, out
    printed = yaml.safe_load(out)
    callbacks = {c["class_path"].rsplit(".", 1)[-1]: c.get("init_args", {}) for c in printed["trainer"]["callbacks"]}
    assert callbacks["LoraEMA"]["snapshot_every"] == 100
    assert callbacks["FixedEvalLoss"]["monitor"] == "val/loss" and callbacks["FixedEvalLoss"]["patience"] == 5
    assert callbacks["FixedEvalLoss"]["drift_prompts"] and callbacks["LoraExport"]["weights"] == "both"
    assert printed["data"]["val_fraction"] == 0.1


def test_export_of_an_ema_the_checkpoint_cannot_give_is_one_line(reference: Path, tmp_path: Path, capsys) -> None:
    """A checkpoint without an EMA, snapshots that are gone, a width out of range, a LoRA file: one line each, exit
    status 2, nothing written."""
    last = reference.parent / "run" / "checkpoints" / "last.ckpt"
    checkpoint = torch.load(last, weights_only=True)
    moved = dict(checkpoint, callbacks={**checkpoint["callbacks"]})
    moved["callbacks"]["LoraEMA"] = {**checkpoint["callbacks"]["LoraEMA"], "folder": str(tmp_path / "gone" / "ema")}
    (tmp_path / "moved" / "checkpoints").mkdir(parents=True)
    torch.save(moved, tmp_path / "moved" / "checkpoints" / "last.ckpt")
    without = {**checkpoint, "callbacks": {k: v for k, v in checkpoint["callbacks"].items() if k != "LoraEMA"}}
    torch.save(without, tmp_path / "without.ckpt")
    lora = reference.parent / "run" / "lora" / "lora.safetensors"
    cases = [
        ([str(tmp_path / "without.ckpt"), "--ema"], "holds no EMA of the LoRA (its run had no LoraEMA callback)"),
        (
            [str(tmp_path / "moved" / "checkpoints" / "last.ckpt"), "--ema-sigma-rel", "0.1"],
            "the run's EMA snapshot posthoc-step000002.safetensors is missing",
        ),
        ([str(last), "--ema-sigma-rel", "0.5"], "--ema-sigma-rel: 0.5 is not a power-function EMA width"),
        ([str(lora), "--ema"], "is a LoRA file; the EMA of a run is in its checkpoints"),
    ]
    for args, message in cases:
        out = tmp_path / "out.safetensors"
        assert export_main([*args, "--format", "diffusers", "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err
        assert not out.exists()
    # the snapshots moved with the run folder: found beside its checkpoints' folder
    shutil.copytree(reference.parent / "run" / "ema", tmp_path / "moved" / "ema")
    moved_last = tmp_path / "moved" / "checkpoints" / "last.ckpt"
    assert export_main([str(moved_last), "--ema-sigma-rel", "0.1", "--format", "kohya", "--out", str(out)]) == 0


def test_ema_refuses_a_sharded_lora_and_a_second_ema() -> None:
    from types import SimpleNamespace

    from lightning_lora.model.parallel import LoraFSDPStrategy

    ema = LoraEMA()
    sharded = SimpleNamespace(callbacks=[ema], strategy=LoraFSDPStrategy(), default_root_dir="run")
    with pytest.raises(ConfigError, match="LoraEMA: not with trainer.strategy: fsdp"):
        ema.setup(sharded, None, "fit")  # type: ignore[arg-type]
    twice = SimpleNamespace(callbacks=[ema, LoraEMA()], strategy=None, default_root_dir="run")
    with pytest.raises(ConfigError, match="more than one LoraEMA"):
        ema.setup(twice, None, "fit")  # type: ignore[arg-type]
