"""Export: a LoRA saved by lightning-lora loads into a fresh diffusers FluxPipeline and reproduces the trained model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from diffusers import FluxPipeline
from helpers import build_model
from safetensors import safe_open

from lightning_lora.export import read_metadata, save_lora
from lightning_lora.families.base import ModelSource
from lightning_lora.families.flux import Flux, latent_image_ids
from lightning_lora.lora import LoraOptions

RANK, ALPHA = 4, 8.0


def _inputs(transformer: torch.nn.Module) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    cfg = transformer.config
    h = w = 8
    return {
        "hidden_states": torch.randn(1, (h // 2) * (w // 2), cfg.in_channels, generator=g),
        "encoder_hidden_states": torch.randn(1, 5, cfg.joint_attention_dim, generator=g),
        "pooled_projections": torch.randn(1, cfg.pooled_projection_dim, generator=g),
        "timestep": torch.tensor([0.6]),
        "guidance": torch.tensor([3.5]),
        "txt_ids": torch.zeros(5, 3),
        "img_ids": latent_image_ids(h, w),
    }


@torch.no_grad()
def _forward(transformer: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    return transformer(**inputs, return_dict=False)[0]


@pytest.fixture(scope="module")
def exported(
    tiny_flux_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, torch.Tensor, torch.nn.Module]:
    """A LoRA (rank 4, alpha 8, non-zero B) saved to a file, and the in-memory model's output on fixed inputs."""
    model = build_model(
        Flux(),
        ModelSource(str(tiny_flux_dir), dtype=torch.float32),
        LoraOptions(rank=RANK, alpha=ALPHA, targets="all_linear"),
    ).eval()
    g = torch.Generator().manual_seed(42)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    path = tmp_path_factory.mktemp("export") / "lora.safetensors"
    save_lora(
        model,
        path,
        family=Flux(),
        lora=LoraOptions(rank=RANK, alpha=ALPHA, targets="all_linear"),
        info={"family": "flux", "base_model": str(tiny_flux_dir), "steps": 7},
    )
    return path, _forward(model, _inputs(model)), model


def test_lora_loads_into_a_fresh_diffusers_pipeline(
    tiny_flux_dir: Path, exported: tuple[Path, torch.Tensor, torch.nn.Module]
) -> None:
    path, expected, _ = exported
    pipe = FluxPipeline.from_pretrained(tiny_flux_dir)
    inputs = _inputs(pipe.transformer)
    base = _forward(pipe.transformer, inputs)
    pipe.load_lora_weights(path)
    loaded = _forward(pipe.transformer, inputs)
    torch.testing.assert_close(loaded, expected, atol=1e-5, rtol=1e-5)
    # The LoRA changes the output by much more than the tolerance: a wrong alpha/rank scale would be caught.
    assert (expected - base).abs().max() > 1e-2


def test_lora_file_keys(exported: tuple[Path, torch.Tensor, torch.nn.Module]) -> None:
    path, _, model = exported
    with safe_open(str(path), framework="pt") as f:
        keys = list(f.keys())
        tensors = {k: f.get_tensor(k) for k in keys}
    assert keys and all(k.startswith("transformer.") for k in keys)
    assert all((".lora_A." in k) != (".lora_B." in k) for k in keys)
    assert all(k.endswith(".weight") for k in keys)
    # One A and one B per wrapped layer, with the right shapes, equal to the model's tensors.
    wrapped = {n: m for n, m in model.named_modules() if hasattr(m, "base_layer") and hasattr(m, "lora_A")}
    assert len(keys) == 2 * len(wrapped)
    for name, layer in wrapped.items():
        a, b = tensors[f"transformer.{name}.lora_A.weight"], tensors[f"transformer.{name}.lora_B.weight"]
        assert a.shape == (RANK, layer.base_layer.in_features) and b.shape == (layer.base_layer.out_features, RANK)
        # The scale alpha / rank (8 / 4) is folded into lora_B: ComfyUI, which reads these keys for FLUX but not the
        # config, applies the trained strength too.
        assert torch.equal(b, layer.lora_B["default"].weight * (ALPHA / RANK))
        assert a.dtype == torch.float32


def test_lora_file_metadata(tiny_flux_dir: Path, exported: tuple[Path, torch.Tensor, torch.nn.Module]) -> None:
    path, _, _ = exported
    meta = read_metadata(path)
    assert meta["lightning_lora.rank"] == str(RANK)
    assert float(meta["lightning_lora.alpha"]) == ALPHA
    assert meta["lightning_lora.family"] == "flux"
    assert meta["lightning_lora.base_model"] == str(tiny_flux_dir)
    assert json.loads(meta["lightning_lora.steps"]) == 7
    assert meta["lightning_lora.format"] == "diffusers"
    adapter = json.loads(meta["lora_adapter_metadata"])
    assert adapter["transformer.r"] == RANK
    assert adapter["transformer.lora_alpha"] == RANK  # scale 1 on the folded weights (see test_lora_file_keys)
    assert meta["modelspec.architecture"] == "flux-1-dev/lora" and meta["modelspec.title"] == "lora"
    assert all(k.startswith("transformer.") for k in adapter)


def test_save_lora_bf16_file(tmp_path: Path, exported: tuple[Path, torch.Tensor, torch.nn.Module]) -> None:
    path32, _, model = exported
    lora = LoraOptions(rank=RANK, alpha=ALPHA, targets="all_linear")
    path16 = save_lora(model, tmp_path / "lora16.safetensors", family=Flux(), lora=lora, info={}, dtype=torch.bfloat16)
    with safe_open(str(path16), framework="pt") as f16, safe_open(str(path32), framework="pt") as f32:
        assert set(f16.keys()) == set(f32.keys())
        for k in f16.keys():
            t16 = f16.get_tensor(k)
            assert t16.dtype == torch.bfloat16
            torch.testing.assert_close(t16.float(), f32.get_tensor(k), atol=1e-2, rtol=1e-2)
    assert path16.stat().st_size < path32.stat().st_size
    assert list(tmp_path.iterdir()) == [path16]  # atomic write: no temp file left
