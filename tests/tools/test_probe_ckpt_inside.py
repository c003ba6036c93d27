"""tools/probe_ckpt_inside.py: every repeated block of a transformer checkpointed by wrapping its forward (so a compiled
block traces the checkpoint and recomputes inside its backward graph), with the gradients of diffusers' own
checkpointing."""

from __future__ import annotations

import copy
import sys

import torch
from helpers import REPO

sys.path.insert(0, str(REPO / "tools"))

import probe_ckpt_inside  # noqa: E402

from lightning_lora.assembly import apply_gradient_checkpointing  # noqa: E402
from lightning_lora.offload import repeated_blocks  # noqa: E402


def _tiny_flux() -> torch.nn.Module:
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=16,
        guidance_embeds=False,
        axes_dims_rope=(4, 6, 6),
    ).train()


def _grads(model: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    n, t = 64, 8
    out = model(
        hidden_states=torch.randn(1, n, 16, generator=g),
        encoder_hidden_states=torch.randn(1, t, 32, generator=g),
        pooled_projections=torch.randn(1, 16, generator=g),
        timestep=torch.tensor([0.5]),
        img_ids=torch.randn(n, 3, generator=g),
        txt_ids=torch.zeros(t, 3),
        return_dict=False,
    )[0]
    loss = out.float().pow(2).mean()
    loss.backward()
    return loss.detach(), {k: p.grad for k, p in model.named_parameters() if p.grad is not None}


def test_every_block_is_wrapped_and_the_gradients_are_diffusers_checkpointings() -> None:
    base = _tiny_flux()
    outside, inside = copy.deepcopy(base), copy.deepcopy(base)
    apply_gradient_checkpointing(outside, 1)
    assert probe_ckpt_inside.checkpoint_inside(inside, 1) == 4  # 2 double + 2 single blocks
    assert not inside.is_gradient_checkpointing  # diffusers' own wrapping stays off: one checkpoint per block
    assert all(getattr(b.forward, "recomputed", False) for b in repeated_blocks(inside))
    (loss_a, grads_a), (loss_b, grads_b) = _grads(outside), _grads(inside)
    assert torch.equal(loss_a, loss_b) and grads_a.keys() == grads_b.keys() and len(grads_a) > 20
    assert all(torch.equal(grads_a[k], grads_b[k]) for k in grads_a)
    # Only the inputs are kept: the block's activations are recomputed in the backward pass.
    counted = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: counted.append(t.numel()) or t, lambda t: t):
        _grads(copy.deepcopy(inside))
    kept_inside = sum(counted)
    counted.clear()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: counted.append(t.numel()) or t, lambda t: t):
        _grads(copy.deepcopy(base))
    assert kept_inside < sum(counted) / 2
