"""diffusers <-> BFL FLUX layout, checked against diffusers' own single-file loader."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import FluxTransformer2DModel
from helpers import allow_any_flux_width
from safetensors.torch import save_file

from lightning_lora.formats.bfl import (
    BFL_PREFIX_COMFY,
    FluxDims,
    bfl_slice,
    bfl_to_diffusers,
    diffusers_to_bfl,
    flux_dims_from_config,
    flux_dims_from_state_dict,
)
from lightning_lora.tiny.flux import build_tiny_flux, save_tiny_flux


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)


def _forward(model: FluxTransformer2DModel) -> torch.Tensor:
    cfg = model.config
    g = torch.Generator().manual_seed(0)
    tokens, text = 16, 8
    with torch.no_grad():
        return model(
            hidden_states=torch.randn(1, tokens, cfg.in_channels, generator=g),
            encoder_hidden_states=torch.randn(1, text, cfg.joint_attention_dim, generator=g),
            pooled_projections=torch.randn(1, cfg.pooled_projection_dim, generator=g),
            timestep=torch.tensor([0.7]),
            guidance=torch.tensor([3.5]) if cfg.guidance_embeds else None,
            img_ids=torch.stack([torch.zeros(tokens), torch.arange(tokens) // 4, torch.arange(tokens) % 4], 1),
            txt_ids=torch.zeros(text, 3),
            return_dict=False,
        )[0]


@pytest.mark.parametrize("dim64", [False, True])
def test_from_single_file_round_trip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dim64: bool) -> None:
    folder = save_tiny_flux(tmp_path / "pipe", dim64=dim64)
    transformer = build_tiny_flux(dim64=dim64).transformer
    state = transformer.state_dict()
    dims = flux_dims_from_config(transformer.config)
    assert dims == flux_dims_from_state_dict(state)

    bfl = diffusers_to_bfl(state)
    assert flux_dims_from_state_dict(bfl) == dims
    path = tmp_path / "flux1-tiny.safetensors"
    save_file(bfl, path)

    with monkeypatch.context() as patch:
        allow_any_flux_width(patch, dims)
        loaded = FluxTransformer2DModel.from_single_file(
            str(path), config=str(folder), subfolder="transformer", local_files_only=True
        )
    loaded_state = loaded.state_dict()
    assert set(loaded_state) == set(state)
    for key, value in state.items():
        assert torch.equal(loaded_state[key], value), key
    assert torch.equal(_forward(loaded.eval()), _forward(transformer))

    # Our own inverse gives back the same tensors, with or without ComfyUI's prefix.
    for source in (bfl, diffusers_to_bfl(state, prefix=BFL_PREFIX_COMFY)):
        back = bfl_to_diffusers(source)
        assert set(back) == set(state)
        assert all(torch.equal(back[key], value) for key, value in state.items())


def test_bfl_key_set_looks_like_flux1() -> None:
    bfl = diffusers_to_bfl(build_tiny_flux().transformer.state_dict())
    assert len(bfl) == 20 + 2 * 24 + 2 * 8  # globals, 2 double blocks, 2 single blocks
    for key in (
        "img_in.weight",
        "txt_in.bias",
        "time_in.in_layer.weight",
        "time_in.out_layer.bias",
        "vector_in.in_layer.weight",
        "guidance_in.out_layer.weight",
        "double_blocks.0.img_attn.qkv.weight",
        "double_blocks.1.txt_attn.qkv.bias",
        "double_blocks.0.img_attn.norm.query_norm.scale",
        "double_blocks.0.txt_attn.norm.key_norm.scale",
        "double_blocks.0.img_attn.proj.weight",
        "double_blocks.0.img_mod.lin.weight",
        "double_blocks.0.txt_mlp.2.weight",
        "single_blocks.0.linear1.weight",
        "single_blocks.1.linear2.bias",
        "single_blocks.0.modulation.lin.weight",
        "single_blocks.0.norm.query_norm.scale",
        "final_layer.linear.weight",
        "final_layer.adaLN_modulation.1.weight",
        "final_layer.adaLN_modulation.1.bias",
    ):
        assert key in bfl, key
    assert not any(k.startswith(("transformer_blocks", "single_transformer_blocks", "x_embedder")) for k in bfl)
    inner = 32
    assert bfl["double_blocks.0.img_attn.qkv.weight"].shape == (3 * inner, inner)
    assert bfl["single_blocks.0.linear1.weight"].shape == (3 * inner + 4 * inner, inner)


def test_slices_for_lora_export() -> None:
    dims = FluxDims(inner_dim=3072, mlp_hidden_dim=12288)
    k = bfl_slice("transformer_blocks.3.attn.to_k", dims)
    assert (k.module, k.start, k.size, k.total, k.fused) == ("double_blocks.3.img_attn.qkv", 3072, 3072, 9216, True)
    assert bfl_slice("transformer_blocks.0.attn.add_v_proj", dims).module == "double_blocks.0.txt_attn.qkv"
    mlp = bfl_slice("single_transformer_blocks.37.proj_mlp", dims)
    assert (mlp.module, mlp.start, mlp.size, mlp.total) == ("single_blocks.37.linear1", 9216, 12288, 21504)
    out = bfl_slice("transformer_blocks.0.attn.to_out.0", dims)
    assert (out.module, out.fused, out.swap) == ("double_blocks.0.img_attn.proj", False, False)
    assert bfl_slice("norm_out.linear", dims).swap
    norm = bfl_slice("single_transformer_blocks.2.attn.norm_k", dims)
    assert norm.param("weight") == "single_blocks.2.norm.key_norm.scale"
    with pytest.raises(KeyError):
        bfl_slice("transformer_blocks.0.attn.to_q.lora_A", dims)

    # The final modulation really is swapped: BFL's first half is diffusers' second half.
    state = build_tiny_flux().transformer.state_dict()
    bfl = diffusers_to_bfl(state)
    half = state["norm_out.linear.weight"].shape[0] // 2
    assert torch.equal(bfl["final_layer.adaLN_modulation.1.weight"][:half], state["norm_out.linear.weight"][half:])
    # A missing part of a fused tensor is an error, not a silently short tensor.
    del state["transformer_blocks.0.attn.to_v.weight"]
    with pytest.raises(ValueError, match="img_attn.qkv.weight"):
        diffusers_to_bfl(state)
