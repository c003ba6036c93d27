"""What the machine lacks, said in one line with the fix (exit status 2): a GPU for a GPU config, a local model folder,
a hub model that cannot be downloaded (offline, no network, gated). In-process; no network is ever touched
(HF_HUB_OFFLINE is set for the session)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import write_config

from lightning_lora.cli import main
from lightning_lora.families.base import ModelSource, looks_local, source_problem


def _error(capsys: pytest.CaptureFixture[str], args: list[str]) -> str:
    """The one line the command printed (on stderr, nothing on stdout), after checking it stopped with status 2."""
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    captured = capsys.readouterr()
    assert exit_info.value.code == 2, captured
    assert not captured.out.strip(), captured.out  # no library line before the error
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a GPU")
def test_a_gpu_config_without_a_gpu(
    tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Lightning ended this in a 41-line traceback (MisconfigurationException: No supported gpu backend found!)."""
    config = write_config(tmp_path, tiny_flux_dir, photos_dir, **{"trainer.accelerator": "gpu"})
    line = _error(capsys, ["fit", "--config", str(config)])
    assert line.startswith("lightning-lora: error: trainer.accelerator: gpu, but this machine has no GPU"), line
    assert "--trainer.accelerator cpu" in line and "lightning-lora plan" in line


def test_a_missing_local_model_folder_is_called_a_folder(
    tmp_path: Path, photos_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    config = write_config(tmp_path, tmp_path, photos_dir, **{"model.pretrained": "models/flux-dev"})
    line = _error(capsys, ["cache", "--config", str(config)])
    assert line.startswith("lightning-lora cache: error: model.pretrained: folder models/flux-dev does not exist"), line
    assert "hub" not in line.split("Check the path")[0] and "download" not in line


def test_the_demo_config_before_the_demo(
    tmp_path: Path, photos_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """configs/tiny_cpu.yaml run before make demo wrote its model: the line says what writes it."""
    monkeypatch.chdir(tmp_path)
    config = write_config(tmp_path, tmp_path, photos_dir, **{"model.pretrained": ".demo/tiny-flux"})
    line = _error(capsys, ["plan", "--config", str(config)])
    assert "model.pretrained: folder .demo/tiny-flux does not exist" in line, line
    assert "written by make demo (or python -m lightning_lora.cli.demo)" in line


def test_a_hub_model_offline_says_how_to_get_it(
    tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The hub id is not in the local cache and HF_HUB_OFFLINE is set: the line says so, how to download it and that a
    gated model needs a login; huggingface_hub's warnings (two UserWarning lines) are not printed before it."""
    config = write_config(tmp_path, tiny_flux_dir, photos_dir, **{"model.pretrained": "black-forest-labs/FLUX.1-dev"})
    line = _error(capsys, ["cache", "--config", str(config)])
    assert "black-forest-labs/FLUX.1-dev is not in the local Hugging Face cache, and the hub is offline" in line
    assert "HF_HUB_OFFLINE" in line
    assert "hf download black-forest-labs/FLUX.1-dev" in line and "hf auth login" in line, line
    assert "huggingface-cli" not in line


def _raised_from(cause: BaseException) -> OSError:
    """An OSError raised while handling ``cause``, as diffusers' and transformers' loaders raise theirs."""
    error = OSError("model does not appear to have a file named config.json.")
    error.__context__ = cause
    return error


def test_a_hub_model_that_cannot_be_downloaded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Gated, or the network down (HF_HUB_OFFLINE not set): each says what to do."""
    import lightning_lora.families.source as model_source

    class GatedRepoError(Exception):  # huggingface_hub.errors' name; its constructor needs an HTTP response
        pass

    source = ModelSource("black-forest-labs/FLUX.1-dev")
    gated = source_problem(source, "vae", _raised_from(GatedRepoError("401 Client Error")))
    assert "is a gated model" in gated and "hf auth login" in gated and "huggingface.co/black-forest-labs" in gated
    monkeypatch.setattr(model_source, "_hub_offline", lambda: None)
    down = source_problem(source, "vae", _raised_from(ConnectionError("[Errno -2] Name or service not known")))
    assert "the hub could not be reached (no network?)" in down and "hf download black-forest-labs/FLUX.1-dev" in down


def test_offline_names_the_variable_that_is_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """huggingface_hub also stays offline for TRANSFORMERS_OFFLINE alone: the line names that one to unset."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    line = source_problem(ModelSource("black-forest-labs/FLUX.1-dev"), "vae", OSError("not in the cache"))
    assert "the hub is offline (TRANSFORMERS_OFFLINE set" in line and "unset TRANSFORMERS_OFFLINE" in line, line
    assert "HF_HUB_OFFLINE" not in line


def test_a_local_path_is_told_from_a_hub_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    for path in ("/data/models/flux", "./flux", "../flux", "~/flux", "a/b/c", "models/flux-dev"):
        assert looks_local(path) == (path != "models/flux-dev"), path
    (tmp_path / "models").mkdir()
    assert looks_local("models/flux-dev")  # beside a models/ folder: a path, not the hub's "models" user
    assert not looks_local("black-forest-labs/FLUX.1-dev")
