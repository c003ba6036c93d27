"""tools/flop_floor.py: the FLOPs of one LoRA training step, counted on the meta device, are the FLOPs a real step
computes, with attention counted as the fused GPU kernels run it and no weight gradients for the frozen base."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import REPO, random_inputs
from torch import nn

from lightning_lora.families.base import DiffusionFamily, ModelSource
from lightning_lora.lora import LoraOptions

sys.path.insert(0, str(REPO / "tools"))

import flop_floor  # noqa: E402

LORA = LoraOptions(rank=4)


def _model(family: str) -> flop_floor.Model:
    return flop_floor.chosen(family, None)[0]


def test_a_linear_layer_costs_two_flops_per_multiply_add_and_a_frozen_one_no_weight_gradient() -> None:
    tokens, sizes = 2 * 10, [(32, 64), (64, 16)]
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16)).to("meta")
    x = torch.empty(2, 10, 32, device="meta", requires_grad=True)
    forward = sum(2 * i * o * tokens for i, o in sizes)

    frozen = flop_floor.count_step(model.requires_grad_(False), {"input": x})
    assert (frozen.forward, frozen.backward) == (forward, forward)  # the input gradient only: x @ W^T back
    with pytest.raises(ValueError, match="nothing to differentiate"):
        flop_floor.count_step(model, {"input": x.detach()})
    model.requires_grad_(True)  # a trained base: the weight gradients double the backward
    trained = flop_floor.count_step(model, {"input": x})
    assert (trained.forward, trained.backward) == (forward, 2 * forward)
    assert trained.attention_forward == trained.attention_backward == 0


class _Attention(nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options: object) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, **options)  # type: ignore[arg-type]


@pytest.mark.parametrize("device", ["meta", "cpu"])
@pytest.mark.parametrize("case", ["plain", "bool mask", "float mask", "gqa"])
def test_attention_is_counted_once_as_the_fused_kernels_compute_it(device: str, case: str) -> None:
    """Forward: QK^T and PV, 4 B H Sq Sk D; backward 2.5x (the scores again, dV, dP, dQ, dK), on any device. Left to
    itself PyTorch runs the math backend on meta (backward 2x) and a CPU kernel the counter does not know (0)."""
    b, h, sq, sk, d = 2, 4, 24, 40, 16
    kv_heads = 2 if case == "gqa" else h

    def t(heads: int, s: int) -> torch.Tensor:
        return torch.randn(b, heads, s, d, device=device, requires_grad=True)

    options: dict[str, object] = {}
    if case == "bool mask":
        options["attn_mask"] = torch.rand(b, 1, 1, sk, device=device) > 0.2
    if case == "float mask":
        options["attn_mask"] = torch.zeros(b, 1, sq, sk, device=device)
    if case == "gqa":
        options["enable_gqa"] = True
    original = F.scaled_dot_product_attention
    flops = flop_floor.count_step(_Attention(), {"q": t(h, sq), "k": t(kv_heads, sk), "v": t(kv_heads, sk), **options})
    assert F.scaled_dot_product_attention is original
    assert flops.forward == flops.attention_forward == 4 * b * h * sq * sk * d
    assert flops.backward == flops.attention_backward == 10 * b * h * sq * sk * d


FAMILIES = ["flux", "sd15", "zimage", "qwenimage", "flux2"]  # sd15: the UNets (SDXL: the same code, slower)


@pytest.mark.parametrize("name", FAMILIES)
def test_the_meta_count_is_what_a_real_cpu_step_computes(name: str, tiny_pipeline: Callable[[str], Path]) -> None:
    """The tiny model of each family, LoRA on its attention: counted on shapes alone, and in a real forward and
    backward on the CPU with random weights and inputs."""
    family: DiffusionFamily = _model(name).build(16)
    source = ModelSource(str(tiny_pipeline(name)), dtype=torch.float32)
    size = (64, 96)
    counted, _ = flop_floor.training_step_flops(family, family.denoiser_skeleton(source), 2, *size, LORA)

    torch.manual_seed(0)
    model = flop_floor.adapt(family.load_denoiser(source), family, LORA)
    real = flop_floor.count_step(model, random_inputs(family, model, 2, size=size, text_len=family.text_tokens))
    assert counted == real
    assert counted.attention_forward > 0 and counted.backward > counted.attention_backward > 0


def test_a_frozen_base_backward_repeats_the_forward_matmuls_once(tiny_flux_dir: Path) -> None:
    """No adapter and every input requiring grad: each linear layer's backward is its input gradient, one matmul of
    its forward's size, so outside attention the backward equals the forward."""
    family = _model("flux").build(16)
    source = ModelSource(str(tiny_flux_dir), dtype=torch.float32)
    base, _ = flop_floor.training_step_flops(family, family.denoiser_skeleton(source), 1, 128, 128, None)
    assert base.backward - base.attention_backward == base.forward - base.attention_forward
    assert base.attention_backward * 2 == base.attention_forward * 5
    lora, _ = flop_floor.training_step_flops(family, family.denoiser_skeleton(source), 1, 128, 128, LORA)
    assert lora.forward > base.forward and lora.attention_forward == base.attention_forward


def test_flux_matches_the_hand_count(tiny_flux_dir: Path) -> None:
    """FLUX's blocks, double- or single-stream, multiply each token by 12 D^2 weights (q, k, v, out: 4 D^2; the MLP or
    the single block's fused projections: 8 D^2); a double block's image and text streams each see only their own
    tokens, and the modulation layers one vector per sample. So the forward is 2 * 12 D^2 * S per block, plus
    4 S^2 D of attention, plus the image and text embedders and the output projection (per token)."""
    family = _model("flux").build(16)
    skeleton = family.denoiser_skeleton(ModelSource(str(tiny_flux_dir), dtype=torch.float32))
    c: Any = skeleton.config  # diffusers' FrozenDict
    dim, blocks = c.num_attention_heads * c.attention_head_dim, c.num_layers + c.num_single_layers
    image, text = (256 // 16) ** 2, 16
    tokens = image + text
    per_token = blocks * 2 * 12 * dim**2 * tokens + 2 * dim * (2 * c.in_channels * image + c.joint_attention_dim * text)
    flops, _ = flop_floor.training_step_flops(family, skeleton, 1, 256, 256, None)
    assert flops.attention_forward == blocks * 4 * tokens**2 * dim
    # Left out: the layers that see one vector per sample (modulation; time, guidance and pooled-text embedders), 0.4%
    # of this tiny model and 0.03% of FLUX.1-dev at 512x768.
    assert flops.forward - flops.attention_forward == pytest.approx(per_token, rel=5e-3)


def test_the_command_prints_one_json_line_per_model(tiny_flux_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--family", "flux", "--pretrained", str(tiny_flux_dir), "--h", "64", "--w", "64", "--tlen", "16"]
    flop_floor.main([*argv, "--tflops", "500"])
    (line,) = capsys.readouterr().out.splitlines()
    out = json.loads(line)
    assert out["text_tokens"] == 16 and out["shapes"]["hidden_states"] == [1, 16, 16]
    assert out["total_tflop"] == pytest.approx(out["forward_tflop"] + out["backward_tflop"], abs=0.011)
    assert out["floor_s"] == pytest.approx(out["total_tflop"] / 500, abs=1e-4)
    assert out["lora"].startswith("rank 16 attention")

    assert [(m.family, m.variant) for m in flop_floor.chosen("all", None)] == [
        ("flux", None),
        ("sdxl", None),
        ("sd15", None),
        ("zimage", None),
        ("qwenimage", None),
        ("flux2", "klein"),
        ("flux2", "dev"),
    ]
    assert [m.variant for m in flop_floor.chosen("flux2", None)] == ["klein"]
    assert [m.pretrained for m in flop_floor.chosen("flux2", "dev")] == ["black-forest-labs/FLUX.2-dev"]
    assert [m.variant for m in flop_floor.chosen("flux2", None, "black-forest-labs/FLUX.2-dev")] == ["dev"]
    assert [m.variant for m in flop_floor.chosen("flux2", None, "/a/local/folder")] == ["klein"]
    with pytest.raises(SystemExit, match="--variant: 'pro'"):
        flop_floor.chosen("flux2", "pro")
