"""What a new user reads first: ``lightning-lora --help`` (our verbs), ``--version``, ``fit --help`` (the options that
mean something here, with our texts, as plain text) and the verbs' own help, all in-process."""

from __future__ import annotations

import re

import pytest

import lightning_lora
from lightning_lora.cli import main
from lightning_lora.cli.help import HIDDEN, plain_text

REST = re.compile(r"``|:(mod|class|func|meth|attr|data|paramref|ref):`|`_")
"""reST markup a terminal would show as is."""


def _run(capsys: pytest.CaptureFixture[str], args: list[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    captured = capsys.readouterr()
    return int(exit_info.value.code or 0), captured.out, captured.err


def test_the_top_level_help_lists_our_verbs(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = _run(capsys, ["--help"])
    assert status == 0
    verbs = [line.split()[0] for line in out.split("commands:\n", 1)[1].split("\n\n", 1)[0].splitlines()]
    assert verbs == ["fit", "plan", "cache", "export"]
    assert "validate" not in out and "{fit," not in out, out
    assert "Lightning Trainer command line tool" not in out
    described = " ".join(str(lightning_lora.__doc__).split("\n\n")[0].split())  # the package's own first paragraph
    assert described.removeprefix("lightning-lora: a ") in " ".join(out.split()), out


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_lora import __version__

    assert _run(capsys, ["--version"])[:2] == (0, f"lightning-lora {__version__}\n")


@pytest.mark.parametrize("verb", ["validate", "test", "predict", "trian"])
def test_a_command_that_is_not_ours_is_one_line(capsys: pytest.CaptureFixture[str], verb: str) -> None:
    status, out, err = _run(capsys, [verb, "--config", "x.yaml"])
    assert status == 2 and not out
    assert len(err.strip().splitlines()) == 1 and err.startswith("lightning-lora: error: "), err
    assert verb in err and "fit" in err


def test_fit_help_shows_the_options_of_a_lora_run_in_plain_text(capsys: pytest.CaptureFixture[str]) -> None:
    """The Trainer options a LoRA run does not use are hidden, --ckpt_path says what ``last`` means here, and no help
    string shows reST. Lightning's own help of fit was 824 lines (44 options more, reST throughout)."""
    import transformers.optimization  # noqa: F401  # as lightning_lora.optimizers, another test or a config may

    status, out, _ = _run(capsys, ["fit", "--help"])
    assert status == 0
    for option in HIDDEN:
        assert f"--{option} " not in out and f"--{option}\n" not in out, option
    assert not REST.search(out), REST.search(out)
    text = " ".join(out.split())
    assert "'last' is the newest valid checkpoint in the run folder's checkpoints/" in text
    assert "or a fresh start if there is none" in text and "registry" not in text and "hpc" not in text
    for kept in ("--trainer.max_steps", "--trainer.accumulate_grad_batches", "--model.lora.rank", "--data.images"):
        assert kept in out
    assert "accelerate.optimizer" not in out  # only classes a config may name are listed
    # the same classes whatever was imported before (bitsandbytes' 40 optimizers were listed once it was imported)
    assert "lightning_lora.schedules.CosineWithWarmup" in out and "lightning_lora.optimizers.Adafactor" in out
    assert "transformers.Adafactor" not in out
    assert len(out.splitlines()) < 720  # 824 with Lightning's; our own options (preservation, EMA...) add lines


@pytest.mark.parametrize("verb", ["plan", "cache", "export"])
def test_the_other_verbs_help_is_plain_text(capsys: pytest.CaptureFixture[str], verb: str) -> None:
    status, out, _ = _run(capsys, [verb, "--help"])
    assert status == 0 and f"lightning-lora {verb}" in out
    assert not REST.search(out), REST.search(out)


def test_plain_text() -> None:
    assert plain_text("``last`` or :class:`~lightning_lora.callbacks.LoraExport`") == "last or LoraExport"
    assert plain_text(":mod:`lightning_lora.plan` and :ref:`the CLI docs <lightning-cli>`") == (
        "lightning_lora.plan and the CLI docs"
    )
    assert plain_text("see `the notes <https://x.org/a>`_ and **this**") == "see the notes (https://x.org/a) and this"


@pytest.mark.subprocess
def test_a_reader_that_goes_away_is_no_traceback() -> None:
    """``lightning-lora --help | head -1``: the reader closes the pipe before the help is written; a BrokenPipeError
    traceback was printed (exit status 1). Now: nothing on stderr, SIGPIPE's exit status."""
    import subprocess
    import sys

    command = [sys.executable, "-m", "lightning_lora", "--help"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert process.stdout is not None and process.stderr is not None
    process.stdout.close()  # before the interpreter has started: its first write finds no reader
    err = process.stderr.read()
    assert process.wait(timeout=60) == 141 and not err, err
