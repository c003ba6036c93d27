"""Exact resume in tests: a run config that checkpoints every step and draws from the RNG in every step, and the
bit-for-bit comparison of a run that stopped and resumed with one that never stopped."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors.torch import load_file

from helpers.cli import run_cli, write_config

STEPS = 10

DDP_RUN_STEPS = 5
"""The steps of the shared ``ddp_run`` fixture (tests/conftest.py): a global batch of 2 out of 4 images, so a stop at
step 3 is inside the second epoch."""
DDP_RUN_LAYOUT: dict[str, Any] = {
    "trainer.devices": 2,
    "trainer.strategy": "ddp",
    "data.batch_size": 1,  # per process: a global batch of 2
    "data.max_aspect_ratio": 1.0,  # square buckets only: every global batch is full (a partial one cannot be split)
}
"""The ``ddp_run`` fixture's layout: 1 node x 2 processes of DDP."""


def resume_config(
    tmp_path: Path,
    model_dir: Path,
    photos: Path,
    name: str,
    accumulate: int = 1,
    steps: int = STEPS,
    cache: Path | None = None,
    every: int = 1,
    **extra: Any,
) -> Path:
    """:func:`~helpers.cli.write_config` in ``tmp_path / name`` for ``steps`` steps: a checkpoint every ``every`` steps
    (``stepNNNN.ckpt`` and ``last.ckpt``; the pair costs about as much as a tiny step: a run that resumes from one step
    only checkpoints there), LoRA dropout 0.1 (the RNG is drawn in every step: a lost RNG state would show), a cosine
    schedule with warmup, and one cache shared by every run under ``tmp_path`` (or ``cache``: another run's, whose
    entries it reuses).

    ``extra`` are more dotted overrides; ``callbacks=[...]`` adds callbacks after the checkpoint.
    """
    folder = tmp_path / name
    folder.mkdir()
    callbacks = [
        {
            "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
            "init_args": {
                "filename": "step{step:04d}",
                "auto_insert_metric_name": False,
                "every_n_train_steps": every,
                "save_last": True,
                "save_top_k": -1,
            },
        },
        *extra.pop("callbacks", []),
    ]
    overrides = {
        "trainer.max_steps": steps,
        "trainer.callbacks": callbacks,
        "trainer.accumulate_grad_batches": accumulate,
        "model.lora.dropout": 0.1,  # draws from the RNG in every step: a lost RNG state would show
        "model.scheduler": {
            "class_path": "lightning_lora.schedules.CosineWithWarmup",
            "init_args": {"total_steps": steps, "warmup_steps": 2},
        },
        **extra,
    }
    config = write_config(folder, model_dir, photos, **overrides)
    data = yaml.safe_load(config.read_text())
    data["data"]["cache_dir"] = str(cache or tmp_path / "cache")  # one shared cache: encoding is not what is tested
    config.write_text(yaml.safe_dump(data))
    return config


def preservation_layout(root: Path, photos: Path) -> Path:
    """Folders for runs with preservation and masks under ``root`` (returned): ``train/`` (the photos of ``photos``
    with their captions), ``masks/`` (a mask for the first two, white on the left half, and one that matches no image),
    ``regularization/`` (two other photos, captioned without the trigger)."""
    import numpy as np
    from PIL import Image

    from lightning_lora.cli.demo import PHOTOS, _photo

    train, masks, regularization = root / "train", root / "masks", root / "regularization"
    for folder in (train, masks, regularization):
        folder.mkdir(parents=True)
    photos_here = sorted(p for p in photos.iterdir() if p.suffix == ".png")
    for photo in photos_here:
        shutil.copy(photo, train / photo.name)
        shutil.copy(photo.with_suffix(".txt"), train / f"{photo.stem}.txt")
    for photo in photos_here[:2]:
        width, height = Image.open(photo).size
        mask = np.zeros((height, width), np.uint8)
        mask[:, : width // 2] = 255
        Image.fromarray(mask).save(masks / f"{photo.stem}.png")
    Image.fromarray(np.full((8, 8), 255, np.uint8)).save(masks / "no_such_image.png")
    others = [name for name in PHOTOS if not (train / f"{name}.png").exists()][:2]
    for name in others:
        Image.fromarray(_photo(name)).save(regularization / f"{name}.png")
        (regularization / f"{name}.txt").write_text(PHOTOS[name].replace("sks ", ""))
    return root


def preservation_options(layout: Path, every_image: bool = False) -> dict[str, Any]:
    """Config overrides (:func:`write_config`'s) for a run on :func:`preservation_layout`'s folders: the photos with
    their masks, the regularization folder at loss weight 0.5, DOP (``every_image``: each photo again without its
    trigger ``sks``, replaced by ``thing``)."""
    preservation: dict[str, Any] = {"mode": "dop"}
    if every_image:
        preservation.update(every_image=True, class_word="thing")
    return {
        "data.images": [
            {"path": str(layout / "train"), "masks": str(layout / "masks")},
            {"path": str(layout / "regularization"), "role": "regularization", "loss_weight": 0.5},
        ],
        "data.trigger": "sks",
        "model.preservation": preservation,
    }


def final_lora(config: Path) -> dict[str, torch.Tensor]:
    """The LoRA file the run of ``config`` exported at its end."""
    return load_file(config.parent / "run" / "lora" / "lora.safetensors")


def loss_curve(config: Path) -> dict[int, float]:
    """``train/loss`` by step, as the run of ``config`` logged it to TensorBoard."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(config.parent / "run")).Reload()
    return {e.step: e.value for e in events.Scalars("train/loss")}


def assert_same_lora(a: Path, b: Path) -> dict[str, torch.Tensor]:
    """The runs of configs ``a`` and ``b`` exported the same LoRA, bit for bit; return it."""
    lora_a, lora_b = final_lora(a), final_lora(b)
    assert lora_a.keys() == lora_b.keys()
    differing = [k for k in lora_a if not torch.equal(lora_a[k], lora_b[k])]
    assert not differing, f"{len(differing)} LoRA tensors differ after resume, e.g. {differing[:2]}"
    return lora_a


def assert_same_run(a: Path, b: Path, after_step: int) -> None:
    """Same LoRA, bit for bit, and the same ``train/loss`` at every step from ``after_step`` on."""
    assert_same_lora(a, b)
    curve_a, curve_b = loss_curve(a), loss_curve(b)
    later = sorted(s for s in curve_a if s >= after_step)
    assert later, "no loss logged after the resume point"
    assert [curve_b.get(s) for s in later] == [curve_a[s] for s in later]


def check_same_run_after_resume(
    root: Path, model_dir: Path, photos: Path, steps: int, stop: int, **options: Any
) -> dict[str, torch.Tensor]:
    """Runs of :func:`resume_config` with ``options``: ``a`` trains ``steps`` steps, ``b`` stops at ``stop`` and is
    resumed with ``--ckpt_path last``; both end with the same LoRA, bit for bit, and log the same losses after the
    stop (:func:`assert_same_run`). Returns the LoRA."""
    a = resume_config(root, model_dir, photos, "a", steps=steps, **options)
    assert run_cli(["fit", "--config", str(a)]).trainer.global_step == steps
    b = resume_config(root, model_dir, photos, "b", steps=steps, **options)
    run_cli(["fit", "--config", str(b), "--trainer.max_steps", str(stop)])
    cli = run_cli(["fit", "--config", str(b), "--ckpt_path", "last"])
    assert cli.trainer.global_step == steps
    assert_same_run(a, b, after_step=stop)
    return final_lora(b)


def check_exact_resume(root: Path, model_dir: Path, photos: Path, family: str, init_args: dict[str, Any]) -> None:
    """A UNet family (``lightning_lora.families.<family>`` with ``init_args``) with a LoCon LoRA: 6 steps, stopped at
    step 3 (inside an epoch: 2 batches per epoch) and resumed, ends with the same LoRA, bit for bit, and the same
    losses."""
    options: dict[str, Any] = {
        "model.family": {"class_path": f"lightning_lora.families.{family}", "init_args": init_args},
        "model.lora.targets": "locon",
    }
    lora = check_same_run_after_resume(root, model_dir, photos, 6, 3, every=3, **options)
    assert any(v.ndim == 4 for v in lora.values())  # conv LoRA included
