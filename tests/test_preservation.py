"""DOP in the training step (:meth:`lightning_lora.module.LoraModule.preservation_reference`): the frozen base's own
prediction for the batch's preservation rows only, without gradients and with the adapter off, also through compiled
and checkpointed blocks; the planner counts its forward. The data side (regularization folders, preservation captions,
masks) is tested in tests/data/, each family's loss in tests/families/test_contract.py, exact resume in
tests/callbacks/test_resume.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import count_compiled_graphs, nonzero_lora_b

from lightning_lora import objectives
from lightning_lora.families.base import ModelSource
from lightning_lora.families.flux import Flux
from lightning_lora.lora import LoraOptions, adapters_disabled
from lightning_lora.module import LoraModule
from lightning_lora.objectives import Preservation, PreservationMode
from lightning_lora.precision import BF16

ROLES = ["train", "preservation", "regularization"]


def _module(model_dir: Path, mode: PreservationMode = "dop", **options: Any) -> LoraModule:
    """A tiny FLUX module built on the CPU in float32, with a random (non-zero) LoRA, in train mode."""
    family = Flux(max_sequence_length=16)
    module = LoraModule(
        str(model_dir), family=family, lora=LoraOptions(rank=2), preservation=Preservation(mode=mode), **options
    )
    module.use_precision(BF16(dtype="fp32"))
    torch.manual_seed(0)
    nonzero_lora_b(module.build(torch.device("cpu"))).train()
    return module


def _batch(
    module: LoraModule, seed: int = 0, roles: list[str] = ROLES
) -> tuple[dict[str, Any], torch.Tensor, torch.Tensor]:
    """A batch of ``len(roles)`` random cached samples of ``roles``, its noise and noise levels."""
    g = torch.Generator().manual_seed(seed)
    model: Any = module.denoiser
    batch: dict[str, Any] = module.family.example_batch(dict(model.config), len(roles), 32, 32, 16, g)
    batch = {k: v.float() for k, v in batch.items()}
    batch["role"] = list(roles)
    batch["loss_weight"] = torch.linspace(1.0, 0.5, len(roles))
    latents = batch["latents"]
    return batch, module.family.sample_noise(latents, g), module.family.sample_timesteps(latents, g)


def _step(module: LoraModule, batch: dict[str, Any], noise: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
    """What ``training_step`` computes (its logging needs a trainer), backpropagated."""
    denoiser = module._require_model()
    reference = module.preservation_reference(batch, noise, timesteps)
    losses = module.family.loss(denoiser, batch, noise, timesteps, reference)
    loss = objectives.weighted_mean(losses, batch["loss_weight"])
    loss.backward()
    return losses.detach()


def test_the_reference_is_the_base_prediction_of_the_preservation_rows_only(tiny_flux_dir: Path) -> None:
    """Rows 1 and 2 (a preservation and a regularization sample) under ``dop``, predicted by the base alone: the same
    values as the adapter-off model gives for them, without gradients; none for ``prior`` or a batch of training
    samples; every row (``rows`` None) when all are preservation samples."""
    module = _module(tiny_flux_dir)
    batch, noise, timesteps = _batch(module)
    reference = module.preservation_reference(batch, noise, timesteps)
    assert reference is not None and reference.rows is not None and reference.rows.tolist() == [1, 2]
    assert not reference.prediction.requires_grad
    denoiser = module._require_model()
    with torch.no_grad(), adapters_disabled(denoiser):
        alone = module.family.predict(denoiser, batch, noise, timesteps).prediction
    torch.testing.assert_close(reference.prediction, alone[1:], rtol=1e-5, atol=1e-6)
    assert all(p.requires_grad for n, p in denoiser.named_parameters() if ".lora_" in n)
    assert module.preservation_reference({**batch, "role": ["train"] * 3}, noise, timesteps) is None
    assert _module(tiny_flux_dir, mode="prior").preservation_reference(batch, noise, timesteps) is None
    every = module.preservation_reference({**batch, "role": ["preservation"] * 3}, noise, timesteps)
    assert every is not None and every.rows is None and every.prediction.shape == alone.shape
    losses = _step(module, batch, noise, timesteps)
    plain = module.family.loss(denoiser, batch, noise, timesteps).detach()
    assert losses[0] == plain[0] and not torch.equal(losses[1:], plain[1:])


def test_dop_through_compiled_and_checkpointed_blocks_trains_as_the_eager_model(
    tiny_flux_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``compile_blocks`` (dynamo with a backend that runs each traced graph: no code generation) and gradient
    checkpointing: two steps of preservation samples, DOP's forward before each, give the eager model's losses and
    LoRA gradients; the adapter-off forward is a block variant of its own, compiled at the first step only."""
    eager = _module(tiny_flux_dir)
    graphs = count_compiled_graphs(monkeypatch)
    torch._dynamo.reset()
    try:
        compiled = _module(tiny_flux_dir, compile_blocks=True, gradient_checkpointing=True)
        counts = []
        for seed in (1, 2):
            batch, noise, timesteps = _batch(eager, seed, roles=["preservation", "regularization"])
            for module in (eager, compiled):
                module.zero_grad(set_to_none=True)
            expected = _step(eager, batch, noise, timesteps)
            got = _step(compiled, batch, noise, timesteps)
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
            for (name, want), (_, have) in zip(eager.named_parameters(), compiled.named_parameters(), strict=True):
                if want.requires_grad:
                    assert have.grad is not None, name
                    torch.testing.assert_close(have.grad, want.grad, rtol=1e-4, atol=1e-6)
            counts.append(sum(len(g) for g in graphs.values()))
    finally:
        torch._dynamo.reset()
    assert counts[0] > 0 and counts[1] == counts[0]  # the second step compiles nothing new


def test_dop_with_offloaded_blocks_and_inputs_trains_as_the_plain_model(tiny_flux_dir: Path) -> None:
    """``offload_blocks`` (their weights copied in for DOP's forward too) with checkpointed blocks whose inputs wait in
    CPU memory (``offload_activations``; DOP's forward saves nothing): two steps with a mixed batch give the plain
    model's losses and LoRA gradients."""
    plain = _module(tiny_flux_dir)
    with pytest.warns(UserWarning, match="model.offload_blocks: 2 saves no weight memory"):  # both tiny blocks
        offloaded = _module(tiny_flux_dir, offload_blocks=2, gradient_checkpointing=True, offload_activations=True)
    for seed in (1, 2):
        batch, noise, timesteps = _batch(plain, seed)
        for module in (plain, offloaded):
            module.zero_grad(set_to_none=True)
        torch.testing.assert_close(_step(offloaded, batch, noise, timesteps), _step(plain, batch, noise, timesteps))
        for (name, want), (_, have) in zip(plain.named_parameters(), offloaded.named_parameters(), strict=True):
            if want.requires_grad:
                assert have.grad is not None, name
                torch.testing.assert_close(have.grad, want.grad, rtol=1e-4, atol=1e-6)


def test_the_planner_counts_dops_forward_and_the_masked_loss_and_says_their_cost(tiny_flux_dir: Path) -> None:
    from lightning_lora.data.recipe import DataRecipe
    from lightning_lora.data.sources import ImageFolder
    from lightning_lora.model.recipe import ModelRecipe
    from lightning_lora.plan import plan_for

    recipe = ModelRecipe(Flux(max_sequence_length=16), ModelSource(str(tiny_flux_dir)), LoraOptions(rank=4))
    data = DataRecipe(resolutions=(64,), batch_size=2)
    plain = plan_for(recipe, data)
    dop = plan_for(recipe.replace(preservation=Preservation(mode="dop", every_image=True)), data)
    assert plain.preservation == 0 and dop.preservation > 0
    assert dop.peak_gib == max(plain.peak_gib, dop.static + dop.preservation + dop.overhead)
    report = dop.report(24)
    assert "DOP forward (no grad)" in report and "model.preservation.mode: dop: one more forward" in report
    assert "DOP" not in plain.report(24)
    masked = plan_for(recipe, data.replace(folders=(ImageFolder("me", masks="me_masks"),)))
    latent = 2 * 4 * 8 * 8  # 2 images of the tiny FLUX's 4 latent channels at an eighth of 64 pixels
    assert masked.transient - plain.transient == pytest.approx(2 * 4 * latent / 2**30)
    assert any(note.startswith("masks: ") for note in masked.notes)
