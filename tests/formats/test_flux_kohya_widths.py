"""Where a FLUX kohya file loads depends on its widths: diffusers' kohya converter splits the single blocks' fused
``linear1`` at FLUX.1's widths (3072, MLP 12288) and refuses any other file, so the demo's tiny model's kohya file was
said to load in diffusers and did not (``export demo-lora.kohya.safetensors --format diffusers`` failed)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_lora.export import convert_lora_file, file_coverage, write_lora
from lightning_lora.families import Flux

RANK = 2


def _single_block_lora(inner: int, mlp: int) -> dict[str, torch.Tensor]:
    """A peft state of q, k, v and the MLP input of single block 0 (they fuse into ``linear1``) at these widths."""
    state = {}
    for module, rows in (("attn.to_q", inner), ("attn.to_k", inner), ("attn.to_v", inner), ("proj_mlp", mlp)):
        state[f"single_transformer_blocks.0.{module}.lora_A.weight"] = torch.ones(RANK, inner)
        state[f"single_transformer_blocks.0.{module}.lora_B.weight"] = torch.ones(rows, RANK)
    return state


@pytest.mark.parametrize(("inner", "mlp", "in_diffusers"), [(3072, 12288, True), (64, 256, False)])
def test_a_kohya_file_loads_in_diffusers_at_flux1_widths_only(inner: int, mlp: int, in_diffusers: bool) -> None:
    state = _single_block_lora(inner, mlp)
    kohya = file_coverage(state, Flux(), "kohya")
    assert ("diffusers" in kohya.loads_in) == in_diffusers and "ComfyUI" in kohya.loads_in
    if not in_diffusers:
        (note,) = [line for line in kohya.notes("demo.kohya.safetensors") if line.startswith("diffusers")]
        assert "does not load 4 layer(s)" in note and "FLUX.1's widths (3072, 12288)" in note and "(64, 256)" in note
    assert "diffusers" in file_coverage(state, Flux(), "diffusers").loads_in  # its own layout: any width


def test_converting_such_a_file_says_what_to_use_instead(tmp_path: Path) -> None:
    """The demo's kohya file given to ``export --format diffusers``: diffusers' converter cannot read it (its widths),
    and the line says so from the file's own header and names what to convert instead."""
    kohya = write_lora(
        _single_block_lora(64, 256),
        tmp_path / "demo.kohya.safetensors",
        format="kohya",
        family=Flux(),
        scale=1.0,
        rank=RANK,
        alpha=RANK,
        info={},
    )
    with pytest.raises(ValueError, match="diffusers' converter could not read it") as error:
        convert_lora_file(kohya, tmp_path / "demo.diffusers.safetensors", format="diffusers", family=Flux())
    assert "loads in ComfyUI, kohya's sd-scripts, not diffusers: convert the run's checkpoint" in str(error.value)
    assert not (tmp_path / "demo.diffusers.safetensors").exists()
