"""The ``lightning-lora fit`` command end to end, in-process (fast) and once as a real subprocess.

A short fit on a tiny FLUX and real photos must lower the fixed evaluation loss and leave the run folder complete;
``--ckpt_path last`` must continue at the right step with the optimizer state; bad input must stop early with a
message that names the option, and never modify the user's files.
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from pathlib import Path

import pytest
import torch
import yaml
from helpers import REPO, eval_history, fit_in_subprocess, run_cli, tree_digest, write_config

from lightning_lora.cli import main

CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


@pytest.mark.gpu
def test_fit_on_a_gpu_logs_its_memory_beside_the_plan(tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path) -> None:
    """On a GPU the VRAMMonitor logs the static footprint once the model is set up, the planner's prediction, and each
    logging window's peak allocated and reserved memory per rank (on the CPU it logs nothing)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    options = {"trainer.accelerator": "gpu", "trainer.max_steps": 4, "trainer.callbacks": []}
    cli = run_cli(["fit", "--config", str(write_config(tmp_path, tiny_flux_dir, photos_dir, **options))])
    assert cli.trainer.global_step == 4 and cli.model.device.type == "cuda"
    events = EventAccumulator(str(tmp_path / "run")).Reload()
    tags = {"vram/static_GiB", "vram/planned_peak_GiB", "vram/rank0/peak_allocated_GiB", "vram/rank0/peak_reserved_GiB"}
    assert tags <= set(events.Tags()["scalars"])
    (static,) = [e.value for e in events.Scalars("vram/static_GiB")]
    (planned,) = [e.value for e in events.Scalars("vram/planned_peak_GiB")]
    allocated = [e.value for e in events.Scalars("vram/rank0/peak_allocated_GiB")]
    reserved = [e.value for e in events.Scalars("vram/rank0/peak_reserved_GiB")]
    assert len(allocated) == len(reserved) >= 2  # a window per logged step (log_every_n_steps: 1)
    assert 0 < static <= min(allocated) and all(a <= r for a, r in zip(allocated, reserved, strict=True))
    assert planned > max(allocated) / 10  # the tiny model: mostly the planner's fixed allowance, not a wild number


def test_fit_trains_and_writes_the_run_folder(
    tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    before = tree_digest(tiny_flux_dir), tree_digest(photos_dir)
    config = write_config(tmp_path, tiny_flux_dir, photos_dir, **{"trainer.max_steps": 30})
    data = yaml.safe_load(config.read_text())
    export = {"class_path": "lightning_lora.callbacks.LoraExport", "init_args": {"formats": ["diffusers", "kohya"]}}
    data["trainer"]["callbacks"].append(export)
    config.write_text(yaml.safe_dump(data))
    with caplog.at_level(logging.INFO):
        cli = run_cli(["fit", "--config", str(config)])
    assert cli.trainer.global_step == 30
    evals = eval_history(cli)
    assert evals[0][0] == 0 and evals[-1][0] == 30
    assert evals[-1][1] < evals[0][1], f"fixed eval loss did not go down: {evals}"

    run = tmp_path / "run"
    assert (run / "config.yaml").is_file()
    assert list(run.glob("events.out.tfevents.*")), "no TensorBoard event file"
    assert (run / "checkpoints" / "last.ckpt").is_file()
    assert (run / "lora" / "lora.safetensors").is_file()
    assert (run / "lora" / "lora.kohya.safetensors").is_file()
    assert sorted(p.name for p in (run / "samples").iterdir()) == ["step000000_00.png", "step000030_00.png"]

    # The checkpoint holds the LoRA tensors and optimizer state only, never the frozen base.
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["state_dict"] and all(".lora_" in k for k in ckpt["state_dict"])
    assert ckpt["optimizer_states"][0]["state"]
    # TensorBoard got the loss, the learning rate and the images.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run), size_guidance={"images": 0}).Reload()
    assert {
        "train/loss",
        "train/lr",
        "eval/loss",
        "perf/images_per_s",
        "perf/minutes_left",
        "perf/first_step_s",
    } <= set(events.Tags()["scalars"])
    assert [e.step for e in events.Scalars("perf/first_step_s")] == [1]  # once, at the first optimizer step
    first = [r.getMessage() for r in caplog.records if r.getMessage().startswith("First optimizer step")]
    assert len(first) == 1 and "compiling" not in first[0]  # and on the console; this run compiles nothing
    assert any(tag.startswith("config") for tag in events.Tags()["tensors"])  # the resolved config, as text
    assert any(tag.startswith("samples/") for tag in events.Tags()["images"])
    # The HParams tab: the run's options beside its final fixed evaluation loss, to compare runs in one table.
    from tensorboard.plugins.hparams import plugin_data_pb2

    start = events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hparams = plugin_data_pb2.HParamsPluginData.FromString(start).session_start_info.hparams
    assert hparams["model.lora.rank"].number_value == 4 and hparams["data.resolution"].number_value == 32
    assert [e.value for e in events.Scalars("hp/eval_loss")] == pytest.approx([evals[-1][1]])
    # The user's model and photos are untouched; the cache went to cache_dir.
    assert (tree_digest(tiny_flux_dir), tree_digest(photos_dir)) == before
    assert list((tmp_path / "cache" / "latents").glob("*.safetensors"))


def test_exported_lora_loads_into_a_fresh_pipeline(tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path) -> None:
    from diffusers import FluxPipeline

    config = write_config(tmp_path, tiny_flux_dir, photos_dir, **{"trainer.max_steps": 4})
    cli = run_cli(["fit", "--config", str(config)])
    lora_file = tmp_path / "run" / "lora" / "lora.safetensors"

    pipe = FluxPipeline.from_pretrained(tiny_flux_dir)
    kwargs = {"prompt": "a photo of sks cat", "height": 32, "width": 32, "num_inference_steps": 2, "output_type": "pt"}
    kwargs["max_sequence_length"] = 16
    base = pipe(generator=torch.Generator().manual_seed(0), **kwargs).images
    pipe.load_lora_weights(lora_file)
    with_lora = pipe(generator=torch.Generator().manual_seed(0), **kwargs).images
    assert not torch.allclose(base, with_lora, atol=1e-4), "the LoRA did not change the output"
    # And the loaded LoRA is the trained one: same transformer output as the training model.
    trained = cli.model.denoiser.eval()
    x = {
        "hidden_states": torch.randn(1, 4, 16),
        "encoder_hidden_states": torch.randn(1, 16, trained.config.joint_attention_dim),
        "pooled_projections": torch.randn(1, trained.config.pooled_projection_dim),
        "timestep": torch.tensor([0.5]),
        "guidance": torch.tensor([1.0]),
        "img_ids": torch.zeros(4, 3),
        "txt_ids": torch.zeros(16, 3),
        "return_dict": False,
    }
    with torch.no_grad():
        torch.testing.assert_close(pipe.transformer(**x)[0], trained(**x)[0], atol=1e-5, rtol=1e-4)


def test_resume_from_last_continues_at_the_right_step(tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path) -> None:
    config = write_config(tmp_path, tiny_flux_dir, photos_dir, **{"trainer.max_steps": 4})
    first = run_cli(["fit", "--config", str(config)])
    saved = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)
    assert saved["global_step"] == 4
    lora_at_4 = {k: v.clone() for k, v in first.model.trainable_state_dict().items()}

    second = run_cli(["fit", "--config", str(config), "--ckpt_path", "last", "--trainer.max_steps", "6"])
    assert second.trainer.global_step == 6
    # AdamW's step counter continued from the checkpoint (a fresh optimizer would be at 2).
    state = second.trainer.optimizers[0].state
    steps = {int(s["step"]) for s in state.values()}
    assert steps == {6}
    # It started from the saved LoRA, not from a new random init: the weights moved only a little.
    resumed = second.model.trainable_state_dict()
    assert resumed.keys() == lora_at_4.keys()
    drift = max((resumed[k] - lora_at_4[k]).abs().max().item() for k in resumed)
    fresh = first.model.trainable_state_dict()
    assert drift < 0.1 and any(not torch.equal(resumed[k], fresh[k]) for k in resumed)


def test_resume_with_another_rank_is_refused(tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path, capsys) -> None:
    config = write_config(tmp_path, tiny_flux_dir, photos_dir, **{"trainer.max_steps": 4})
    run_cli(["fit", "--config", str(config)])
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(config), "--ckpt_path", "last", "--model.lora.rank", "8"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "model.lora.rank was 4, now 8" in err, err


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ({"model.pretrained": "/nonexistent/flux"}, "model.pretrained"),
        ({"data.images": "/nonexistent/photos"}, "data.images"),
        ({"data.resolution": 40}, "data.resolution"),
        ({"model.lora.targets": ["to_q", "to_qq"]}, "model.lora.targets"),
        ({"model.denoiser_file": "/nonexistent/flux1-dev.safetensors"}, "model.denoiser_file"),
    ],
)
def test_bad_input_stops_with_a_message_naming_the_option(
    tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path, capsys, override: dict, expected: str
) -> None:
    config = write_config(tmp_path, tiny_flux_dir, photos_dir, **override)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(config)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert expected in err, err
    assert "Traceback" not in err
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_folder_that_is_not_a_pipeline_and_empty_image_folder(
    tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path, capsys
) -> None:
    not_a_pipeline = tmp_path / "some_folder"
    not_a_pipeline.mkdir()
    (not_a_pipeline / "weights.bin").write_bytes(b"x")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("no images here")
    for override, expected in (
        ({"model.pretrained": str(not_a_pipeline)}, "model_index.json"),
        ({"data.images": str(empty)}, "holds no images"),
    ):
        config = write_config(tmp_path, tiny_flux_dir, photos_dir, **override)
        with pytest.raises(SystemExit) as exit_info:
            main(["fit", "--config", str(config)])
        assert exit_info.value.code == 2
        assert expected in capsys.readouterr().err
    assert (not_a_pipeline / "weights.bin").read_bytes() == b"x"


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ({"model.lora.rnak": 4}, "rnak"),
        ({"model.lora.rank": "sixteen"}, "model.lora.rank"),
        ({"trainer.max_stepz": 3}, "max_stepz"),
    ],
)
def test_typos_and_wrong_types_are_named(
    tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path, capsys, override, expected
) -> None:
    config = write_config(tmp_path, tiny_flux_dir, photos_dir)
    data = yaml.safe_load(config.read_text())
    for dotted, value in override.items():
        node = data
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node[key]
        node[leaf] = value
    config.write_text(yaml.safe_dump(data))
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(config)])
    assert exit_info.value.code != 0
    assert expected in capsys.readouterr().err


def test_scheduler_without_length_is_refused(tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path, capsys) -> None:
    config = write_config(
        tmp_path,
        tiny_flux_dir,
        photos_dir,
        **{
            "trainer.max_steps": -1,
            "trainer.max_epochs": 1,
            "model.scheduler": {"class_path": "lightning_lora.schedules.CosineWithWarmup"},
        },
    )
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(config)])
    assert exit_info.value.code == 2
    assert "trainer.max_steps" in capsys.readouterr().err


@pytest.mark.parametrize("config", CONFIGS, ids=[c.name for c in CONFIGS])
def test_shipped_configs_parse(config: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(config), "--print_config"])
    assert exit_info.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"]["pretrained"]
    assert printed["trainer"]["default_root_dir"].startswith("runs/")


def test_help_lists_our_options(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for option in ("--model.pretrained", "--model.lora.rank", "--model.denoiser_file", "--data.images", "--ckpt_path"):
        assert option in out


def test_a_subcommand_builds_its_own_parser_alone(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """``fit`` builds fit's parser and no other (each costs ~0.15 s of CPU, every command and in-process test pays it),
    ``validate`` its own; ``--help`` without a subcommand builds and lists all four."""
    from lightning.pytorch.cli import LightningCLI

    built: list[str] = []
    prepare = LightningCLI._prepare_subcommand_parser

    def recorded(self: LightningCLI, klass: type, subcommand: str, **kwargs: object) -> object:
        built.append(subcommand)
        return prepare(self, klass, subcommand, **kwargs)

    monkeypatch.setattr(LightningCLI, "_prepare_subcommand_parser", recorded)
    for args in (["fit", "--help"], ["validate", "--help"], ["--help"]):
        with pytest.raises(SystemExit) as exit_info:
            main(args)
        assert exit_info.value.code == 0, args
    assert built == ["fit", "validate", "fit", "validate", "test", "predict"]
    out = capsys.readouterr().out
    assert "--data.images" in out and "{fit,validate,test,predict}" in out


OUR_LINES = re.compile(
    "|".join(
        (
            r"^$",
            r"^Cache ",
            r"^  (images found|training|latents|text embeddings|skipped|notes|buckets|time): ",
            r"^    \S",  # the summary's list of skipped files and notes
            r"^(skipped|note:) ",  # the same, logged as they are found
            r"^Training: steps \d+ -> \d+",
            r"^Learning rate: ",
            r"^Compiling: ",
            r"^First optimizer step: [\d.]+ s",
            r"^Resumed from ",
            r"^  model\.(scheduler|optimizer): ",
            r"^Fixed evaluation loss: ",
            r"^LoRA written at step \d+: ",
            r"^Run folder: ",
            r"^  (sample images|fixed eval loss|LoRA file|checkpoints|resolved config|TensorBoard): ",
            r"^  library messages: ",
        )
    )
)
"""What the command prints in a normal run: our lines only (the libraries' go to the run folder's log)."""


@pytest.mark.subprocess
def test_console_script_fit_and_resume(tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path) -> None:
    """The real command, as a user runs it: a separate process, then a resume in another one. The console shows our
    lines only: no library warning, tip or table (they are in <run folder>/lightning-lora.log)."""
    config = write_config(tmp_path, tiny_flux_dir, photos_dir, **{"trainer.max_steps": 4})
    first = fit_in_subprocess(config)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "Run folder:" in first.stdout and "tensorboard --logdir" in first.stdout
    second = fit_in_subprocess(config, "--ckpt_path", "last", "--trainer.max_steps", "6")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "(step 6)" in second.stdout
    assert torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 6
    for run in (first, second):
        lines = (run.stdout + run.stderr).splitlines()
        foreign = [line for line in lines if not OUR_LINES.search(line)]
        assert not foreign, "\n".join(foreign)
    log = (tmp_path / "run" / "lightning-lora.log").read_text()
    assert "GPU available" in log and "Seed set to 7" in log  # kept, where it bothers nobody


def test_held_out_validation_loss_is_logged(tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path) -> None:
    import shutil

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    held_out = tmp_path / "val"
    held_out.mkdir()
    for name in ("coffee.png", "coffee.txt"):
        shutil.copy(photos_dir / name, held_out / name)
    config = write_config(
        tmp_path, tiny_flux_dir, photos_dir, **{"trainer.max_steps": 3, "data.val_images": str(held_out)}
    )
    run_cli(["fit", "--config", str(config)])
    events = EventAccumulator(str(tmp_path / "run")).Reload()
    steps = [e.step for e in events.Scalars("val/loss")]
    assert steps == [0, 3]  # before training and at the end, on the held-out image only


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--trainer.max_steps", "-5"], "trainer.max_steps: -5 is not a number of steps"),
        (["--trainer.max_steps", "0"], "trainer.max_steps: 0 trains nothing"),
        (
            ["--model.optimizer.init_args.lr", "-0.1"],
            "model.optimizer: Invalid learning rate: -0.1. Fix model.optimizer.init_args",
        ),
    ],
)
def test_impossible_numbers_are_one_line(
    tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path, capsys, args: list[str], expected: str
) -> None:
    config = write_config(tmp_path, tiny_flux_dir, photos_dir)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(config), *args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err, err
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize("precision", ["bf16-true", "16-true", "64-true"])
def test_a_trainer_precision_that_casts_the_lora_is_refused_before_caching(
    tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path, capsys, precision: str
) -> None:
    """``*-true`` precisions cast the whole module: a bf16 LoRA and optimizer state, float8 base weights made bf16."""
    config = write_config(tmp_path, tiny_flux_dir, photos_dir)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(config), "--trainer.precision", precision])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"trainer.precision: {precision} is not supported" in err and "bf16-mixed" in err, err
    assert "Traceback" not in err
    assert not (tmp_path / "cache").exists() and not (tmp_path / "run" / "checkpoints").exists()


def test_a_run_folder_that_cannot_be_written_stops_before_loading(
    tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path, capsys
) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    config = write_config(tmp_path, tiny_flux_dir, photos_dir, **{"trainer.default_root_dir": str(blocker / "run")})
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(config)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "trainer.default_root_dir: cannot write to" in err and "is a file" in err, err
    assert blocker.read_text() == "not a folder"


def _failing_writes(monkeypatch: pytest.MonkeyPatch, suffix: str, after: int, error: int) -> list[str]:
    """Make the file system refuse (``error``, e.g. ENOSPC) every write of a ``suffix`` file after the first ``after``,
    the way a full disk does: part of the bytes land, then the write fails without naming a file."""
    import pathlib

    original = pathlib.Path.write_bytes
    written: list[str] = []

    def write_bytes(self: pathlib.Path, data: bytes) -> int:
        if suffix in self.name:
            if len(written) >= after:
                with open(self, "wb") as f:
                    f.write(data[: len(data) // 3])
                raise OSError(error, os.strerror(error))
            written.append(self.name)
        return original(self, data)

    monkeypatch.setattr(pathlib.Path, "write_bytes", write_bytes)
    return written


def test_a_full_disk_while_checkpointing_keeps_the_last_checkpoint(
    tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    every_step = {
        "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
        "init_args": {"every_n_train_steps": 1, "save_last": True, "save_top_k": -1},
    }
    config = write_config(tmp_path, tiny_flux_dir, photos_dir, **{"trainer.callbacks": [every_step]})
    _failing_writes(monkeypatch, ".ckpt", after=4, error=errno.ENOSPC)  # steps 1 and 2 (step file + last.ckpt)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(config)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "cannot write" in err and ".ckpt" in err and "disk is full" in err and "Traceback" not in err, err
    monkeypatch.undo()
    checkpoints = tmp_path / "run" / "checkpoints"
    assert torch.load(checkpoints / "last.ckpt", weights_only=True)["global_step"] == 2
    assert not list(checkpoints.glob(".*.tmp")), "a temporary file was left behind"
    cli = run_cli(["fit", "--config", str(config), "--ckpt_path", "last"])
    assert cli.trainer.global_step == 8


@pytest.mark.parametrize("limit", [None, 1 << 20])
def test_a_file_size_limit_while_checkpointing_is_one_line_naming_the_limit(
    tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path, capsys, monkeypatch: pytest.MonkeyPatch, limit: int | None
) -> None:
    """EFBIG (a file larger than FAT32 holds, or than ``ulimit -f`` allows) names the file and the limit, exit 2;
    tests/test_io.py shows that a real ``ulimit -f`` gives EFBIG (not a SIGXFSZ kill) through the atomic writer."""
    import errno

    from lightning_lora import io

    monkeypatch.setattr(io, "file_size_limit", lambda: limit)
    config = write_config(tmp_path, tiny_flux_dir, photos_dir, **{"trainer.max_steps": 4})
    _failing_writes(monkeypatch, ".ckpt", after=0, error=errno.EFBIG)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(config)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert f"cannot write {tmp_path / 'run' / 'checkpoints'}" in err and ".ckpt (File too large)" in err, err
    expected = "file-size limit of 1.0 MiB (ulimit -f)" if limit else "FAT32 holds at most 4 GiB"
    assert expected in err, err
    assert not list((tmp_path / "run" / "checkpoints").glob("*")), "a partial checkpoint was left behind"


@pytest.mark.parametrize("error", ["ENOSPC", "EACCES"])
def test_a_cache_that_cannot_be_written_is_one_line_and_keeps_what_was_written(
    tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path, capsys, monkeypatch: pytest.MonkeyPatch, error: str
) -> None:
    import errno

    config = write_config(tmp_path, tiny_flux_dir, photos_dir, **{"trainer.max_steps": 1})
    written = _failing_writes(monkeypatch, ".safetensors", after=2, error=getattr(errno, error))
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(config)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "cannot write" in err and str(tmp_path / "cache") in err and "Traceback" not in err, err
    monkeypatch.undo()
    kept = sorted(p.name for p in (tmp_path / "cache").rglob("*.safetensors"))
    assert len(kept) == 2 and len(written) == 2
    cli = run_cli(["fit", "--config", str(config)])
    assert cli.trainer.global_step == 1
    assert cli.datamodule.report is not None and cli.datamodule.report.latents_reused >= 1


def test_the_progress_bar_counts_optimizer_steps(tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path, capsys) -> None:
    """With gradient accumulation Lightning's bar counted batches per epoch ("Epoch 1/-2 ... 8/2"); ours counts
    optimizer steps of max_steps."""
    from lightning_lora.callbacks.monitor import StepProgressBar

    overrides = {"trainer.max_steps": 3, "trainer.accumulate_grad_batches": 2, "trainer.enable_progress_bar": True}
    cli = run_cli(["fit", "--config", str(write_config(tmp_path, tiny_flux_dir, photos_dir, **overrides))])
    bar = cli.trainer.progress_bar_callback
    assert isinstance(bar, StepProgressBar) and bar.shown == (3, 3)
    err = capsys.readouterr().err
    assert "3/3" in err and "Epoch" not in err


BNB_NOTE = "Failed to load CPU gemm_4bit_forward from kernels-community: No module named 'kernels'"
"""What bitsandbytes 0.50 logs when it is imported on a CPU with AVX-512 BF16 without the optional ``kernels``."""

KERNELS_NOTE = "Skipping publisher trust check for 'kernels-community/quantization-bitsandbytes' because Hugging Face"
"""What ``kernels`` 0.19 (transformers 5.25 installs it) logs when bitsandbytes asks it for that CPU kernel offline."""


def test_a_library_logging_without_a_handler_goes_to_the_run_log(
    tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bitsandbytes and ``kernels`` log with ``logging`` and no handler of their own: Python's last-resort handler
    would print their notes on the console. During ``fit`` they go to the run log only, while our own warnings and a
    library's error still print; ``plan`` / ``cache`` / ``export`` keep no run log and drop the notes."""
    from lightning_lora.cli.console import Console

    # The logging set-up of the ``lightning-lora`` process: no handler on the root logger (pytest's are set aside), so
    # a record that no handler takes reaches Python's handler of last resort, which prints it on stderr.
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    monkeypatch.setattr(logging, "lastResort", logging.lastResort)  # put back whatever ``plan`` leaves
    before = logging.lastResort
    libraries = logging.getLogger("bitsandbytes.backends.cpu.ops"), logging.getLogger("kernels._internals.hf_hub")
    with Console() as console:
        libraries[0].warning(BNB_NOTE)
        libraries[1].warning(KERNELS_NOTE)
        logging.getLogger("lightning_lora.data.build").warning("note: ours")
        libraries[1].error("a library's error")
        console.attach(tmp_path)
    err = capsys.readouterr().err
    assert BNB_NOTE not in err and KERNELS_NOTE not in err
    assert "note: ours" in err and "a library's error" in err
    run_log = (tmp_path / "lightning-lora.log").read_text()
    assert BNB_NOTE in run_log and KERNELS_NOTE in run_log and "note: ours" not in run_log
    assert logging.lastResort is before  # as it was, after the command
    libraries[1].warning(KERNELS_NOTE)
    assert KERNELS_NOTE in capsys.readouterr().err  # printed again: the routing ended with the command

    with pytest.raises(SystemExit):
        main(["plan", "--config", str(REPO / "configs" / "tiny_cpu.yaml")])
    capsys.readouterr()
    for library in libraries:
        library.warning(BNB_NOTE)
    logging.getLogger("lightning_lora.cli.plan").warning("note: ours")
    err = capsys.readouterr().err
    assert BNB_NOTE not in err and "note: ours" in err


def test_out_of_memory_while_training_names_the_smaller_batches_and_where_to_continue(
    tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GPU running out of memory in a training step (here at step 5, after the checkpoint of step 4) ends the run
    with one line: the same images per step as smaller batches, and --ckpt_path last, which then continues."""
    from lightning_lora.module import LoraModule

    step = LoraModule.training_step

    def fails_at_step_5(self: LoraModule, batch: dict, batch_idx: int) -> torch.Tensor:
        if self.trainer.global_step == 4:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return step(self, batch, batch_idx)

    overrides = {"data.batch_size": 2, "trainer.accumulate_grad_batches": 2}
    config = write_config(tmp_path, tiny_flux_dir, photos_dir, **overrides)
    monkeypatch.setattr(LoraModule, "training_step", fails_at_step_5)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(config)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "out of GPU memory" in err and "training step 5" in err and "Tried to allocate 2.00 GiB" in err, err
    assert "same 4 images per step" in err and "--data.batch_size 1 --trainer.accumulate_grad_batches 4" in err, err
    assert "--ckpt_path last" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    monkeypatch.undo()
    smaller = ["--data.batch_size", "1", "--trainer.accumulate_grad_batches", "4"]
    cli = run_cli(["fit", "--config", str(config), *smaller, "--ckpt_path", "last"])
    assert cli.trainer.global_step == 8


@pytest.mark.parametrize(
    ("batch", "accumulate", "expected"), [(2, 2, (1, 4)), (4, 1, (2, 2)), (3, 2, (1, 6)), (1, 4, None)]
)
def test_smaller_batches_keep_the_images_per_step(batch: int, accumulate: int, expected: tuple | None) -> None:
    from lightning_lora.plan import smaller_batches

    assert smaller_batches(batch, accumulate) == expected


def test_the_configs_allocator_is_kept_in_the_run_and_a_variable_that_overrides_it_is_named(
    tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``allocator`` is an option of the config (applied by the command before it parses: tests/test_hardware.py):
    the run's config.yaml keeps it, and when PYTORCH_CUDA_ALLOC_CONF says otherwise the run says which one it uses."""
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    config = write_config(
        tmp_path, tiny_flux_dir, photos_dir, **{"trainer.max_steps": 1, "allocator": "pytorch_default"}
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_cli(["fit", "--config", str(config)])
    named = [str(w.message) for w in caught if "allocator: pytorch_default is not used" in str(w.message)]
    assert named == [
        "allocator: pytorch_default is not used: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True is set and wins; "
        "unset PYTORCH_CUDA_ALLOC_CONF to run with the config's allocator"
    ]
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["allocator"] == "pytorch_default"
