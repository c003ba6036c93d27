"""The progress bar's estimate of the time left, and when the first step is worth a line: neither may count a first
step that compiled (it read 1:07:52 left of a run that ended 38 s later)."""

from __future__ import annotations

import io
from types import SimpleNamespace
from typing import Any

import pytest

from lightning_lora.callbacks import monitor
from lightning_lora.callbacks.monitor import StepClock, StepProgressBar


def test_the_time_left_does_not_count_the_first_step() -> None:
    clock = StepClock(now=0.0, step=0)
    assert not clock.tick(1.0, 0) and clock.seconds_left(1.0, 0, 1000) is None
    assert clock.tick(60.0, 1) and clock.first_step_s == 60.0  # compiling
    assert clock.seconds_left(60.0, 1, 1000) is None  # nothing measured after it yet
    assert clock.seconds_per_step(61.0, 3) == pytest.approx(0.5)
    assert clock.seconds_left(61.0, 3, 1000) == pytest.approx(997 * 0.5)
    assert clock.first_step_notable(61.0, 3)
    quick = StepClock(now=0.0, step=40)  # a resumed run whose first step compiled nothing
    quick.tick(0.6, 41)
    assert quick.seconds_per_step(1.6, 43) == pytest.approx(0.5) and not quick.first_step_notable(1.6, 43)


def test_the_bar_in_a_log_after_a_slow_first_step(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """stdout is not a terminal here: a plain line every tenth of the run, whose time left comes from the steps after
    the first (60 s) one: 0.5 s a step."""
    now = [0.0]
    monkeypatch.setattr(monitor.time, "perf_counter", lambda: now[0])
    trainer: Any = SimpleNamespace(
        max_steps=100,
        global_step=0,
        is_global_zero=True,
        log_every_n_steps=50,
        progress_bar_metrics={"train/loss": 0.25},
        optimizers=[],
    )
    bar = StepProgressBar()
    bar.on_train_start(trainer, None)  # type: ignore[arg-type]
    for step in range(1, 21):
        now[0] = 60.0 + 0.5 * (step - 1)
        trainer.global_step = step
        bar.on_train_batch_end(trainer, None)  # type: ignore[arg-type]
    bar.on_train_end(trainer, None)  # type: ignore[arg-type]
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "step 10/100  loss 0.2500  0.50 s/step  0:45 left",
        "step 20/100  loss 0.2500  0.50 s/step  0:40 left",
    ]
    assert bar.shown == (20, 100) and bar.lines == 2


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_bar_on_a_terminal_and_a_line_printed_while_it_shows(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a terminal the demo shows a tqdm bar on stdout; a line printed while it shows (the first-step line, a
    warning) clears the bar and starts on its own line, and the bar is drawn again below it (a plain print would append
    the line to the bar's)."""
    screen = _Terminal()
    monkeypatch.setattr(monitor.sys, "stdout", screen)
    trainer: Any = SimpleNamespace(
        max_steps=4, global_step=0, is_global_zero=True, progress_bar_metrics={"train/loss": 0.25}, optimizers=[]
    )
    bar = StepProgressBar()
    bar.on_train_start(trainer, None)  # type: ignore[arg-type]
    for step in range(1, 5):
        trainer.global_step = step
        bar.on_train_batch_end(trainer, None)  # type: ignore[arg-type]
        if step == 2:
            monitor.console_line("First optimizer step: 60.0 s (the next ones 0.50 s)")
    bar.on_train_end(trainer, None)  # type: ignore[arg-type]
    drawn = screen.getvalue().split("\r")
    assert any(part.startswith("First optimizer step: 60.0 s (the next ones 0.50 s)\n") for part in drawn), drawn
    assert drawn[-1].startswith("steps 4/4 100%|") and "loss=0.2500" in drawn[-1], drawn
    assert bar.shown == (4, 4) and bar.lines == 0


def test_the_cache_builds_bar_is_on_stdout_too(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The cache build's bar was on stderr, the training's and every other line on stdout: one stream now; shown on a
    terminal only."""
    from lightning_lora.data.cache import progress_bar

    screen = _Terminal()
    monkeypatch.setattr(monitor.sys, "stdout", screen)
    with progress_bar(2, "Encoding images", True) as bar:
        bar.update(2)
    assert "Encoding images: 100%" in screen.getvalue() and "2/2" in screen.getvalue()
    monkeypatch.undo()
    with progress_bar(2, "Encoding images", True) as bar:  # not a terminal: nothing
        bar.update(2)
    assert capsys.readouterr() == ("", "")


def test_the_hparams_are_the_options_the_config_sets() -> None:
    from lightning_lora.callbacks.monitor import flat_options, run_hparams

    config = {
        "seed_everything": 42,
        "trainer": {
            "max_steps": 100,
            "inference_mode": True,
            "deterministic": None,
            "precision": None,
            "plugins": {"class_path": "lightning_lora.precision.BF16", "init_args": {"dtype": "fp32", "skip": []}},
            "callbacks": [
                {"class_path": "lightning_lora.callbacks.SampleImages", "init_args": {"every_n_steps": 30, "steps": 4}}
            ],
        },
        "model": {
            "pretrained": "black-forest-labs/FLUX.1-dev",
            "family": {"class_path": "lightning_lora.families.Flux", "init_args": {"guidance": 1.0}},
            "lora": {"rank": 16, "alpha": None, "targets": ["to_q", "to_k"]},
            "gradient_checkpointing": False,
            "optimizer": {"class_path": "torch.optim.AdamW", "init_args": {"lr": 0.0001, "weight_decay": 0.01}},
        },
        "data": {"resolution": [512, 768], "batch_size": 2, "random_flip": True},
    }
    written = {"model": {"lora": {"targets": ["to_q", "to_k"]}}, "data": {"random_flip": True}}
    chosen = set(flat_options(written)) | {"trainer.callbacks.SampleImages.steps", "model.gradient_checkpointing"}
    assert run_hparams(config, chosen) == {
        "trainer.plugins": "BF16",
        "trainer.plugins.dtype": "fp32",
        "trainer.callbacks.SampleImages.steps": 4,
        "model.pretrained": "black-forest-labs/FLUX.1-dev",
        "model.family": "Flux",
        "model.lora.rank": 16,
        "model.lora.targets": "to_q, to_k",
        "model.gradient_checkpointing": "false",
        "model.optimizer.lr": 0.0001,
        "data.resolution": "512, 768",
        "data.batch_size": 2,
        "data.random_flip": "true",
    }
    assert set(run_hparams(config, None)) == {
        "trainer.plugins",
        "trainer.plugins.dtype",
        "model.pretrained",
        "model.family",
        "model.lora.rank",
        "model.optimizer.lr",
        "data.resolution",
        "data.batch_size",
    }


def test_the_options_a_command_line_sets(tmp_path) -> None:
    from lightning_lora.cli.peek import options_set

    config = tmp_path / "c.yaml"
    config.write_text("model:\n  lora: {rank: 4}\n  optimizer: {class_path: torch.optim.AdamW, init_args: {lr: 0.1}}\n")
    args = ["fit", "--config", str(config), "--model.optimizer.init_args.weight_decay", "0", "--data.batch_size=2"]
    assert options_set(args) == {
        "model.lora.rank",
        "model.optimizer",
        "model.optimizer.lr",
        "model.optimizer.weight_decay",
        "data.batch_size",
    }
