"""The fixed evaluation's drift, its early stopping and its check of a quantized run on the unquantized base, in tiny
FLUX runs.

``eval/drift`` is the mean squared difference between the predictions with and without the LoRA on prompts without
the trigger: exactly 0 before the first step (``lora_B`` starts at zero), then growing while the LoRA trains on
captions that all carry the trigger (``sks``). Watched with ``patience``, a drift that only grows stops the run two
evaluations after step 0, which stays the best: the best LoRA is the untrained one, and a run stopped and resumed in
between stops at the same step with the same LoRA.
"""

from __future__ import annotations

import inspect
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from helpers import assert_same_lora, resume_config, run_cli
from safetensors.torch import load_file

from lightning_lora.callbacks import FixedEvalLoss
from lightning_lora.export import read_metadata
from lightning_lora.module import LoraModule

STEPS = 8
EARLY_STOP: list[dict[str, Any]] = [
    {
        "class_path": "lightning_lora.callbacks.FixedEvalLoss",
        "init_args": {"every_n_steps": 2, "monitor": "eval/drift", "patience": 2},
    },
    {"class_path": "lightning_lora.callbacks.LoraExport", "init_args": {"best": True}},
]


def _evaluator(cli: Any) -> FixedEvalLoss:
    return next(cb for cb in cli.trainer.callbacks if isinstance(cb, FixedEvalLoss))


def _drift(run: Path) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    return [(e.step, e.value) for e in EventAccumulator(str(run)).Reload().Scalars("eval/drift")]


@pytest.fixture(scope="module")
def stopped_early(tmp_path_factory: pytest.TempPathFactory, tiny_flux_dir: Path, photos_dir: Path) -> Path:
    """A run of up to :data:`STEPS` steps that early stopping on ``eval/drift`` ends at step 4."""
    root = tmp_path_factory.mktemp("drift")
    config = resume_config(root, tiny_flux_dir, photos_dir, "a", steps=STEPS, callbacks=EARLY_STOP)
    cli = run_cli(["fit", "--config", str(config)])
    assert cli.trainer.global_step == 4
    evaluator = _evaluator(cli)
    assert (evaluator.best_step, evaluator.wait, evaluator.stopped_early_at) == (0, 2, 4)
    return config


def test_drift_is_zero_before_training_and_grows_with_it(stopped_early: Path) -> None:
    drift = _drift(stopped_early.parent / "run")
    assert [step for step, _ in drift] == [0, 2, 4]
    assert drift[0][1] == 0.0  # lora_B is zero: the adapted prediction is the base's, exactly
    assert 0.0 < drift[1][1] < drift[2][1]


def test_the_best_lora_of_a_run_that_only_drifts_is_the_untrained_one(stopped_early: Path) -> None:
    lora = stopped_early.parent / "run" / "lora"
    best = load_file(lora / "lora.best.safetensors")
    assert read_metadata(lora / "lora.best.safetensors")["lightning_lora.steps"] == "0"
    assert all(not value.any() for key, value in best.items() if ".lora_B." in key)
    assert any(value.any() for key, value in load_file(lora / "lora.safetensors").items() if ".lora_B." in key)


def test_early_stopping_resumes_exactly(
    stopped_early: Path, tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path
) -> None:
    """Stopped at step 3, between the evaluations of steps 2 and 4, and resumed: it stops at step 4 as the run that
    never stopped did, with the same LoRA and the same drift."""
    cache = stopped_early.parent.parent / "cache"
    config = resume_config(tmp_path, tiny_flux_dir, photos_dir, "b", steps=STEPS, cache=cache, callbacks=EARLY_STOP)
    run_cli(["fit", "--config", str(config), "--trainer.max_steps", "3"])
    cli = run_cli(["fit", "--config", str(config), "--ckpt_path", "last"])
    assert cli.trainer.global_step == 4 and _evaluator(cli).stopped_early_at == 4
    assert_same_lora(stopped_early, config)
    later = [d for d in _drift(config.parent / "run") if d[0] == 4]
    assert later == [d for d in _drift(stopped_early.parent / "run") if d[0] == 4]


def test_resumed_at_the_step_it_stopped_at_it_stops_again(
    stopped_early: Path, tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path
) -> None:
    """The checkpoint of step 4 holds the judgement that stopped the run: resuming from it trains nothing."""
    shutil.copytree(stopped_early.parent / "run", tmp_path / "run")  # a copy: the other tests read the run
    config = yaml.safe_load(stopped_early.read_text())
    config["trainer"]["default_root_dir"] = str(tmp_path / "run")
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    cli = run_cli(["fit", "--config", str(tmp_path / "config.yaml"), "--ckpt_path", "last"])
    assert cli.trainer.global_step == 4 and _evaluator(cli).stopped_early_at == 4


def test_a_quantized_run_is_checked_on_the_unquantized_base(
    stopped_early: Path, tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Trained on an FP8 base, the LoRA's fixed evaluation loss is measured on the unquantized base too (loaded from
    the same files) and both are printed; its files say it trained on FP8. With half the images held out, the best
    LoRA is judged by ``val/loss`` (``monitor: auto``)."""
    cache = stopped_early.parent.parent / "cache"  # the text encoders run in fp32 either way: the same entries
    options: dict[str, Any] = {
        "trainer.precision": None,
        "trainer.plugins": {"class_path": "lightning_lora.precision.FP8", "init_args": {"dtype": "fp32"}},
        "callbacks": [{"class_path": "lightning_lora.callbacks.FixedEvalLoss", "init_args": {"drift_prompts": []}}],
        "data.val_fraction": 0.5,
    }
    config = resume_config(tmp_path, tiny_flux_dir, photos_dir, "q", steps=2, cache=cache, **options)
    with caplog.at_level(logging.INFO):
        cli = run_cli(["fit", "--config", str(config)])
    evaluator = _evaluator(cli)
    metrics = evaluator.metrics
    assert "eval/drift" not in metrics  # drift_prompts: [] measures none
    assert evaluator.watched == "val/loss" and evaluator.best == min(v for _, v in evaluator.val_history)
    quantized, unquantized = metrics["eval/loss"], metrics["eval/loss_unquantized"]
    assert quantized != unquantized and abs(quantized - unquantized) < 0.1 * quantized
    line = next(r.getMessage() for r in caplog.records if "base it trained on" in r.getMessage())
    assert line == (
        f"Fixed evaluation loss on the FP8 base it trained on: {quantized:.4f}; on the unquantized fp32 base: "
        f"{unquantized:.4f} ({100 * (unquantized - quantized) / quantized:+.1f}%)"
    )
    lora = config.parent / "run" / "lora" / "lora.safetensors"
    assert read_metadata(lora)["lightning_lora.training_precision"] == "fp8"


def _has_preservation() -> bool:
    return "preservation" in inspect.signature(LoraModule.__init__).parameters


DOP: dict[str, Any] = {"model.preservation": {"mode": "dop", "every_image": True}, "data.trigger": "sks"}
"""Differential output preservation (issue 49, item 1): every photo again without its trigger, towards the base's
own prediction."""


@pytest.mark.skipif(
    not _has_preservation(),
    reason="differential output preservation (model.preservation, issue 49 item 1) is not in this tree yet",
)
def test_preservation_keeps_the_drift_lower(tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path) -> None:
    """The same tiny run with and without differential output preservation: with it, the LoRA moves the predictions
    for prompts without the trigger measurably less."""
    final = {}
    for name, options in (("plain", {}), ("dop", DOP)):
        callbacks = [{"class_path": "lightning_lora.callbacks.FixedEvalLoss", "init_args": {"every_n_steps": 0}}]
        config = resume_config(tmp_path, tiny_flux_dir, photos_dir, name, steps=STEPS, callbacks=callbacks, **options)
        final[name] = _evaluator(run_cli(["fit", "--config", str(config)])).metrics["eval/drift"]
    assert 0 < final["dop"] < 0.8 * final["plain"], final
    assert torch.isfinite(torch.tensor(list(final.values()))).all()


def test_the_unquantized_base_is_loaded_only_where_the_planner_says_it_fits(
    tiny_flux_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU, the unquantized base (its weights and a forward without gradients, as the memory planner counts them)
    is loaded beside the training model only into free memory; otherwise one line says how much was needed."""
    from lightning_lora.callbacks.evaluation import bf16_room
    from lightning_lora.families.base import ModelSource
    from lightning_lora.families.flux import Flux
    from lightning_lora.lora import LoraOptions
    from lightning_lora.model.recipe import ModelRecipe
    from lightning_lora.plan import weight_bytes

    recipe = ModelRecipe(Flux(), ModelSource(str(tiny_flux_dir)), LoraOptions(rank=4))
    weights = weight_bytes(recipe.family.denoiser_skeleton(recipe.source), recipe.precision)
    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (int(weights / 2), 80 * 2**30))
    room = bf16_room(recipe, gpu)
    assert room is not None and room.endswith("GiB are free on cuda:0") and "beside the training model" in room
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (80 * 2**30, 80 * 2**30))
    assert bf16_room(recipe, gpu) is None
    assert bf16_room(recipe, torch.device("cpu")) is None  # a CPU run (a tiny one) is not planned
