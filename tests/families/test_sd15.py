"""The SD1.5 family: prompt encoding, prediction type from the model, objective, loading, a CLI fit, export in both
formats, exact resume.

Independent witnesses: diffusers' ``StableDiffusionPipeline.encode_prompt``, ``DDPMScheduler`` (``add_noise``,
``get_velocity``), diffusers' single-file converter, diffusers' ``convert_state_dict_to_kohya`` (key names) and its
kohya LoRA loader.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from diffusers import DDPMScheduler, StableDiffusionPipeline
from diffusers.utils import convert_state_dict_to_kohya
from helpers import (
    ALPHA,
    RANK,
    check_exact_resume,
    check_fit_lowers_eval_loss,
    family_config,
    lora_model,
    run_cli,
)
from peft.utils import get_peft_model_state_dict
from safetensors.torch import load_file, save_file

from lightning_lora.errors import ConfigError
from lightning_lora.export import save_lora
from lightning_lora.families import SD15
from lightning_lora.families.base import ModelSource, SampleSettings
from lightning_lora.families.unet import noise_schedule_of
from lightning_lora.formats.ldm import UNetLayout, unet_state_dict_to_ldm
from lightning_lora.lora import LoraOptions


@pytest.fixture(scope="module")
def source(tiny_sd15_dir: Path) -> ModelSource:
    return ModelSource(str(tiny_sd15_dir), dtype=torch.float32)


@pytest.fixture(scope="module")
def v_source(tmp_path_factory: pytest.TempPathFactory) -> ModelSource:
    """An SD2-768-like model: the scheduler config says v_prediction."""
    from lightning_lora.tiny.sd15 import save_tiny_sd15

    folder = save_tiny_sd15(tmp_path_factory.mktemp("models") / "tiny-sd15-v", prediction_type="v_prediction")
    return ModelSource(str(folder), dtype=torch.float32)


def test_prompts_are_encoded_like_the_pipeline(tiny_sd15_dir: Path, source: ModelSource) -> None:
    family = SD15()
    prompts = ["a photo of sks cat", ""]
    ours = family.encode_prompts(family.load_text_encoders(source), prompts)
    pipe = StableDiffusionPipeline.from_pretrained(tiny_sd15_dir)
    theirs, _ = pipe.encode_prompt(prompts, "cpu", 1, do_classifier_free_guidance=False)
    assert list(ours) == ["prompt_embeds"] and ours["prompt_embeds"].shape == (2, 77, 32)
    torch.testing.assert_close(ours["prompt_embeds"], theirs)
    assert family.text_cache_tag() == "sd15-clip77-skip0"
    # clip_skip=1 ("clip skip 2"): the penultimate layer through the final layer norm, as diffusers defines it.
    skipped = SD15(clip_skip=1).encode_prompts(family.load_text_encoders(source), prompts)["prompt_embeds"]
    ids = pipe.tokenizer(prompts, padding="max_length", max_length=77, truncation=True, return_tensors="pt").input_ids
    with torch.no_grad():
        hidden = pipe.text_encoder(ids, output_hidden_states=True).hidden_states[-2]
        torch.testing.assert_close(skipped, pipe.text_encoder.final_layer_norm(hidden))
    assert not torch.allclose(skipped, theirs)
    assert SD15(clip_skip=1).text_cache_tag() == "sd15-clip77-skip1"


def test_prediction_type_comes_from_the_model_and_can_be_overridden(source: ModelSource, v_source: ModelSource) -> None:
    assert SD15().noise_schedule(source).prediction_type == "epsilon"
    assert SD15().noise_schedule(v_source).prediction_type == "v_prediction"
    assert SD15(prediction_type="epsilon").noise_schedule(v_source).prediction_type == "epsilon"
    assert SD15(prediction_type="v_prediction").sampling_scheduler(source).config.prediction_type == "v_prediction"


def test_v_prediction_loss_equals_the_diffusers_recipe(v_source: ModelSource) -> None:
    family = SD15()
    unet = family.load_denoiser(v_source)
    assert noise_schedule_of(unet).prediction_type == "v_prediction"
    scheduler = DDPMScheduler.from_pretrained(v_source.pretrained, subfolder="scheduler")
    g = torch.Generator().manual_seed(4)
    x0, noise = torch.randn(2, 4, 6, 6, generator=g), torch.randn(2, 4, 6, 6, generator=g)
    text = torch.randn(2, 77, 32, generator=g)
    u, t = torch.tensor([0.2505, 0.7505]), torch.tensor([250, 750])
    with torch.no_grad():
        predicted = unet(scheduler.add_noise(x0, noise, t), t, encoder_hidden_states=text).sample
        expected = (predicted - scheduler.get_velocity(x0, noise, t)).pow(2).mean(dim=(1, 2, 3))
        torch.testing.assert_close(family.loss(unet, {"latents": x0, "prompt_embeds": text}, noise, u), expected)
        # A timestep range restricts the draws: u = 0 and u -> 1 land on its ends.
        ranged = SD15(min_timestep=250, max_timestep=251)
        torch.testing.assert_close(ranged.loss(unet, {"latents": x0, "prompt_embeds": text}, noise, u)[0], expected[0])


def test_zero_terminal_snr_samples_with_a_scheduler_that_supports_it(v_source: ModelSource) -> None:
    family = SD15(zero_terminal_snr=True)  # v_prediction comes from the model
    assert family.noise_schedule(v_source).alphas_cumprod[-1] == 0
    sampler = family.sampling_scheduler(v_source)
    # The model ships PNDM, which has no zero-SNR option: DDIM with the same betas is used for samples.
    assert type(sampler).__name__ == "DDIMScheduler"
    assert sampler.config.rescale_betas_zero_snr and sampler.config.timestep_spacing == "trailing"
    assert sampler.config.beta_schedule == "scaled_linear"


def test_guidance_needs_the_negative_embedding(source: ModelSource) -> None:
    family = SD15()
    pipe = family.pipeline(family.load_denoiser(source), family.load_vae(source), source)
    embeddings = {"prompt_embeds": torch.zeros(1, 77, 32)}
    with pytest.raises(ValueError, match="negative"):
        family.generate(pipe, embeddings, SampleSettings(seed=0, height=32, width=32, steps=2, guidance_scale=5.0))
    image = family.generate(pipe, embeddings, SampleSettings(seed=0, height=32, width=16, steps=2, guidance_scale=1.0))
    assert image.size == (16, 32)


def test_single_file_unet_in_the_original_layout(tmp_path: Path, tiny_sd15_dir: Path, source: ModelSource) -> None:
    reference = SD15().load_denoiser(source).state_dict()
    layout = UNetLayout.from_config(json.loads((tiny_sd15_dir / "unet" / "config.json").read_text()))
    original = {k: v.contiguous() for k, v in unet_state_dict_to_ldm(reference, layout).items()}
    assert "model.diffusion_model.input_blocks.1.1.proj_in.weight" in original
    file = tmp_path / "v1-tiny.safetensors"
    save_file(original, file)
    loaded = SD15().load_denoiser(ModelSource(str(tiny_sd15_dir), str(file), dtype=torch.float32)).state_dict()
    assert loaded.keys() == reference.keys() and all(torch.equal(loaded[k], reference[k]) for k in reference)


def test_fit_with_min_snr_weighting_lowers_the_fixed_eval_loss(
    tmp_path: Path, tiny_sd15_dir: Path, photos_dir: Path
) -> None:
    """Beyond the family contract's fit: min-SNR weighting (a UNet family option) trains too."""
    config = family_config(
        tmp_path, tiny_sd15_dir, photos_dir, "SD15", {"min_snr_gamma": 5.0}, **{"trainer.max_steps": 16}
    )
    cli = run_cli(["fit", "--config", str(config)])
    assert cli.trainer.global_step == 16
    check_fit_lowers_eval_loss(cli)


def test_the_kohya_file_has_sd_scripts_names_and_the_trained_alpha(tmp_path: Path, tiny_sd15_dir: Path) -> None:
    """The kohya file of a LoCon LoRA (the contract loads both files into diffusers, every layer, as trained): the keys
    diffusers' own converter gives, the convolutions' 4-D shapes, the trained alpha."""
    model = lora_model(SD15(), tiny_sd15_dir, "locon")
    lora = LoraOptions(rank=RANK, alpha=ALPHA, targets="locon")
    files = {
        fmt: save_lora(model, tmp_path / f"{fmt}.safetensors", family=SD15(), lora=lora, info={}, format=fmt)
        for fmt in ("diffusers", "kohya")
    }
    # kohya's SD1 names are diffusers' module names: diffusers' own converter gives the same keys (it writes
    # alpha = rank, though, whatever the LoRA's alpha; ours keeps the trained alpha).
    kohya = load_file(files["kohya"])
    reference = convert_state_dict_to_kohya({f"unet.{k}": v for k, v in get_peft_model_state_dict(model).items()})
    assert kohya.keys() == reference.keys()
    assert kohya["lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight"].shape == (RANK, 16, 1, 1)
    assert all(float(v) == ALPHA for k, v in kohya.items() if k.endswith(".alpha"))


def test_exact_resume_with_the_unet_options(tmp_path: Path, tiny_sd15_dir: Path, photos_dir: Path) -> None:
    """Beyond the family contract's resume (tests/families/test_contract.py): the UNet families' options that draw
    or weight (noise offset, min-SNR) resume exactly too."""
    check_exact_resume(tmp_path, tiny_sd15_dir, photos_dir, "SD15", {"noise_offset": 0.1, "min_snr_gamma": 5.0})


def test_wrong_pipeline_folder_is_refused(tiny_sdxl_dir: Path) -> None:
    with pytest.raises(ConfigError, match="StableDiffusionXLPipeline"):
        SD15().check_source(ModelSource(str(tiny_sdxl_dir)))


def test_tiny_sd15_is_deterministic_and_saved_losslessly(tiny_sd15_dir: Path) -> None:
    from lightning_lora.tiny.sd15 import build_tiny_sd15, save_tiny_sd15

    a, b = build_tiny_sd15(seed=0), build_tiny_sd15(seed=0)
    loaded = StableDiffusionPipeline.from_pretrained(tiny_sd15_dir)
    for name in ("unet", "vae", "text_encoder"):
        sa, sb, sl = (getattr(p, name).state_dict() for p in (a, b, loaded))
        assert all(torch.equal(sa[k], sb[k]) and torch.equal(sa[k], sl[k]) for k in sa), name
        assert not any(m.training for m in getattr(a, name).modules()), f"{name} is not in eval mode"
    assert save_tiny_sd15(tiny_sd15_dir) == tiny_sd15_dir  # idempotent: an existing folder is kept
    with pytest.raises(FileExistsError, match="seed"):
        save_tiny_sd15(tiny_sd15_dir, seed=1)
