"""What a config may name (lightning_lora.cli.class_paths): a class of the kind each option takes, from a trusted
module. A config that names anything else (``os.system`` with a command as ``init_args``) stops every verb with one
line naming the option, before anything it names is imported or called; ``plan`` and ``cache`` build no optimizer and
none of the config's callbacks."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import write_config

from lightning_lora.cli import main
from lightning_lora.cli.class_paths import ALLOW_ENV, trusted
from lightning_lora.plan import optimizer_name


def _command(marker: Path) -> dict[str, Any]:
    return {"class_path": "os.system", "init_args": {"command": f"touch {marker}"}}


def _run(capsys: pytest.CaptureFixture[str], args: list[str]) -> tuple[int, list[str]]:
    """The exit status and the non-empty lines printed."""
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    captured = capsys.readouterr()
    return int(exit_info.value.code or 0), [line for line in (captured.out + captured.err).splitlines() if line]


@pytest.mark.parametrize("option", ["model.optimizer", "model.scheduler"])
@pytest.mark.parametrize("verb", ["plan", "cache", "fit"])
def test_a_config_that_names_a_command_runs_nothing(
    tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path, capsys: pytest.CaptureFixture[str], verb: str, option: str
) -> None:
    marker = tmp_path / "MARKER"
    config = write_config(tmp_path, tiny_flux_dir, photos_dir, **{option: _command(marker)})
    status, lines = _run(capsys, [verb, "--config", str(config)])
    assert status == 2 and not marker.exists()
    assert len(lines) == 1 and f"{option}: os.system is not a class a config may name" in lines[0], lines
    assert not (tmp_path / "cache").exists() and not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"model.family": "{command}"}, "model.family: os.system"),
        ({"trainer.callbacks": ["{command}"]}, "trainer.callbacks: os.system"),
        ({"trainer.callbacks": ["os.system"]}, "trainer.callbacks: os.system"),
        ({"trainer.logger": "{command}"}, "trainer.logger: os.system"),
        ({"trainer.plugins": "{command}"}, "trainer.plugins: os.system"),
        ({"trainer.strategy": "{command}"}, "trainer.strategy: os.system"),
        ({"model.optimizer": "os.system"}, "model.optimizer: os.system"),
        # init_args cannot smuggle a class path in: typed, untyped (Any) or a callable parameter of a trusted class
        (
            {"model.optimizer": {"class_path": "torch.optim.AdamW", "init_args": {"lr": "{command}"}}},
            "model.optimizer.init_args.lr: os.system",
        ),
        (
            {
                "trainer.logger": {
                    "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                    "init_args": {"save_dir": "logs"},
                    "dict_kwargs": {"extra": "{command}"},
                }
            },
            "trainer.logger.dict_kwargs.extra: os.system",
        ),
        (
            {
                "trainer.callbacks": [
                    {
                        "class_path": "lightning.pytorch.callbacks.LambdaCallback",
                        "init_args": {"on_fit_start": "{command}"},
                    }
                ]
            },
            "trainer.callbacks.init_args.on_fit_start: os.system",
        ),
        # through a trusted module to what it imported: judged by where it is defined (pickle's torch.load)
        (
            {"model.optimizer": {"class_path": "torch.optim.optimizer.torch.load", "init_args": {"f": "x.pt"}}},
            "model.optimizer: torch.serialization.load",
        ),
        # a trusted module's function, or a class of another kind
        (
            {
                "model.scheduler": {
                    "class_path": "lightning_lora.schedules.warmup_cosine_factor",
                    "init_args": {"step": 0, "warmup_steps": 1, "total_steps": 2},
                }
            },
            "model.scheduler: lightning_lora.schedules.warmup_cosine_factor is not a class",
        ),
        (
            {"model.optimizer": {"class_path": "torch.optim.lr_scheduler.StepLR", "init_args": {"step_size": 2}}},
            "model.optimizer: torch.optim.lr_scheduler.StepLR is not an optimizer class",
        ),
        ({"model.family": {"class_path": "torch.optim.AdamW"}}, "model.family: torch.optim.AdamW is not a model"),
    ],
)
def test_every_class_path_is_a_trusted_class_of_its_kind(
    tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path, capsys: pytest.CaptureFixture[str], overrides, named: str
) -> None:
    marker = tmp_path / "MARKER"

    def fill(value: Any) -> Any:
        if value == "{command}":
            return _command(marker)
        if isinstance(value, dict):
            return {k: fill(v) for k, v in value.items()}
        return [fill(v) for v in value] if isinstance(value, list) else value

    config = write_config(tmp_path, tiny_flux_dir, photos_dir, **fill(overrides))
    status, lines = _run(capsys, ["plan", "--config", str(config)])
    assert status == 2 and not marker.exists()
    assert len(lines) == 1 and named in lines[0], lines


def test_a_module_the_user_allows_may_be_named_and_no_other(
    tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch
) -> None:
    """``LIGHTNING_LORA_ALLOW_IMPORTS`` (not a config) adds modules; once it lists one no more, it is refused again."""
    callback = {"class_path": "helpers.counted.CountedCallback"}
    config = write_config(tmp_path, tiny_flux_dir, photos_dir, **{"trainer.callbacks": [callback]})
    monkeypatch.setenv(ALLOW_ENV, "helpers.counted")
    assert _run(capsys, ["plan", "--config", str(config)])[0] == 0
    monkeypatch.setenv(ALLOW_ENV, "")
    status, lines = _run(capsys, ["plan", "--config", str(config)])
    assert status == 2 and "trainer.callbacks: helpers.counted.CountedCallback is not a class" in lines[0], lines
    assert ALLOW_ENV in lines[0]
    monkeypatch.setenv(ALLOW_ENV, "helpers")  # the package above the module allowed before: all of it now
    assert _run(capsys, ["plan", "--config", str(config)])[0] == 0


def test_plan_and_cache_build_no_optimizer_and_no_callback_of_the_config(
    tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from helpers.counted import BUILT

    config = write_config(
        tmp_path,
        tiny_flux_dir,
        photos_dir,
        **{
            "model.optimizer": {"class_path": "helpers.counted.CountedAdamW", "init_args": {"lr": 0.01}},
            "trainer.callbacks": [{"class_path": "helpers.counted.CountedCallback"}],
        },
    )
    BUILT.clear()
    for verb in ("plan", "cache"):
        status, lines = _run(capsys, [verb, "--config", str(config)])
        assert status == 0, lines
    assert BUILT == {}


def test_the_planner_reads_the_optimizer_class_without_calling_the_factory() -> None:
    calls: list[Any] = []

    def factory(params: Any) -> torch.optim.Optimizer:
        calls.append(params)
        return torch.optim.SGD(params, lr=1.0)

    assert optimizer_name(torch.optim.SGD) == "SGD"
    assert optimizer_name(functools.partial(torch.optim.Adam, lr=1e-3)) == "Adam"
    assert optimizer_name(factory) == "AdamW" and not calls  # an unknown callable: the default's state size, no call


@pytest.mark.parametrize(
    ("path", "allowed"),
    [
        ("torch.optim.AdamW", True),
        ("transformers.Adafactor", True),  # jsonargparse's shortest path of transformers.optimization.Adafactor
        ("lightning_lora.Flux", True),
        ("os.system", False),
        ("torch.serialization.load", False),
        ("transformers.models.bert.BertModel", False),  # a module of a trusted package that is not trusted
        ("lightning_lora.__main__", False),  # importing it would run the command again
        ("lightning_lora.cli.fit.LoraCLI", False),
    ],
)
def test_which_import_paths_are_trusted(path: str, allowed: bool) -> None:
    assert trusted(path) is allowed
