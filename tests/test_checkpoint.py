"""Checkpoint settings versus state, the newest checkpoint of a run folder, and paths that follow a moved folder.

Pure tests on real torch optimizers and schedulers (no Lightning run): a checkpoint dict is what Lightning would save
(``optimizer_states``, ``lr_schedulers``) plus our record of the configured settings; the run's CLI flows are in
tests/callbacks/test_resume.py.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch

from lightning_lora.callbacks.resume import rebase_paths
from lightning_lora.checkpoint import STAMP, configured_record, reconcile_training_state, resolve_resume
from lightning_lora.errors import ConfigError
from lightning_lora.schedules import CosineWithWarmup, warmup_cosine_factor


def build(lr: float = 1e-2, total: int | None = 10, warmup: int = 2, weight_decay: float = 0.0, scheduler=True):
    params = [torch.nn.Parameter(torch.ones(3))]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    schedulers = [CosineWithWarmup(optimizer, total_steps=total, warmup_steps=warmup)] if scheduler else []
    return params, optimizer, schedulers


def train(params, optimizer, schedulers, steps: int) -> None:
    for _ in range(steps):
        params[0].grad = torch.ones(3)
        optimizer.step()
        for s in schedulers:
            s.step()


def saved_run(steps: int, **settings) -> dict:
    """The checkpoint of a run with ``settings`` after ``steps`` optimizer steps."""
    params, optimizer, schedulers = build(**settings)
    record = configured_record([optimizer], schedulers)
    train(params, optimizer, schedulers, steps)
    return {
        "optimizer_states": [optimizer.state_dict()],
        "lr_schedulers": [s.state_dict() for s in schedulers],
        STAMP: {"configured": record},
    }


def resume(checkpoint: dict, **settings):
    """Build from ``settings`` (the new config), reconcile, restore as Lightning does; return objects and notes."""
    params, optimizer, schedulers = build(**settings)
    notes = reconcile_training_state(checkpoint, [optimizer], schedulers, configured_record([optimizer], schedulers))
    optimizer.load_state_dict(checkpoint["optimizer_states"][0])
    for s, state in zip(schedulers, checkpoint["lr_schedulers"], strict=True):
        s.load_state_dict(state)
    return params, optimizer, schedulers, notes


def test_a_longer_run_continues_on_the_longer_schedule() -> None:
    checkpoint = saved_run(10, total=10)
    assert checkpoint["optimizer_states"][0]["param_groups"][0]["lr"] == 0.0  # the 10-step schedule ended
    params, optimizer, schedulers, notes = resume(checkpoint, total=20)
    lrs = []
    for _ in range(10):
        lrs.append(optimizer.param_groups[0]["lr"])
        train(params, optimizer, schedulers, 1)
    expected = [1e-2 * warmup_cosine_factor(step, 2, 20) for step in range(10, 20)]
    assert lrs == pytest.approx(expected, rel=1e-12)
    assert lrs[0] > 0.004
    assert len(notes) == 1 and "total_steps 10 -> 20" in notes[0] and "step 10" in notes[0]
    # The optimizer's state (moments, step count) is the checkpoint's.
    assert int(optimizer.state_dict()["state"][0]["step"]) == 20


def test_an_unchanged_config_leaves_the_checkpoint_as_it_is() -> None:
    checkpoint = saved_run(4)
    before = copy.deepcopy(checkpoint)
    _, optimizer, schedulers, notes = resume(checkpoint)
    assert notes == []
    assert checkpoint["lr_schedulers"] == before["lr_schedulers"]
    assert checkpoint["optimizer_states"][0]["param_groups"] == before["optimizer_states"][0]["param_groups"]
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 * warmup_cosine_factor(4, 2, 10))


def test_a_changed_learning_rate_and_weight_decay_are_applied() -> None:
    checkpoint = saved_run(4)
    _, optimizer, schedulers, notes = resume(checkpoint, lr=5e-3, weight_decay=0.1)
    group = optimizer.param_groups[0]
    assert group["lr"] == pytest.approx(5e-3 * warmup_cosine_factor(4, 2, 10))
    assert group["initial_lr"] == 5e-3 and schedulers[0].base_lrs == [5e-3]
    assert group["weight_decay"] == 0.1
    assert any("base_lrs 0.01 -> 0.005" in n for n in notes)
    assert any("weight_decay 0 -> 0.1" in n for n in notes)


def test_a_changed_learning_rate_without_a_schedule() -> None:
    checkpoint = saved_run(3, scheduler=False)
    _, optimizer, _, notes = resume(checkpoint, lr=1e-3, scheduler=False)
    assert optimizer.param_groups[0]["lr"] == 1e-3
    assert notes == ["model.optimizer: lr 0.01 -> 0.001 (from the config; state kept)."]


def test_values_an_optimizer_adapts_in_its_groups_are_state() -> None:
    """Prodigy keeps its adapted step size ``d`` in the parameter group: the config never sets it, so it is kept."""
    params, optimizer, schedulers = build()
    optimizer.param_groups[0]["d"] = 1e-6  # as configured
    record = configured_record([optimizer], schedulers)
    train(params, optimizer, schedulers, 3)
    optimizer.param_groups[0]["d"] = 0.37  # as adapted by training
    checkpoint = {
        "optimizer_states": [optimizer.state_dict()],
        "lr_schedulers": [s.state_dict() for s in schedulers],
        STAMP: {"configured": record},
    }
    _, fresh, fresh_schedulers = build()
    fresh.param_groups[0]["d"] = 1e-6
    notes = reconcile_training_state(
        checkpoint, [fresh], fresh_schedulers, configured_record([fresh], fresh_schedulers)
    )
    assert notes == [] and checkpoint["optimizer_states"][0]["param_groups"][0]["d"] == 0.37


def test_another_optimizer_class_is_refused() -> None:
    checkpoint = saved_run(2)
    params = [torch.nn.Parameter(torch.ones(3))]
    sgd = torch.optim.SGD(params, lr=1e-2)
    schedulers = [CosineWithWarmup(sgd, total_steps=10, warmup_steps=2)]
    with pytest.raises(ConfigError, match=r"model\.optimizer: .*torch\.optim\.adamw\.AdamW.*torch\.optim\.sgd\.SGD"):
        reconcile_training_state(checkpoint, [sgd], schedulers, configured_record([sgd], schedulers))


def test_a_checkpoint_without_a_record_is_compared_by_its_schedule() -> None:
    checkpoint = saved_run(10, total=10)
    del checkpoint[STAMP]
    _, optimizer, _, notes = resume(checkpoint, total=16)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 * warmup_cosine_factor(10, 2, 16))
    assert "total_steps 10 -> 16" in notes[0]


def test_a_schedule_without_a_closed_form_is_kept_and_said() -> None:
    params = [torch.nn.Parameter(torch.ones(3))]
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    plateau = torch.optim.lr_scheduler.CyclicLR(optimizer, base_lr=1e-3, max_lr=1e-2, step_size_up=4)
    record = configured_record([optimizer], [plateau])
    checkpoint = {"optimizer_states": [optimizer.state_dict()], "lr_schedulers": [plateau.state_dict()]}
    checkpoint[STAMP] = {"configured": record}
    fresh_opt = torch.optim.AdamW([torch.nn.Parameter(torch.ones(3))], lr=1e-2)
    fresh = torch.optim.lr_scheduler.CyclicLR(fresh_opt, base_lr=1e-3, max_lr=1e-2, step_size_up=8)
    before = copy.deepcopy(checkpoint["lr_schedulers"])
    notes = reconcile_training_state(checkpoint, [fresh_opt], [fresh], configured_record([fresh_opt], [fresh]))
    assert checkpoint["lr_schedulers"] == before
    assert len(notes) == 1 and "not a function of the step" in notes[0]


# -- the newest checkpoint of a folder ----------------------------------------------------------------------------
def write_checkpoint(path: Path, step: int, saved_at: int | None) -> None:
    ckpt = {"global_step": step, "state_dict": {}, "loops": {}, "optimizer_states": []}
    if saved_at is not None:
        ckpt[STAMP] = {"saved_at_ns": saved_at}
    torch.save(ckpt, path)


def test_last_means_the_newest_save_whatever_its_name_or_file_time(tmp_path: Path) -> None:
    # A moved run folder where Lightning wrote last-v1.ckpt beside an older last.ckpt, and the copy reset every
    # modification time (last.ckpt looks newest).
    write_checkpoint(tmp_path / "step000004.ckpt", 4, saved_at=1_000)
    write_checkpoint(tmp_path / "last-v1.ckpt", 6, saved_at=3_000)
    write_checkpoint(tmp_path / "last.ckpt", 4, saved_at=2_000)
    for i, name in enumerate(["last-v1.ckpt", "step000004.ckpt", "last.ckpt"]):
        os.utime(tmp_path / name, ns=(10**18 + i, 10**18 + i))
    path, ckpt = resolve_resume(tmp_path)
    assert path == tmp_path / "last-v1.ckpt" and ckpt is not None and ckpt["global_step"] == 6


def test_checkpoints_without_a_stamp_are_dated_by_file_time(tmp_path: Path) -> None:
    write_checkpoint(tmp_path / "last.ckpt", 2, saved_at=None)
    write_checkpoint(tmp_path / "step000003.ckpt", 3, saved_at=None)
    os.utime(tmp_path / "last.ckpt", ns=(10**18, 10**18))
    os.utime(tmp_path / "step000003.ckpt", ns=(10**18 + 5, 10**18 + 5))
    path, _ = resolve_resume(tmp_path)
    assert path == tmp_path / "step000003.ckpt"


def test_model_checkpoint_paths_follow_the_folder() -> None:
    old, new = "/disk1/runs/a/checkpoints", "/disk2/runs/b/checkpoints"
    state = {
        "dirpath": old,
        "last_model_path": f"{old}/last.ckpt",
        "best_model_path": f"{old}/step000004.ckpt",
        "kth_best_model_path": f"{old}/step000002.ckpt",
        "best_k_models": {f"{old}/step000004.ckpt": torch.tensor(4.0), f"{old}/step000002.ckpt": torch.tensor(2.0)},
        "best_model_score": torch.tensor(4.0),
    }
    moved = rebase_paths(state, new)
    assert moved["dirpath"] == new and moved["last_model_path"] == f"{new}/last.ckpt"
    assert moved["best_model_path"] == f"{new}/step000004.ckpt"
    assert set(moved["best_k_models"]) == {f"{new}/step000004.ckpt", f"{new}/step000002.ckpt"}
    assert state["dirpath"] == old  # the input is not modified
    outside = rebase_paths({**state, "last_model_path": "/elsewhere/last.ckpt"}, new)
    assert outside["last_model_path"] == "/elsewhere/last.ckpt"


# -- the base model: what it is, not how its path is spelled ----------------------------------------------------------
def test_a_models_identity_is_its_files_not_its_path(
    tmp_path: Path, tiny_flux_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil

    from helpers import other_weights

    from lightning_lora.families.base import ModelSource, content_digest

    identity = ModelSource(str(tiny_flux_dir)).model_identity()
    assert identity["pretrained"] is not None and identity["pretrained"].startswith("files:")
    moved = tmp_path / "other_disk" / "flux"
    shutil.copytree(tiny_flux_dir, moved)
    monkeypatch.chdir(tmp_path)
    for spelling in (str(moved), "other_disk/flux", "./other_disk//flux/"):
        assert ModelSource(spelling).model_identity() == identity, spelling
    assert ModelSource(str(moved)).identity("vae") == ModelSource(str(tiny_flux_dir)).identity("vae")  # cache keys
    (moved / "scheduler" / "scheduler_config.json").write_text("{}")  # no weights: not what the LoRA was trained on
    assert ModelSource(str(moved)).model_identity() == identity
    other_weights(moved)
    assert ModelSource(str(moved)).model_identity()["pretrained"] != identity["pretrained"]
    assert ModelSource("black-forest-labs/FLUX.1-dev").model_identity() == {
        "pretrained": "black-forest-labs/FLUX.1-dev",
        "denoiser_file": None,
        "training_adapter": None,
    }
    # A weight file of gigabytes is read in slices: a copy matches, other values of the same shapes do not.
    big = tmp_path / "big.safetensors"
    big.write_bytes(torch.arange(3 << 20, dtype=torch.float32).numpy().tobytes())  # 12 MiB
    shutil.copy(big, tmp_path / "copy.safetensors")
    assert content_digest(tmp_path / "copy.safetensors") == content_digest(big)
    big.write_bytes((torch.arange(3 << 20, dtype=torch.float32) + 1).numpy().tobytes())
    assert content_digest(tmp_path / "copy.safetensors") != content_digest(big)


def test_a_checkpoint_without_the_models_identity_compares_the_path_as_written(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from lightning_lora.checkpoint import check_compatible

    saved = {"pretrained": "/models/flux", "lora": {"rank": 4}}
    with caplog.at_level("INFO"):
        check_compatible(saved, dict(saved), "old.ckpt")
    assert "old.ckpt records no identity of its base model" in caplog.text
    with pytest.raises(ConfigError) as error:
        check_compatible(saved, {**saved, "pretrained": "/mnt/models/flux"}, "old.ckpt")
    message = str(error.value)
    assert "model.pretrained was '/models/flux', now '/mnt/models/flux'" in message
    assert "resume once with the path it was trained with" in message and len(message.splitlines()) == 1
    # With identities: the path as written does not matter, the files do.
    same, other = {"pretrained": "files:1", "denoiser_file": None}, {"pretrained": "files:2", "denoiser_file": None}
    check_compatible(saved, {**saved, "pretrained": "/mnt/models/flux"}, "new.ckpt", same, dict(same))
    with pytest.raises(ConfigError, match=r"model.pretrained '/models/flux' is not the model the run was trained on"):
        check_compatible(saved, dict(saved), "new.ckpt", same, other)
