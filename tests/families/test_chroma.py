"""The Chroma family: its objective against the pipeline's own components (scheduler, T5 with its mask, the one kept
pad token), the mask diffusers gets wrong, checkpointing inside the blocks, loading (folder, single files), and the real
model's sizes from the hub id with nothing downloaded. What every family must do is the family contract's
(test_contract.py); its LoRA files in every tool are test_lora_files.py's.

Model-level facts these tests pin (diffusers 0.42.1, ``pipelines/chroma/pipeline_chroma.py``): T5 runs with the
tokenizer's attention mask; the transformer gets the prompt's tokens and the first pad token (``mask_indices <=
seq_lengths``), as a *float* mask, which scaled-dot-product attention adds to the scores instead of masking (diffusers
issue #13619); the pipeline feeds ``t / 1000`` for a scheduler timestep ``t`` and steps with the output as the velocity.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from diffusers import ChromaPipeline, ChromaTransformer2DModel
from helpers import allow_any_flux_width
from safetensors.torch import save_file

from lightning_lora.errors import ConfigError
from lightning_lora.families import Chroma, ModelSource
from lightning_lora.families.chroma import text_for_denoiser
from lightning_lora.families.flux import latent_image_ids, pack_latents
from lightning_lora.formats.bfl import FluxDims
from lightning_lora.formats.chroma import chroma_to_original, original_to_chroma

PROMPTS = ["a photo of sks cat", "a dog"]
HUB_ID = "lodestones/Chroma1-HD"


@pytest.fixture(scope="module")
def pipe(tiny_pipeline: Any) -> Any:
    """The pipeline's own components, loaded from the saved tiny folder (typed Any: diffusers registers them as
    attributes that its class does not declare)."""
    pipe = ChromaPipeline.from_pretrained(tiny_pipeline("chroma"))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _latents(pipe: Any) -> torch.Tensor:
    pixels = torch.rand(2, 3, 32, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1
    return Chroma().encode_images(pipe.vae, pixels)


def _forward(pipe: Any, noisy: torch.Tensor, t: torch.Tensor, embeds: torch.Tensor, mask: Any) -> Any:
    """The pipeline's transformer call on unpacked latents ``noisy`` and the full-length text, as ``__call__`` makes
    it (``_prepare_attention_mask``: the text mask, then one per image token)."""
    b, _, h, w = noisy.shape
    tokens = (h // 2) * (w // 2)
    joint = pipe._prepare_attention_mask(b, tokens, noisy.dtype, mask)
    return pipe.transformer(
        hidden_states=pack_latents(noisy),
        timestep=t / 1000,
        encoder_hidden_states=embeds,
        txt_ids=torch.zeros(embeds.shape[1], 3),
        img_ids=latent_image_ids(h, w),
        attention_mask=joint,
        return_dict=False,
    )[0]


# -- the objective -------------------------------------------------------------------------------------------------


def test_loss_is_the_pipelines_objective_with_the_padding_masked(pipe: Any) -> None:
    """Noised by the pipeline's scheduler at two of its timesteps, its transformer fed ``t / 1000``, the full 512 T5
    positions and the pipeline's mask as a boolean mask: the velocity MSE is our loss per sample (which cuts the text to
    the kept tokens). The pipeline's own float mask (a bias, not a mask) gives another number: the test tells them
    apart."""
    family, scheduler = Chroma(), pipe.scheduler
    x0 = _latents(pipe)
    noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(1))
    scheduler.set_timesteps(sigmas=[1.0, 0.75, 0.5, 0.25], mu=0.5)
    t, sigmas = scheduler.timesteps[[1, 2]], scheduler.sigmas[[1, 2]]
    with torch.no_grad():
        noisy = torch.cat([scheduler.scale_noise(x0[i : i + 1], t[i : i + 1], noise[i : i + 1]) for i in range(2)])
        embeds, _, mask, *_ = pipe.encode_prompt(PROMPTS, do_classifier_free_guidance=False)
        assert embeds.shape[1] == 512 and mask.dtype == embeds.dtype  # the float mask of diffusers 0.42
        target = pack_latents(noise - x0)
        expected = (_forward(pipe, noisy, t, embeds, mask.bool()) - target).pow(2).mean(dim=(1, 2))
        as_shipped = (_forward(pipe, noisy, t, embeds, mask) - target).pow(2).mean(dim=(1, 2))
        loss = family.loss(pipe.transformer, {"latents": x0, **family.encode_prompts(pipe, PROMPTS)}, noise, sigmas)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    assert (as_shipped - expected).abs().max() > 1e-4


def test_the_text_is_cut_to_the_kept_tokens_and_masked_only_where_lengths_differ() -> None:
    embeds = torch.randn(2, 8, 4)
    mask = torch.tensor([[1, 1, 1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0, 0, 0]], dtype=torch.bool)
    cut, joint = text_for_denoiser(embeds, mask, image_tokens=3)
    assert torch.equal(cut, embeds[:, :5]) and joint is not None and joint.dtype == torch.bool
    assert joint.tolist() == [[True] * 3 + [False] * 2 + [True] * 3, [True] * 8]
    one, none = text_for_denoiser(embeds[1:], mask[1:], image_tokens=3)
    assert one.shape[1] == 5 and none is None  # a batch of one: no mask, any attention kernel


def test_sigmas_are_drawn_like_fluxs() -> None:
    family = Chroma(timestep_sampling="flux_shift")
    small = family.sample_timesteps(torch.zeros(4000, 1, 32, 32), torch.Generator().manual_seed(0))
    large = family.sample_timesteps(torch.zeros(4000, 1, 128, 128), torch.Generator().manual_seed(0))
    assert large.mean() > small.mean() + 0.05
    with pytest.raises(ConfigError, match=r"max_sequence_length"):
        Chroma(max_sequence_length=1024)


# -- text ----------------------------------------------------------------------------------------------------------


def test_cached_captions_are_the_pipelines_with_one_pad_token_kept(pipe: Any) -> None:
    """The cache holds what ``encode_prompt`` gives (T5 run with its mask) and the transformer's mask as a boolean:
    each prompt's tokens (``</s>`` included) and the first pad token."""
    family = Chroma(max_sequence_length=32)
    cached = family.encode_prompts(pipe, [*PROMPTS, ""])
    theirs, _, mask, *_ = pipe.encode_prompt([*PROMPTS, ""], do_classifier_free_guidance=False, max_sequence_length=32)
    torch.testing.assert_close(cached["prompt_embeds"], theirs)
    assert cached["prompt_mask"].dtype == torch.bool and torch.equal(cached["prompt_mask"], mask.bool())
    tokens = pipe.tokenizer([*PROMPTS, ""]).input_ids
    assert cached["prompt_mask"].sum(1).tolist() == [len(ids) + 1 for ids in tokens]


# -- checkpointing -------------------------------------------------------------------------------------------------


def test_diffusers_checkpointing_drops_the_mask_so_the_family_checkpoints_in_blocks(pipe: Any) -> None:
    """With a mask (prompts of two lengths), diffusers' own checkpointing of ChromaTransformer2DModel changes the
    output (its single blocks get no mask); checkpointing inside each block, what the family asks, does not."""
    from lightning_lora.model.assembly import apply_gradient_checkpointing

    x0 = _latents(pipe)
    batch = {"latents": x0, **Chroma().encode_prompts(pipe, PROMPTS)}
    noise, sigmas = torch.randn(x0.shape, generator=torch.Generator().manual_seed(2)), torch.tensor([0.3, 0.7])

    def loss(checkpointing: str) -> torch.Tensor:
        model = ChromaTransformer2DModel.from_config(pipe.transformer.config)
        model.load_state_dict(pipe.transformer.state_dict())
        model.train().requires_grad_(True)
        if checkpointing == "diffusers":
            model.enable_gradient_checkpointing()
        elif checkpointing == "blocks":
            assert apply_gradient_checkpointing(model, 1, in_blocks=True, only_in_blocks=True) > 0
        return Chroma().loss(model, batch, noise, sigmas)

    plain = loss("none")
    torch.testing.assert_close(loss("blocks"), plain)
    assert (loss("diffusers") - plain).abs().max() > 1e-5
    assert Chroma.compiling.checkpoints_in_blocks


# -- loading -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["original", "comfy"])
def test_single_file_transformer(
    tmp_path: Path, tiny_pipeline: Any, monkeypatch: pytest.MonkeyPatch, layout: str
) -> None:
    """The original single file (``Chroma1-HD.safetensors``) and ComfyUI's ``model.diffusion_model.`` one load through
    diffusers' ``from_single_file``, the rest of the pipeline from the folder; our names agree with its converter both
    ways (:func:`chroma_to_original`, :func:`original_to_chroma`)."""
    folder = tiny_pipeline("chroma")
    reference = ChromaTransformer2DModel.from_pretrained(folder, subfolder="transformer").state_dict()
    prefix = "model.diffusion_model." if layout == "comfy" else ""
    original = chroma_to_original(reference, prefix=prefix)
    assert original_to_chroma(original).keys() == reference.keys()
    file = tmp_path / "Chroma1-HD.safetensors"
    save_file({k: v.contiguous() + 0.5 for k, v in original.items()}, file)  # the file's weights, not the folder's
    inner = pipe_inner(reference)
    allow_any_flux_width(monkeypatch, FluxDims(inner, 4 * inner))  # its converter splits linear1 at FLUX.1's widths
    source = ModelSource(str(folder), denoiser_file=str(file), dtype=torch.float32)
    Chroma().check_source(source)
    loaded = Chroma().load_denoiser(source).state_dict()
    assert loaded.keys() == reference.keys()
    for key, value in loaded.items():
        torch.testing.assert_close(value, reference[key] + 0.5, msg=key)


def pipe_inner(state: dict[str, torch.Tensor]) -> int:
    return int(state["x_embedder.weight"].shape[0])


def test_local_folder_and_wrong_family(tiny_pipeline: Any) -> None:
    family, source = Chroma(), ModelSource(str(tiny_pipeline("chroma")), dtype=torch.float32)
    family.check_source(source)
    denoiser = family.load_denoiser(source)
    assert not any(p.requires_grad for p in denoiser.parameters()) and not denoiser.training
    with pytest.raises(ConfigError, match=r"model\.pretrained: .* holds a ChromaPipeline pipeline.*FluxPipeline"):
        from lightning_lora.families import Flux

        Flux().check_source(source)


# -- memory plan ---------------------------------------------------------------------------------------------------


def test_the_hub_model_plans_the_real_sizes_with_nothing_downloaded() -> None:
    """``plan`` on the hub id needs no file (the contract checks it plans as a folder of the same configs); the sizes
    are the real model's: the 8.9 B transformer, T5-XXL's 4.76 B encoder."""
    from lightning_lora.data.recipe import DataRecipe
    from lightning_lora.lora import LoraOptions
    from lightning_lora.model.recipe import ModelRecipe
    from lightning_lora.plan import caching_peaks, plan_for

    hub = ModelRecipe(Chroma(), ModelSource(HUB_ID), LoraOptions(rank=8), gradient_checkpointing=True)
    plan = plan_for(hub, DataRecipe(resolutions=(512,), batch_size=1))
    assert plan.weights * 2**30 / 2 == pytest.approx(8.9e9, rel=0.01)  # bf16: 2 bytes a parameter
    text = caching_peaks(hub, "none", 4, 1024)[0]
    assert text > 4.7e9 * 2 / 2**30
