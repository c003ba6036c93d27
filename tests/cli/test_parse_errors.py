"""A config the parser cannot take stops the command with one line naming the option (and the closest one for a typo),
exit status 2, never the usage screen; and ``--print_config=skip_default`` works for every shipped config, bitsandbytes'
``AdamW8bit`` included. In-process (``lightning_lora.cli.main``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from helpers import REPO, write_config

from lightning_lora.cli import main


def _error(capsys: pytest.CaptureFixture[str], args: list[str]) -> list[str]:
    """The lines the command printed, after checking it stopped with status 2 and printed nothing on stdout."""
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    captured = capsys.readouterr()
    assert exit_info.value.code == 2, captured
    assert "usage:" not in captured.err and "Traceback" not in captured.err, captured.err
    return captured.err.strip().splitlines()


def _typo_in_file(tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path) -> Path:
    config = write_config(tmp_path, tiny_flux_dir, photos_dir)
    data = yaml.safe_load(config.read_text())
    data["model"]["lora"]["rnak"] = data["model"]["lora"].pop("rank")
    config.write_text(yaml.safe_dump(data))
    return config


@pytest.mark.parametrize("where", ["yaml", "command line"])
@pytest.mark.parametrize("verb", ["fit", "cache"])
def test_a_typo_names_the_close_match(
    tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path, capsys: pytest.CaptureFixture[str], where: str, verb: str
) -> None:
    if where == "yaml":
        args = [verb, "--config", str(_typo_in_file(tmp_path, tiny_flux_dir, photos_dir))]
    else:
        args = [verb, "--config", str(write_config(tmp_path, tiny_flux_dir, photos_dir)), "--model.lora.rnak", "4"]
    lines = _error(capsys, args)
    assert len(lines) <= 3, lines
    assert "model.lora.rnak" in lines[0] and "did you mean model.lora.rank?" in lines[0], lines


@pytest.mark.parametrize(
    ("override", "flags", "expected"),
    [
        ({"dta": {"images": "x"}}, [], "dta.images: no such option; did you mean data.images?"),
        (
            {"model.optimizer.init_args": {"lrr": 0.01}},
            [],
            "model.optimizer.init_args.lrr: torch.optim.AdamW takes no option lrr; did you mean lr?",
        ),
        ({}, ["--model.optimizer.lrr", "0.1"], "model.optimizer.init_args.lrr: torch.optim.AdamW takes no option lrr"),
    ],
)
def test_a_typo_in_a_section_or_a_class_option(
    tmp_path: Path,
    tiny_flux_dir: Path,
    photos_dir: Path,
    capsys: pytest.CaptureFixture[str],
    override: dict,
    flags: list[str],
    expected: str,
) -> None:
    config = write_config(tmp_path, tiny_flux_dir, photos_dir, **override)
    (line,) = _error(capsys, ["fit", "--config", str(config), *flags])
    assert line.startswith(f"lightning-lora: error: {expected}"), line


@pytest.mark.parametrize(
    ("option", "value", "expected"),
    [
        ("--model.lora.rank", "abc", "model.lora.rank: 'abc' is not an int."),
        ("--data.resolution", "big", "data.resolution: 'big' is not an int or a list of ints."),
        ("--model.lora.variant", "lorra", "model.lora.variant: 'lorra' is not one of lora, dora, lokr, loha; did you"),
    ],
)
def test_a_value_of_the_wrong_type_is_one_line(
    tmp_path: Path,
    tiny_flux_dir: Path,
    photos_dir: Path,
    capsys: pytest.CaptureFixture[str],
    option: str,
    value: str,
    expected: str,
) -> None:
    config = write_config(tmp_path, tiny_flux_dir, photos_dir)
    lines = _error(capsys, ["fit", "--config", str(config), option, value])
    assert len(lines) == 1 and lines[0].startswith(f"lightning-lora: error: {expected}"), lines


def test_a_missing_option_and_a_refused_one_are_one_line(
    tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (line,) = _error(capsys, ["fit"])
    assert "model.pretrained and data.images are required" in line and "--config" in line, line
    config = str(write_config(tmp_path, tiny_flux_dir, photos_dir))
    (line,) = _error(capsys, ["fit", "--config", config, "--trainer.fast_dev_run", "true"])
    assert line.startswith("lightning-lora: error: trainer.fast_dev_run: true:") and "--trainer.max_steps" in line
    (line,) = _error(capsys, ["fit", "--config", config, "--weights_only", "false"])
    assert "--weights_only false: lightning-lora reads checkpoints as data only" in line
    assert not (tmp_path / "run").exists()  # refused before anything is written


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--config", "x.yaml"], "lightning-lora: error: --config: a command comes first, then its options"),
        (["export"], "lightning-lora export: error: the following arguments are required: checkpoint, --format"),
        (["export", "x.ckpt", "--fromat", "kohya", "--out", "y"], "--fromat: no such option; did you mean --format?"),
        (["export", "x.ckpt", "--format", "comfy", "--out", "y"], "argument --format: invalid choice: 'comfy'"),
        (["plan", "--vram", "lots"], "lightning-lora plan: error: argument --vram: 'lots' is not a size in GiB"),
        (["plan", "--bogus"], "lightning-lora plan: error: bogus: no such option (lightning-lora fit --help"),
    ],
)
def test_the_verbs_own_options_are_one_line(capsys: pytest.CaptureFixture[str], args: list[str], expected: str) -> None:
    """argparse printed its usage (4 lines for export) before the error, and said a required option was missing
    where the option was misspelt; no match, no "did you mean"."""
    (line,) = _error(capsys, args)
    assert expected in line, line


def test_a_typo_of_plans_own_option(
    tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write_config(tmp_path, tiny_flux_dir, photos_dir)
    (line,) = _error(capsys, ["plan", "--config", str(config), "--vrm", "24"])
    assert (
        line == "lightning-lora plan: error: --vrm: no such option; did you mean --vram? (lightning-lora plan --help)."
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (None, "no such file ("),
        ("model:\n  lora: {rank: 4\n", "not valid YAML at line 3, column 1: expected ',' or '}'"),
        ("model:\n  lora:\n    rank: 4\n   alpha: 3\n", "not valid YAML at line 4, column 4: expected <block end>"),
        ("model:\n\tlora: 3\n", "not valid YAML at line 2, column 1: found character '\\t'"),
        ("- model\n- data\n", "the file holds a list, not a config"),
        ("", "the file holds nothing, not a config"),
    ],
)
@pytest.mark.parametrize("verb", ["fit", "plan"])
def test_a_config_file_the_parser_cannot_read_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str | None, expected: str, verb: str
) -> None:
    """The parser said ``Parser key "config": File does not exist`` or ``Problems parsing config: ... in "<unicode
    string>"``: not which file, nor where in it."""
    config = tmp_path / "my.yaml"
    if text is not None:
        config.write_text(text)
    lines = _error(capsys, [verb, "--config", str(config)])
    assert len(lines) == 1 and lines[0].startswith(f"lightning-lora{' plan' if verb == 'plan' else ''}: error: "), lines
    assert f"--config {config}: {expected}" in lines[0], lines


def test_a_config_given_inline_is_still_read(capsys: pytest.CaptureFixture[str]) -> None:
    """A ``--config`` value that is not a file but a config (jsonargparse takes those) reaches the parser."""
    (line,) = _error(capsys, ["fit", "--config", "{trainer: {max_steps: 3}}"])
    assert "model.pretrained and data.images are required" in line, line


@pytest.mark.parametrize("name", ["flux_4090.yaml", "sdxl_12gb.yaml", "tiny_cpu.yaml"])
def test_print_config_skip_default(capsys: pytest.CaptureFixture[str], name: str) -> None:
    """jsonargparse built a parser of AdamW8bit's whole signature to find its defaults, and its ``params`` has no
    type: a traceback for every shipped config with the 8-bit optimizer."""
    config = REPO / "configs" / name
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(config), "--print_config=skip_default"])
    assert exit_info.value.code in (0, None)
    printed = yaml.safe_load(capsys.readouterr().out)
    written = yaml.safe_load(config.read_text())
    assert printed["model"]["optimizer"]["class_path"] == written["model"]["optimizer"]["class_path"]
    assert printed["model"]["optimizer"]["init_args"]["lr"] == written["model"]["optimizer"]["init_args"]["lr"]
    assert "trainer" in printed and "max_steps" in printed["trainer"]
    assert "enable_checkpointing" not in printed["trainer"]  # a default, left out
