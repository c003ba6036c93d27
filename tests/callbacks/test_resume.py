"""Exact resume: a run that is stopped or killed and resumed ends with the same LoRA, bit for bit, as one that never
stopped, and logs the same loss curve after the resume.

Run A trains N steps uninterrupted. Run B stops (``max_steps``), or is killed with SIGKILL from inside at a random
batch (also between the micro-batches of gradient accumulation), or gets Ctrl-C, and is resumed with
``--ckpt_path last``. Four photos in batches of two make two batches per epoch, so every run crosses epoch
boundaries. Checkpoints are written every optimizer step where a run may be killed at any batch, and only where it
resumes elsewhere (a checkpoint costs about as much as a tiny step).
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from helpers import (
    assert_same_run,
    check_same_run_after_resume,
    fit_in_subprocess,
    preservation_options,
    resume_config,
    run_cli,
)
from helpers.resume import STEPS


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory, tiny_flux_dir: Path, photos_dir: Path) -> dict[int, Path]:
    """Run A, with and without gradient accumulation: the references (nothing resumes from them: one checkpoint, at the
    end)."""
    root = tmp_path_factory.mktemp("reference")
    runs = {}
    for accumulate in (1, 2):
        config = resume_config(root, tiny_flux_dir, photos_dir, f"a{accumulate}", accumulate=accumulate, every=STEPS)
        cli = run_cli(["fit", "--config", str(config)])
        assert cli.trainer.global_step == STEPS
        runs[accumulate] = config
    return runs


def test_stop_and_resume_twice_is_exact(tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path, uninterrupted) -> None:
    config = resume_config(tmp_path, tiny_flux_dir, photos_dir, "b", every=3)  # checkpoints where it stops
    run_cli(["fit", "--config", str(config), "--trainer.max_steps", "3"])  # ends inside epoch 1 (2 batches/epoch)
    run_cli(["fit", "--config", str(config), "--ckpt_path", "last", "--trainer.max_steps", "6"])
    cli = run_cli(["fit", "--config", str(config), "--ckpt_path", "last"])
    assert cli.trainer.global_step == STEPS
    assert_same_run(uninterrupted[1], config, after_step=3)


def test_fused_adamw_with_gradient_clipping_resumes_exactly(
    tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path
) -> None:
    """torch's AdamW with ``fused: true`` (one kernel for every LoRA tensor; its step counts are tensors on the
    parameters' device) under ``trainer.gradient_clip_val``, with gradient accumulation: stopped between optimizer steps
    and resumed, the same LoRA bit for bit and the same losses. Lightning refused to clip for a fused optimizer before
    the precision plugins said that without a gradient scaler there is nothing to unscale."""
    fused = {
        "model.optimizer": {"class_path": "torch.optim.AdamW", "init_args": {"lr": 0.01, "fused": True}},
        "trainer.gradient_clip_val": 0.01,  # below the tiny model's gradient norms: every step is clipped
    }
    reference = resume_config(tmp_path, tiny_flux_dir, photos_dir, "a", accumulate=2, steps=6, every=6, **fused)
    assert run_cli(["fit", "--config", str(reference)]).trainer.global_step == 6
    config = resume_config(tmp_path, tiny_flux_dir, photos_dir, "b", accumulate=2, steps=6, every=3, **fused)
    run_cli(["fit", "--config", str(config), "--trainer.max_steps", "3"])
    cli = run_cli(["fit", "--config", str(config), "--ckpt_path", "last"])
    assert cli.trainer.global_step == 6
    assert cli.model.optimizers().optimizer.defaults["fused"] is True
    assert_same_run(reference, config, after_step=3)


def test_the_control_would_fail_without_rng_restore(
    tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path, uninterrupted, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The exactness above is not an accident: without the RNG restore the resumed run diverges."""
    from lightning_lora.callbacks import resume

    config = resume_config(tmp_path, tiny_flux_dir, photos_dir, "b", every=3)
    run_cli(["fit", "--config", str(config), "--trainer.max_steps", "3"])
    monkeypatch.setattr(resume, "restore_rng", lambda state: None)
    run_cli(["fit", "--config", str(config), "--ckpt_path", "last"])
    with pytest.raises(AssertionError, match="LoRA tensors differ"):
        assert_same_run(uninterrupted[1], config, after_step=3)


def _killed_then_resumed(
    tmp_path: Path, model_dir: Path, photos: Path, name: str, accumulate: int, batch: int, **options: Any
) -> Path:
    kill = {"class_path": "helpers.crash.KillAt", "init_args": {"batch": batch}}
    config = resume_config(tmp_path, model_dir, photos, name, accumulate=accumulate, callbacks=[kill], **options)
    killed = fit_in_subprocess(config)
    assert killed.returncode == -9, f"expected SIGKILL, got {killed.returncode}: {killed.stderr[-2000:]}"
    assert not (config.parent / "run" / "lora" / "lora.safetensors").exists()
    # Resume with the same config minus the kill switch, as a user would after a crash.
    data = yaml.safe_load(config.read_text())
    data["trainer"]["callbacks"] = [c for c in data["trainer"]["callbacks"] if "KillAt" not in c["class_path"]]
    config.write_text(yaml.safe_dump(data))
    cli = run_cli(["fit", "--config", str(config), "--ckpt_path", "last"])
    assert cli.trainer.global_step == options.get("steps", STEPS)
    return config


@pytest.mark.subprocess
@pytest.mark.parametrize("accumulate", [1, 2])
def test_sigkill_at_a_random_batch_then_resume_is_exact(
    tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path, uninterrupted, accumulate: int
) -> None:
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    total_batches = STEPS * accumulate
    if accumulate == 1:
        batch = rng.randrange(2, total_batches)
    else:  # land between the two micro-batches of an optimizer step
        batch = 2 * rng.randrange(1, STEPS) + 1
    config = _killed_then_resumed(tmp_path, tiny_flux_dir, photos_dir, "b", accumulate, batch)
    try:
        assert_same_run(uninterrupted[accumulate], config, after_step=batch // accumulate)
    except AssertionError as e:
        raise AssertionError(f"kill at batch {batch} (seed {seed}): {e}") from e


def test_corrupt_last_checkpoint_falls_back_to_the_previous_one(
    tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path, uninterrupted, caplog: pytest.LogCaptureFixture
) -> None:
    config = resume_config(tmp_path, tiny_flux_dir, photos_dir, "b")
    run_cli(["fit", "--config", str(config), "--trainer.max_steps", "5"])
    checkpoints = config.parent / "run" / "checkpoints"
    last = checkpoints / "last.ckpt"
    last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])  # a write cut short
    newest = checkpoints / "step0005.ckpt"
    newest.write_bytes(b"")  # and a zero-byte file, as after a power cut on some file systems
    with pytest.warns(UserWarning, match=r"last\.ckpt, step0005\.ckpt .* truncated or corrupt; resuming from step0004"):
        cli = run_cli(["fit", "--config", str(config), "--ckpt_path", "last"])
    assert cli.trainer.global_step == STEPS
    assert_same_run(uninterrupted[1], config, after_step=4)


def test_no_valid_checkpoint_is_a_clear_error(tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path, capsys) -> None:
    from lightning_lora.cli import main

    config = resume_config(tmp_path, tiny_flux_dir, photos_dir, "b")
    checkpoints = config.parent / "run" / "checkpoints"
    checkpoints.mkdir(parents=True)
    (checkpoints / "last.ckpt").write_bytes(b"not a checkpoint")
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(config), "--ckpt_path", "last"])
    assert exit_info.value.code == 2
    assert "none of the checkpoints" in capsys.readouterr().err
    assert (checkpoints / "last.ckpt").read_bytes() == b"not a checkpoint"  # left for the user to inspect


def test_last_without_checkpoints_starts_fresh(tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path, caplog) -> None:
    config = resume_config(tmp_path, tiny_flux_dir, photos_dir, "b", **{"trainer.max_steps": 2})
    with caplog.at_level("INFO"):
        cli = run_cli(["fit", "--config", str(config), "--ckpt_path", "last"])
    assert cli.trainer.global_step == 2
    assert "no checkpoint in" in caplog.text and "starting a new run" in caplog.text


def test_safe_changes_are_allowed_and_unsafe_ones_named(
    tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path, capsys
) -> None:
    from lightning_lora.cli import main

    config = resume_config(tmp_path, tiny_flux_dir, photos_dir, "b", **{"trainer.max_steps": 2})
    run_cli(["fit", "--config", str(config)])
    for option, value in (("--model.lora.alpha", "2"), ("--model.lora.targets", "all_linear")):
        with pytest.raises(SystemExit) as exit_info:
            main(["fit", "--config", str(config), "--ckpt_path", "last", option, value])
        assert exit_info.value.code == 2
        assert option[2:] in capsys.readouterr().err
    # Learning rate, length and logging may change.
    cli = run_cli(
        [
            "fit",
            "--config",
            str(config),
            "--ckpt_path",
            "last",
            "--trainer.max_steps",
            "3",
            "--trainer.log_every_n_steps",
            "2",
        ]
    )
    assert cli.trainer.global_step == 3


@pytest.mark.parametrize("signal_name", ["SIGINT", "SIGTERM"])
def test_ctrl_c_saves_at_a_step_boundary_and_resume_is_exact(
    tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path, uninterrupted, signal_name: str
) -> None:
    interrupt = {"class_path": "helpers.crash.InterruptAt", "init_args": {"batch": 5, "signal_name": signal_name}}
    config = resume_config(tmp_path, tiny_flux_dir, photos_dir, "b", accumulate=2, callbacks=[interrupt])
    cli = run_cli(["fit", "--config", str(config)])
    # Batch 5 is the second micro-batch of step 3: the step completes, last.ckpt is written, the run stops.
    assert cli.trainer.global_step == 3
    assert torch.load(config.parent / "run" / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 3
    data = yaml.safe_load(config.read_text())
    data["trainer"]["callbacks"] = [c for c in data["trainer"]["callbacks"] if "InterruptAt" not in c["class_path"]]
    config.write_text(yaml.safe_dump(data))
    run_cli(["fit", "--config", str(config), "--ckpt_path", "last"])
    assert_same_run(uninterrupted[2], config, after_step=3)


def test_checkpoint_holds_only_the_adapter(uninterrupted) -> None:
    path = uninterrupted[1].parent / "run" / "checkpoints" / "last.ckpt"
    ckpt = torch.load(path, weights_only=True)
    lora_bytes = sum(v.numel() * v.element_size() for v in ckpt["state_dict"].values())
    assert all(".lora_A." in k or ".lora_B." in k for k in ckpt["state_dict"])
    assert {"rng_states", "loops", "optimizer_states", "lr_schedulers"} <= ckpt.keys()
    assert ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"], "the sampler position is not saved"
    # LoRA + two AdamW moments + small state: a few times the adapter, far below the 0.5 MB frozen base.
    assert path.stat().st_size < 4 * lora_bytes + 64_000


@pytest.mark.parametrize("before", ["default", "ignored"])
def test_second_ctrl_c_exits_at_once(tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path, before: str) -> None:
    """Also when SIGINT was ignored before the run: Lightning leaves it so after a run it stopped on a
    KeyboardInterrupt, and a second run in the same process (a notebook) must still exit on the second Ctrl-C."""
    import signal

    from lightning_lora.cli import main

    interrupt = {"class_path": "helpers.crash.InterruptAt", "init_args": {"batch": 3, "times": 2}}
    config = resume_config(tmp_path, tiny_flux_dir, photos_dir, "b", callbacks=[interrupt])
    previous = signal.signal(signal.SIGINT, signal.default_int_handler if before == "default" else signal.SIG_IGN)
    try:
        with pytest.raises(SystemExit) as exit_info:  # Lightning exits with 1 on a KeyboardInterrupt; we say 130
            main(["fit", "--config", str(config)])
    finally:
        signal.signal(signal.SIGINT, previous)  # Lightning ignores SIGINT while it shuts down
    assert exit_info.value.code == 130
    last = torch.load(config.parent / "run" / "checkpoints" / "last.ckpt", weights_only=True)
    assert last["global_step"] == 3  # the step checkpoints before the interrupt are intact; no step was added


def test_keep_last_k_checkpoints(tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path) -> None:
    keep = {
        "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
        "init_args": {
            "filename": "step{step:04d}",
            "auto_insert_metric_name": False,
            "every_n_train_steps": 1,
            "save_last": True,
            "save_top_k": 2,
            "monitor": "step",
            "mode": "max",
        },
    }
    config = resume_config(tmp_path, tiny_flux_dir, photos_dir, "b", **{"trainer.max_steps": 5})
    data = yaml.safe_load(config.read_text())
    data["trainer"]["callbacks"] = [keep]
    config.write_text(yaml.safe_dump(data))
    run_cli(["fit", "--config", str(config)])
    names = sorted(p.name for p in (config.parent / "run" / "checkpoints").iterdir())
    assert names == ["last.ckpt", "step0004.ckpt", "step0005.ckpt"]


def test_failed_checkpoint_write_keeps_the_previous_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full disk (ENOSPC) in the middle of a save leaves the previous checkpoint as it was."""
    import errno

    from lightning_lora import io
    from lightning_lora.checkpoint import AtomicCheckpointIO, load_checkpoint

    plugin, path = AtomicCheckpointIO(), tmp_path / "last.ckpt"
    plugin.save_checkpoint({"global_step": 1, "state_dict": {"w": torch.ones(3)}}, path)
    before = path.read_bytes()

    def disk_full(target: Path, data: bytes) -> None:
        with open(target, "wb") as f:
            f.write(data[: len(data) // 3])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(io.Path, "write_bytes", disk_full)
    with pytest.raises(OSError, match="No space left"):
        plugin.save_checkpoint({"global_step": 2, "state_dict": {"w": torch.zeros(3)}}, path)
    monkeypatch.undo()
    assert path.read_bytes() == before and load_checkpoint(path)["global_step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


# -- resume flows that used to lose training with exit status 0 -------------------------------------------------------
def _lr_curve(run: Path) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    return {e.step: e.value for e in EventAccumulator(str(run)).Reload().Scalars("train/lr")}


def test_extending_a_finished_run_stretches_its_schedule(
    tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path, capsys
) -> None:
    """A run of 4 steps extended to 8: the learning rate continues on the 8-step schedule (it was 0 at step 4)."""
    from lightning_lora.schedules import warmup_cosine_factor

    schedule = {"class_path": "lightning_lora.schedules.CosineWithWarmup", "init_args": {"warmup_steps": 1}}
    config = resume_config(tmp_path, tiny_flux_dir, photos_dir, "b", **{"model.scheduler": schedule})
    first = run_cli(["fit", "--config", str(config), "--trainer.max_steps", "4"])
    lora_at_4 = {k: v.clone() for k, v in first.model.trainable_state_dict().items()}
    capsys.readouterr()
    second = run_cli(["fit", "--config", str(config), "--ckpt_path", "last", "--trainer.max_steps", "8"])
    assert second.trainer.global_step == 8
    lr = _lr_curve(config.parent / "run")
    # Logged under the global step the rate is used for (0-based); the first run logged steps 0-3 of its 4-step curve.
    expected = {s: 0.01 * warmup_cosine_factor(s, 1, 8) for s in range(4, 8)}
    assert [lr[s] for s in expected] == pytest.approx(list(expected.values()), rel=1e-6)
    assert lr[4] > 0.006
    lora = second.model.trainable_state_dict()
    assert any(not torch.equal(lora[k], lora_at_4[k]) for k in lora), "the extended run did not train"
    out = capsys.readouterr().out
    assert "Resumed from" in out and "total_steps 4 -> 8" in out, out
    assert "cosine decay to 0 at step 8" in out


def test_explicit_checkpoint_file_never_replaces_the_users_options(
    tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path, capsys
) -> None:
    from lightning_lora.cli import main

    other = resume_config(tmp_path, tiny_flux_dir, photos_dir, "r8", **{"model.lora.rank": 8, "trainer.max_steps": 2})
    run_cli(["fit", "--config", str(other)])
    ckpt = other.parent / "run" / "checkpoints" / "last.ckpt"
    config = resume_config(tmp_path, tiny_flux_dir, photos_dir, "r4", **{"model.lora.rank": 4})
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(config), "--ckpt_path", str(ckpt)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "model.lora.rank was 8, now 4" in err, err
    saved = config.parent / "run" / "config.yaml"
    assert not saved.exists() or yaml.safe_load(saved.read_text())["model"]["lora"]["rank"] == 4
    # The same settings may start a new run folder from another run's checkpoint.
    same = resume_config(tmp_path, tiny_flux_dir, photos_dir, "fork", **{"model.lora.rank": 8, "trainer.max_steps": 3})
    cli = run_cli(["fit", "--config", str(same), "--ckpt_path", str(ckpt)])
    assert cli.trainer.global_step == 3 and cli.model.lora.rank == 8


def test_a_crafted_checkpoint_imports_and_configures_nothing(
    tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lightning_lora.cli import main

    marker = tmp_path / "imported"
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "evil_family.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\nclass Evil:\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(package))
    crafted = tmp_path / "crafted.ckpt"
    torch.save(
        {
            "global_step": 1,
            "state_dict": {},
            "loops": {},
            "optimizer_states": [],
            "hyper_parameters": {"family": {"class_path": "evil_family.Evil"}, "pretrained": "/somewhere/else"},
        },
        crafted,
    )
    config = resume_config(tmp_path, tiny_flux_dir, photos_dir, "b")
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(config), "--ckpt_path", str(crafted)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "model.family was 'evil_family.Evil'" in err and "model.pretrained" in err, err
    assert not marker.exists(), "the checkpoint made the CLI import a module"


@pytest.mark.parametrize("kind", ["truncated", "pickled", "lora file"])
def test_an_unreadable_checkpoint_file_is_one_clear_line(
    tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path, capsys, kind: str
) -> None:
    import pickle

    from safetensors.torch import save_file

    from lightning_lora.cli import main

    bad = tmp_path / "bad.ckpt"
    if kind == "truncated":
        torch.save({"global_step": 1, "state_dict": {"w": torch.ones(1000)}, "loops": {}, "optimizer_states": []}, bad)
        bad.write_bytes(bad.read_bytes()[:2000])
    elif kind == "pickled":
        bad.write_bytes(pickle.dumps({"state_dict": os.getcwd}))
    else:
        save_file({"a.lora_A.weight": torch.ones(2, 2)}, bad)
    config = resume_config(tmp_path, tiny_flux_dir, photos_dir, "b")
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(config), "--ckpt_path", str(bad)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"--ckpt_path: {bad} cannot be used" in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1


def test_a_moved_run_folder_resumes_where_it_stopped(tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path) -> None:
    import shutil

    from lightning_lora.checkpoint import resolve_resume

    config = resume_config(tmp_path, tiny_flux_dir, photos_dir, "a", **{"trainer.max_steps": 2})
    run_cli(["fit", "--config", str(config)])
    moved = tmp_path / "moved"
    shutil.move(config.parent, moved)
    config = moved / "config.yaml"
    data = yaml.safe_load(config.read_text())
    data["trainer"]["default_root_dir"] = str(moved / "run")
    config.write_text(yaml.safe_dump(data))
    checkpoints = moved / "run" / "checkpoints"
    for end in (4, 6):
        cli = run_cli(["fit", "--config", str(config), "--ckpt_path", "last", "--trainer.max_steps", str(end)])
        assert cli.trainer.global_step == end
        path, ckpt = resolve_resume(checkpoints)
        assert ckpt is not None and ckpt["global_step"] == end, (
            f"'last' is {path} at step {ckpt and ckpt['global_step']}"
        )
    assert not list(checkpoints.glob("*-v*.ckpt")), sorted(p.name for p in checkpoints.iterdir())


@pytest.mark.parametrize(("signal_name", "status"), [("SIGINT", 130), ("SIGTERM", 143)])
def test_an_interrupted_fit_exits_non_zero_after_saving(
    tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path, capsys, signal_name: str, status: int
) -> None:
    from lightning_lora.cli import main

    interrupt = {"class_path": "helpers.crash.InterruptAt", "init_args": {"batch": 2, "signal_name": signal_name}}
    config = resume_config(tmp_path, tiny_flux_dir, photos_dir, "b", callbacks=[interrupt])
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(config)])
    assert exit_info.value.code == status
    last = torch.load(config.parent / "run" / "checkpoints" / "last.ckpt", weights_only=True)
    assert last["global_step"] == 3
    assert f"stopped by {signal_name} at step 3" in capsys.readouterr().out


# -- one run per folder -----------------------------------------------------------------------------------------------
def test_the_same_command_again_in_a_run_folder_with_checkpoints_is_refused_before_writing(
    tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path, capsys
) -> None:
    """Users run the same command again: without --ckpt_path it used to train from step 0 over the finished run,
    replace its exported LoRA and write last-v1.ckpt. Now one line, exit status 2, and the folder is untouched;
    --ckpt_path last continues the run, another folder starts a new one."""
    from helpers import tree_digest

    from lightning_lora.cli import main

    config = resume_config(tmp_path, tiny_flux_dir, photos_dir, "b", **{"trainer.max_steps": 2})
    run_cli(["fit", "--config", str(config)])
    run = config.parent / "run"
    before = tree_digest(run)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(config), "--trainer.max_steps", "4"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == (
        f"lightning-lora: error: {run} holds checkpoints of an earlier run (step 2): add --ckpt_path last to continue "
        "it, or choose another trainer.default_root_dir for a new run."
    )
    assert tree_digest(run) == before  # not a byte: no config.yaml, run log, checkpoint or LoRA
    cli = run_cli(["fit", "--config", str(config), "--ckpt_path", "last", "--trainer.max_steps", "3"])
    assert cli.trainer.global_step == 3
    elsewhere = run_cli(["fit", "--config", str(config), "--trainer.default_root_dir", str(tmp_path / "new")])
    assert elsewhere.trainer.global_step == 2
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "last.ckpt",
        "step0001.ckpt",
        "step0002.ckpt",
        "step0003.ckpt",
    ]


def test_a_second_fit_into_a_run_folder_in_use_is_refused_naming_the_first(
    tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path, capsys
) -> None:
    """The folder's lock is held by another process (taken through the same RunLock a fit takes): a fit into it is one
    line naming that process, exit status 2, writing nothing. Killed with SIGKILL, the holder leaves no stale lock."""
    import socket
    import subprocess
    import sys

    from helpers import command_env, tree_digest

    from lightning_lora.cli import main

    config = resume_config(tmp_path, tiny_flux_dir, photos_dir, "b", **{"trainer.max_steps": 1})
    run = config.parent / "run"
    hold = "import sys; from lightning_lora.callbacks.resume import RunLock; RunLock(sys.argv[1]).acquire(); "
    hold += "print('locked', flush=True); sys.stdin.read()"
    holder = subprocess.Popen(
        [sys.executable, "-c", hold, str(run)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=command_env(),
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        before = tree_digest(run)
        with pytest.raises(SystemExit) as exit_info:
            main(["fit", "--config", str(config)])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1, err
        holder_named = f"(pid {holder.pid} on {socket.gethostname()}, started "
        assert f"trainer.default_root_dir: {run} is in use by another run {holder_named}" in err, err
        assert f"-c {run}" in err and "choose another trainer.default_root_dir" in err, err
        assert tree_digest(run) == before
    finally:
        holder.kill()  # SIGKILL
        holder.wait()
    assert run_cli(["fit", "--config", str(config)]).trainer.global_step == 1


def test_a_moved_base_model_resumes_and_another_model_at_its_path_is_refused(
    tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run trained on a model named by a relative path continues after the model moved to another disk and is named
    by an absolute path (its cache entries are reused: the same model); a model with other weights copied to that
    path is refused in one line, though model.pretrained is written the same."""
    import shutil

    from helpers import other_weights

    from lightning_lora.cli import main

    shutil.copytree(tiny_flux_dir, tmp_path / "disk1" / "flux")
    monkeypatch.chdir(tmp_path)
    config = resume_config(tmp_path, tiny_flux_dir, photos_dir, "b", **{"model.pretrained": "disk1/flux"})
    run_cli(["fit", "--config", str(config), "--trainer.max_steps", "2"])
    shutil.move(tmp_path / "disk1", tmp_path / "disk2")
    moved = str(tmp_path / "disk2" / "flux")
    resume = ["fit", "--config", str(config), "--ckpt_path", "last", "--model.pretrained", moved]
    cli = run_cli([*resume, "--trainer.max_steps", "3"])
    assert cli.trainer.global_step == 3
    report = cli.datamodule.report
    assert report is not None and report.latents_encoded == 0 and report.texts_encoded == 0
    other_weights(tmp_path / "disk2" / "flux")  # another model of the same shapes
    with pytest.raises(SystemExit) as exit_info:
        main([*resume, "--trainer.max_steps", "4"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert f"model.pretrained '{moved}' is not the model the run was trained on: their files differ" in err, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err


PRESERVED_FAMILIES = {  # FLUX: the SIGKILL test below
    "sdxl": {"class_path": "lightning_lora.families.SDXL", "init_args": {}},
    "zimage": {"class_path": "lightning_lora.families.ZImage", "init_args": {"max_sequence_length": 64}},
}


@pytest.mark.parametrize("family", list(PRESERVED_FAMILIES))
def test_preservation_and_masks_resume_exactly(
    tmp_path: Path, tiny_pipeline: Any, preserved_photos: Path, family: str
) -> None:
    """DOP with a regularization folder (loss weight 0.5) and every photo again without its trigger, masks on two
    photos: 10 samples, 5 batches an epoch, so the stop at step 2 is inside it. The resumed run ends with the same
    LoRA, bit for bit, and logs the same losses as the run that never stopped, on SDXL and Z-Image."""
    options = {"model.family": PRESERVED_FAMILIES[family], **preservation_options(preserved_photos, every_image=True)}
    check_same_run_after_resume(tmp_path, tiny_pipeline(family), preserved_photos / "train", 4, 2, **options)


@pytest.mark.subprocess
def test_sigkill_with_preservation_and_masks_then_resume_is_exact(
    tmp_path: Path, tiny_flux_dir: Path, preserved_photos: Path
) -> None:
    """Killed with SIGKILL at a random batch of a FLUX run with DOP (a regularization folder, every photo again without
    its trigger) and masks, and resumed: the same LoRA and losses as the run that never stopped."""
    options = {"steps": 4, **preservation_options(preserved_photos, every_image=True)}
    photos = preserved_photos / "train"
    reference = resume_config(tmp_path, tiny_flux_dir, photos, "a", **options)
    assert run_cli(["fit", "--config", str(reference)]).trainer.global_step == 4
    seed = random.randrange(1 << 30)
    batch = random.Random(seed).randrange(2, 4)  # inside the first epoch (5 batches)
    config = _killed_then_resumed(tmp_path, tiny_flux_dir, photos, "b", 1, batch, **options)
    try:
        assert_same_run(reference, config, after_step=batch)
    except AssertionError as e:
        raise AssertionError(f"kill at batch {batch} (seed {seed}): {e}") from e
