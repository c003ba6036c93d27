"""The ``lightning-lora cache`` command: it builds the cache a fit then reads alone, says what it found and did,
and an interrupted build keeps what it wrote and continues where it stopped."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from helpers import run_cli, write_config

from lightning_lora.cli.cache import main as cache_main
from lightning_lora.families.flux import Flux


def test_cache_verb_then_fit_reads_only_the_cache(
    tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path, capsys, monkeypatch
) -> None:
    config = write_config(tmp_path, tiny_flux_dir, photos_dir)
    data = yaml.safe_load(config.read_text())
    data["data"].update(
        {
            "images": [{"path": str(photos_dir), "repeats": 2}],
            "resolution": [32, 16],
            "random_flip": True,
            "cache_workers": 0,
        }
    )
    config.write_text(yaml.safe_dump(data))
    assert cache_main(["--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert "images found:    4" in out and "latents:         16 encoded, 0 reused" in out and "buckets:" in out
    assert cache_main(["--config", str(config), "--data.random_flip", "false"]) == 0
    assert "latents:         0 encoded, 8 reused" in capsys.readouterr().out
    assert not (tmp_path / "run").exists()  # building the cache writes nothing into the run folder
    assert "samples per epoch" in out
    # Training reads only the cache: no VAE and no text encoder is loaded by fit (sample images, which would load
    # them, are switched off here).
    monkeypatch.setattr(Flux, "load_vae", lambda *a: pytest.fail("fit loaded the VAE"))
    monkeypatch.setattr(Flux, "load_text_encoders", lambda *a: pytest.fail("fit loaded the text encoders"))
    cli = run_cli(["fit", "--config", str(config), "--trainer.callbacks", "[]", "--trainer.max_steps", "2"])
    assert cli.trainer.global_step == 2
    monkeypatch.undo()
    capsys.readouterr()
    assert cache_main(["--config", str(config), "--data.images", str(tmp_path / "missing")]) == 2
    assert "data.images" in capsys.readouterr().err
    assert cache_main(["--help"]) == 0 and "lightning-lora cache --config" in capsys.readouterr().out


def test_ctrl_c_during_cache_keeps_what_was_written(
    tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C while `lightning-lora cache` encodes (with decoding worker processes running): exit 130, one message,
    the finished entries stay, and the same command continues."""
    config = write_config(tmp_path, tiny_flux_dir, photos_dir, **{"data.encode_batch_size": 1, "data.cache_workers": 2})
    encode = Flux.encode_images
    calls = []

    def interrupted(self, vae, pixels):
        calls.append(len(pixels))
        if len(calls) == 3:
            raise KeyboardInterrupt
        return encode(self, vae, pixels)

    monkeypatch.setattr(Flux, "encode_images", interrupted)
    assert cache_main(["--config", str(config)]) == 130
    err = capsys.readouterr().err
    assert "interrupted" in err and "run the same command again" in err and "Traceback" not in err, err
    monkeypatch.undo()
    assert len(list((tmp_path / "cache" / "latents").glob("*.safetensors"))) == 2
    assert not list((tmp_path / "cache").rglob("*.tmp"))
    assert cache_main(["--config", str(config)]) == 0
    assert "latents:         2 encoded, 2 reused" in capsys.readouterr().out


@pytest.mark.parametrize("where", ["flag", "file"])
def test_a_bad_folder_entry_names_the_field(
    tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path, capsys, where: str
) -> None:
    """``--data.images '[{path: x, repeats: many}]'`` was "folder '[{path: x, repeats: many}]' does not exist"; in a
    config file, a screen of usage and every type the parser tried."""
    entry = {"path": str(photos_dir), "repeats": "many"}
    config = write_config(tmp_path, tiny_flux_dir, photos_dir, **({"data.images": [entry]} if where == "file" else {}))
    flag = ["--data.images", f"[{{path: {photos_dir}, repeats: many}}]"] if where == "flag" else []
    assert cache_main(["--config", str(config), *flag]) == 2
    captured = capsys.readouterr()
    lines = [line for line in (captured.out + captured.err).splitlines() if line and "LightningCLI's args" not in line]
    assert lines == ["lightning-lora cache: error: data.images[0].repeats must be an integer (1 or more), got 'many'."]
    assert not (tmp_path / "cache").exists()
