"""The ``lightning-lora export`` command: a training checkpoint to a LoRA file in each format the run's family
writes, without loading the base model; the file is the one the run exported itself, it never replaces a file
silently, and bad input is one clear line.

The layouts themselves (and their witnesses) are tested in tests/formats/test_kohya.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import FluxPipeline
from helpers import denoiser_output, diffusers_kohya_reads_flux_widths, random_inputs, run_cli, write_config
from safetensors.torch import load_file

from lightning_lora.cli.export import main as export_main
from lightning_lora.export import checkpoint_lora, read_metadata
from lightning_lora.families.flux import Flux
from lightning_lora.lora import LoraOptions


def _loaded(model_dir: Path, lora_file: Path) -> torch.nn.Module:
    """The transformer of a fresh FluxPipeline from ``model_dir`` with ``lora_file`` loaded by diffusers."""
    pipe = FluxPipeline.from_pretrained(model_dir)
    pipe.load_lora_weights(lora_file)
    return pipe.transformer


@pytest.fixture(scope="module")
def checkpoint(tiny_flux_dir: Path, photos_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny 2-step fit's last.ckpt (the LoraExport callback also wrote run/lora/lora.safetensors)."""
    tmp = tmp_path_factory.mktemp("fit")
    callbacks = [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": {"save_last": True}}]
    config = write_config(tmp, tiny_flux_dir, photos_dir, **{"trainer.max_steps": 2, "trainer.callbacks": callbacks})
    run_cli(["fit", "--config", str(config)])
    return tmp / "run" / "checkpoints" / "last.ckpt"


def test_checkpoint_lora_reads_only_the_lora(checkpoint: Path) -> None:
    state, lora, family, info = checkpoint_lora(checkpoint)
    assert state and all(k.endswith((".lora_A.weight", ".lora_B.weight")) and ".default" not in k for k in state)
    assert lora == LoraOptions(rank=4, alpha=8.0, targets="attention", dropout=0.0, init="gaussian")
    assert isinstance(family, Flux) and family.max_sequence_length == 16  # built with the run's family options
    assert info["family"] == "flux" and info["steps"] == 2 and info["checkpoint"] == "last.ckpt"
    # The same tensors the training run exported at its end (lora_B with the scale alpha / rank = 2 folded in).
    trained = load_file(checkpoint.parent.parent / "lora" / "lora.safetensors")
    assert {f"transformer.{k}" for k in state} == set(trained)
    assert all(torch.equal(trained[f"transformer.{k}"], v * (2 if ".lora_B." in k else 1)) for k, v in state.items())
    # A run writes every format of its family by default: the kohya file is there too.
    assert (checkpoint.parent.parent / "lora" / "lora.kohya.safetensors").is_file()


def test_export_command_both_formats(
    tiny_flux_dir: Path, checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    out = {fmt: tmp_path / f"lora_{fmt}.safetensors" for fmt in ("diffusers", "kohya")}
    for fmt, path in out.items():
        assert export_main([str(checkpoint), "--format", fmt, "--out", str(path)]) == 0
        assert str(path) in capsys.readouterr().out
    assert read_metadata(out["kohya"])["lightning_lora.checkpoint"] == "last.ckpt"
    trained = _loaded(tiny_flux_dir, checkpoint.parent.parent / "lora" / "lora.safetensors")
    inputs = random_inputs(Flux(), trained, 1)
    diffusers_kohya_reads_flux_widths(monkeypatch)
    for path in out.values():
        torch.testing.assert_close(
            denoiser_output(_loaded(tiny_flux_dir, path), inputs),
            denoiser_output(trained, inputs),
            atol=1e-5,
            rtol=1e-5,
        )

    assert (
        export_main(
            [str(checkpoint), "--format", "kohya", "--out", str(tmp_path / "half.safetensors"), "--dtype", "bf16"]
        )
        == 0
    )
    half = load_file(tmp_path / "half.safetensors")
    assert {v.dtype for k, v in half.items() if not k.endswith(".alpha")} == {torch.bfloat16}
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "half.safetensors",
        "lora_diffusers.safetensors",
        "lora_kohya.safetensors",
    ]


def test_export_command_converts_files_made_elsewhere(
    tiny_flux_dir: Path, checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """A kohya file (the run's) converted to diffusers, and that back to kohya, load in diffusers with the trained
    output; the command says which tools apply every layer of what it wrote, and refuses to overwrite its input."""
    run_kohya = checkpoint.parent.parent / "lora" / "lora.kohya.safetensors"
    trained = _loaded(tiny_flux_dir, checkpoint.parent.parent / "lora" / "lora.safetensors")
    inputs = random_inputs(Flux(), trained, 1)
    diffusers_kohya_reads_flux_widths(monkeypatch)
    as_diffusers, as_kohya = tmp_path / "converted.safetensors", tmp_path / "back.kohya.safetensors"
    assert export_main([str(run_kohya), "--format", "diffusers", "--out", str(as_diffusers)]) == 0
    out = capsys.readouterr().out
    assert str(as_diffusers) in out and "applies every layer as trained in: diffusers, ComfyUI" in out
    assert export_main([str(as_diffusers), "--format", "kohya", "--out", str(as_kohya), "--family", "flux"]) == 0
    assert "applies every layer as trained in: diffusers, ComfyUI, kohya's sd-scripts" in capsys.readouterr().out
    for path in (as_diffusers, as_kohya):
        torch.testing.assert_close(
            denoiser_output(_loaded(tiny_flux_dir, path), inputs),
            denoiser_output(trained, inputs),
            atol=1e-5,
            rtol=1e-5,
        )
    meta = read_metadata(as_kohya)
    assert meta["lightning_lora.converted_from"] == "converted.safetensors" and meta["ss_network_dim"] == "4"
    assert export_main([str(as_kohya), "--format", "kohya", "--out", str(as_kohya), "--overwrite"]) == 2
    assert "is the input file" in capsys.readouterr().err
    assert (
        export_main(
            [str(as_kohya), "--format", "diffusers", "--out", str(tmp_path / "x.safetensors"), "--family", "sdxl"]
        )
        == 2
    )
    assert "sdxl" in capsys.readouterr().err


def test_export_command_never_overwrites_silently(checkpoint: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "mine.safetensors"
    out.write_bytes(b"the user's own file")
    assert export_main([str(checkpoint), "--format", "kohya", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert str(out) in err and "--overwrite" in err and "Traceback" not in err
    assert out.read_bytes() == b"the user's own file"
    assert export_main([str(checkpoint), "--format", "kohya", "--out", str(out), "--overwrite"]) == 0
    assert "lora_unet_double_blocks_0_img_attn_qkv.alpha" in load_file(out)
    assert [p.name for p in tmp_path.iterdir()] == ["mine.safetensors"]


def test_export_command_bad_input(checkpoint: Path, tmp_path: Path, capsys) -> None:
    corrupt = tmp_path / "corrupt.ckpt"
    corrupt.write_bytes(checkpoint.read_bytes()[: checkpoint.stat().st_size // 2])
    out = tmp_path / "out.safetensors"
    cases = [
        ([str(corrupt), "--format", "kohya", "--out", str(out)], [str(corrupt), "truncated"]),
        (
            [str(tmp_path / "missing.ckpt"), "--format", "kohya", "--out", str(out)],
            ["missing.ckpt", "does not exist"],
        ),
        ([str(checkpoint), "--format", "kohya", "--out", str(tmp_path / "lora.pt")], ["lora.pt", ".safetensors"]),
        ([str(checkpoint), "--format", "comfy", "--out", str(out)], ["--format", "kohya"]),
    ]
    for argv, expected in cases:
        assert export_main(argv) == 2, argv
        err = capsys.readouterr().err
        assert all(e in err for e in expected), err
        assert "Traceback" not in err
    not_a_checkpoint = tmp_path / "plain.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(1)}}, not_a_checkpoint)
    assert export_main([str(not_a_checkpoint), "--format", "diffusers", "--out", str(out)]) == 2
    assert "not a training checkpoint" in capsys.readouterr().err
    no_lora = tmp_path / "no_lora.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(1)}, "loops": {}, "optimizer_states": []}, no_lora)
    assert export_main([str(no_lora), "--format", "diffusers", "--out", str(out)]) == 2
    assert "holds no LoRA tensors" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corrupt.ckpt", "no_lora.ckpt", "plain.ckpt"]


@pytest.mark.parametrize(
    ("error", "where", "expected"),
    [("EROFS", "folder", "read-only: choose another --out"), ("ENOSPC", "write", "disk is full")],
)
def test_an_output_that_cannot_be_written_is_one_line_and_leaves_nothing(
    checkpoint: Path, tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch, error: str, where: str, expected: str
) -> None:
    """A read-only folder (the temporary file cannot be made) or a full disk (part of the bytes land, then the write
    fails, naming no file): one line naming the --out file and the fix, exit status 2, and nothing left behind, not
    even the folder made for the file."""
    import errno
    import os
    import tempfile

    from lightning_lora import io

    code = getattr(errno, error)
    if where == "folder":

        def mkstemp(prefix: str = "", suffix: str = "", dir: str | None = None) -> tuple[int, str]:
            raise OSError(code, os.strerror(code), os.path.join(dir or ".", f"{prefix}abc{suffix}"))

        monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    else:

        def write_bytes(self: Path, data: bytes) -> int:
            with open(self, "wb") as f:
                f.write(data[: len(data) // 3])
            raise OSError(code, os.strerror(code))

        monkeypatch.setattr(io.Path, "write_bytes", write_bytes)
    out = tmp_path / "new" / "lora.safetensors"
    assert export_main([str(checkpoint), "--format", "kohya", "--out", str(out)]) == 2
    monkeypatch.undo()
    err = capsys.readouterr().err
    assert f"cannot write {out} (" in err and expected in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []
