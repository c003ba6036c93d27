"""The SDXL family: size conditioning, objective options, loading, a CLI fit, export in both formats, exact resume.

Independent witnesses: diffusers' ``StableDiffusionXLPipeline`` (``encode_prompt``, ``_get_add_time_ids``),
``DDPMScheduler`` (``add_noise``, ``get_velocity``), ``diffusers.training_utils.compute_snr``, diffusers' single-file
converter, and diffusers' kohya LoRA loader (which maps SDXL's original block names back by itself).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from diffusers import DDPMScheduler, StableDiffusionXLPipeline, UNet2DConditionModel
from diffusers.training_utils import compute_snr
from helpers import (
    ALPHA,
    RANK,
    check_fit_lowers_eval_loss,
    family_config,
    lora_model,
    run_cli,
)
from safetensors.torch import load_file, save_file

from lightning_lora.errors import ConfigError
from lightning_lora.export import checkpoint_lora, export_lora, save_lora
from lightning_lora.families import SDXL
from lightning_lora.families.base import ModelSource
from lightning_lora.families.sdxl import default_size_conditioning, sdxl_time_ids
from lightning_lora.families.unet import noise_schedule_of
from lightning_lora.formats.ldm import SDXL_LAYOUT, UNetLayout, diffusers_to_ldm, unet_state_dict_to_ldm
from lightning_lora.lora import LoraOptions


@pytest.fixture(scope="module")
def source(tiny_sdxl_dir: Path) -> ModelSource:
    return ModelSource(str(tiny_sdxl_dir), dtype=torch.float32)


@pytest.fixture(scope="module")
def pipe(tiny_sdxl_dir: Path) -> StableDiffusionXLPipeline:
    return StableDiffusionXLPipeline.from_pretrained(tiny_sdxl_dir)


@pytest.fixture(scope="module")
def batch(source: ModelSource) -> dict[str, torch.Tensor]:
    family = SDXL()
    g = torch.Generator().manual_seed(0)
    latents = family.encode_images(family.load_vae(source), torch.rand(2, 3, 64, 48, generator=g) * 2 - 1)
    return {"latents": latents, **family.encode_prompts(family.load_text_encoders(source), ["a photo of sks cat", ""])}


# -- size conditioning ---------------------------------------------------------------------------------------------


def test_time_ids_order_and_broadcast(pipe: StableDiffusionXLPipeline) -> None:
    ids = sdxl_time_ids(torch.tensor([[768, 1024]]), torch.tensor([[0, 64]]), torch.tensor([[1024, 1024]]))
    assert ids.dtype == torch.float32 and ids.tolist() == [[768, 1024, 0, 64, 1024, 1024]]
    # The pipeline's own function, at inference defaults (H, W), (0, 0), (H, W).
    theirs = pipe._get_add_time_ids((96, 64), (0, 0), (96, 64), torch.float32, text_encoder_projection_dim=32)
    defaults = default_size_conditioning(torch.zeros(3, 4, 12, 8))
    ours = sdxl_time_ids(defaults["original_size"], defaults["crop_top_left"], defaults["target_size"])
    assert torch.equal(ours, theirs.expand(3, 6))
    # One image's [2] vectors broadcast against a batch.
    mixed = sdxl_time_ids(torch.tensor([512, 512]), torch.zeros(2, 2, dtype=torch.int64), torch.tensor([512, 512]))
    assert mixed.shape == (2, 6)


def test_loss_reads_size_keys_from_the_batch_and_falls_back_to_the_latent_size(
    source: ModelSource, batch: dict[str, torch.Tensor]
) -> None:
    family = SDXL()
    unet = family.load_denoiser(source)
    seen: list[torch.Tensor] = []
    hook = unet.register_forward_pre_hook(
        lambda m, args, kwargs: seen.append(kwargs["added_cond_kwargs"]["time_ids"].clone()), with_kwargs=True
    )
    noise, t = torch.randn_like(batch["latents"]), torch.tensor([0.3, 0.6])
    base = family.loss(unet, batch, noise, t)
    sizes = {
        "original_size": torch.tensor([[300, 200], [1024, 768]]),
        "crop_top_left": torch.tensor([[0, 8], [16, 0]]),
        "target_size": torch.tensor([[64, 48], [64, 48]]),
    }
    conditioned = family.loss(unet, {**batch, **sizes}, noise, t)
    hook.remove()
    assert seen[0].tolist() == [[64, 48, 0, 0, 64, 48]] * 2  # latents 8x6 -> 64x48 px, uncropped
    assert seen[1].tolist() == [[300, 200, 0, 8, 64, 48], [1024, 768, 16, 0, 64, 48]]
    assert not torch.allclose(base, conditioned)


# -- objective -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("prediction", [None, "v_prediction"])
def test_loss_equals_the_diffusers_recipe(
    source: ModelSource, pipe: StableDiffusionXLPipeline, batch: dict[str, torch.Tensor], prediction: str | None
) -> None:
    """add_noise, the UNet with pipeline-made time ids, an epsilon / velocity target: train_text_to_image_sdxl.py."""
    family = SDXL(prediction_type=prediction)  # type: ignore[arg-type]
    unet = family.load_denoiser(source)
    assert noise_schedule_of(unet).prediction_type == (prediction or "epsilon")  # read from the scheduler config
    scheduler = DDPMScheduler.from_pretrained(source.pretrained, subfolder="scheduler")
    g = torch.Generator().manual_seed(3)
    x0, noise, u = batch["latents"], torch.randn(batch["latents"].shape, generator=g), torch.tensor([0.0505, 0.9005])
    t = torch.tensor([50, 900])
    time_ids = pipe._get_add_time_ids((64, 48), (0, 0), (64, 48), torch.float32, 32).repeat(2, 1)
    with torch.no_grad():
        predicted = unet(
            scheduler.add_noise(x0, noise, t),
            t,
            encoder_hidden_states=batch["prompt_embeds"],
            added_cond_kwargs={"text_embeds": batch["pooled_prompt_embeds"], "time_ids": time_ids},
        ).sample
        target = noise if prediction is None else scheduler.get_velocity(x0, noise, t)
        expected = (predicted - target).pow(2).mean(dim=(1, 2, 3))
        torch.testing.assert_close(family.loss(unet, batch, noise, u), expected)
        # min-SNR-gamma: the same loss weighted as diffusers' scripts do.
        gamma = 5.0
        snr = compute_snr(scheduler, t)
        weights = torch.minimum(snr, torch.full_like(snr, gamma)) / (snr if prediction is None else snr + 1)
        weighted = SDXL(prediction_type=prediction, min_snr_gamma=gamma).loss(unet, batch, noise, u)  # type: ignore[arg-type]
        torch.testing.assert_close(weighted, expected * weights)


def test_noise_offset_is_part_of_the_training_noise(batch: dict[str, torch.Tensor]) -> None:
    plain, offset = SDXL(), SDXL(noise_offset=0.1)
    latents = batch["latents"]
    drawn = offset.sample_noise(latents, torch.Generator().manual_seed(5))
    g = torch.Generator().manual_seed(5)
    base = torch.randn(latents.shape, generator=g)
    per_channel = torch.randn(*latents.shape[:2], 1, 1, generator=g)
    torch.testing.assert_close(drawn, base + 0.1 * per_channel)
    # Without the option the noise is plain; the loss itself adds nothing (fixed evaluation uses plain noise).
    torch.testing.assert_close(plain.sample_noise(latents, torch.Generator().manual_seed(5)), base)
    state = torch.get_rng_state()
    offset.sample_noise(latents, torch.Generator().manual_seed(5))
    assert torch.equal(torch.get_rng_state(), state)  # a given generator leaves the global RNG alone


def test_zero_terminal_snr(source: ModelSource) -> None:
    with pytest.raises(ConfigError, match="prediction_type: v_prediction"):
        SDXL(zero_terminal_snr=True, prediction_type="epsilon")
    with pytest.raises(ConfigError, match="prediction_type: v_prediction"):
        SDXL(zero_terminal_snr=True).noise_schedule(source)  # the tiny SDXL's scheduler says epsilon
    family = SDXL(zero_terminal_snr=True, prediction_type="v_prediction")
    schedule = family.noise_schedule(source)
    expected = DDPMScheduler.from_pretrained(source.pretrained, subfolder="scheduler", rescale_betas_zero_snr=True)
    torch.testing.assert_close(schedule.alphas_cumprod, expected.alphas_cumprod)
    assert schedule.alphas_cumprod[-1] == 0
    sampler = family.sampling_scheduler(source)
    assert type(sampler).__name__ == "EulerDiscreteScheduler"
    assert sampler.config.rescale_betas_zero_snr and sampler.config.timestep_spacing == "trailing"
    assert sampler.config.prediction_type == "v_prediction"


def test_option_conflict_with_the_model_stops_the_cli_early(
    tmp_path: Path, tiny_sdxl_dir: Path, photos_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from lightning_lora.cli import main

    config = family_config(tmp_path, tiny_sdxl_dir, photos_dir, "SDXL", {"zero_terminal_snr": True})
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(config)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "zero_terminal_snr" in err and "v_prediction" in err and "Traceback" not in err
    assert not (tmp_path / "cache").exists()  # nothing was encoded


def test_options_are_validated() -> None:
    for kwargs, option in (
        ({"noise_offset": -0.1}, "noise_offset"),
        ({"min_snr_gamma": 0.0}, "min_snr_gamma"),
        ({"min_timestep": 500, "max_timestep": 400}, "min_timestep"),
        ({"clip_skip": 0}, "clip_skip"),
    ):
        with pytest.raises(ConfigError, match=option):
            SDXL(**kwargs)  # type: ignore[arg-type]


def test_prompts_are_encoded_like_the_pipeline(source: ModelSource, pipe: StableDiffusionXLPipeline) -> None:
    family = SDXL()
    ours = family.encode_prompts(family.load_text_encoders(source), ["a photo of sks cat", "a red car"])
    embeds, _, pooled, _ = pipe.encode_prompt(["a photo of sks cat", "a red car"], do_classifier_free_guidance=False)
    assert ours["prompt_embeds"].shape == (2, 77, 80) and ours["pooled_prompt_embeds"].shape == (2, 32)
    torch.testing.assert_close(ours["prompt_embeds"], embeds)
    torch.testing.assert_close(ours["pooled_prompt_embeds"], pooled)
    skipped = SDXL(clip_skip=1).encode_prompts(family.load_text_encoders(source), ["a photo of sks cat"])
    embeds_1, _, pooled_1, _ = pipe.encode_prompt("a photo of sks cat", do_classifier_free_guidance=False, clip_skip=1)
    torch.testing.assert_close(skipped["prompt_embeds"], embeds_1)
    torch.testing.assert_close(skipped["pooled_prompt_embeds"], pooled_1)
    assert SDXL().text_cache_tag() != SDXL(clip_skip=1).text_cache_tag()


# -- loading -------------------------------------------------------------------------------------------------------


def test_single_file_unet_in_both_layouts(tmp_path: Path, tiny_sdxl_dir: Path, source: ModelSource) -> None:
    """A diffusers-named UNet file and an original-layout full checkpoint (SGM names under model.diffusion_model.)."""
    reference = SDXL().load_denoiser(source).state_dict()
    assert UNetLayout.from_config(json.loads((tiny_sdxl_dir / "unet" / "config.json").read_text())) == SDXL_LAYOUT
    diffusers_file = tmp_path / "unet.safetensors"
    shutil.copy(tiny_sdxl_dir / "unet" / "diffusion_pytorch_model.safetensors", diffusers_file)
    original = {k: v.contiguous() for k, v in unet_state_dict_to_ldm(reference, SDXL_LAYOUT).items()}
    original["first_stage_model.encoder.conv_in.weight"] = torch.zeros(1)  # a full checkpoint also holds the VAE...
    original_file = tmp_path / "sd_xl_tiny.safetensors"
    save_file(original, original_file)
    assert "model.diffusion_model.input_blocks.4.1.transformer_blocks.0.attn1.to_q.weight" in original
    for file in (diffusers_file, original_file):
        loaded = SDXL().load_denoiser(ModelSource(str(tiny_sdxl_dir), str(file), dtype=torch.float32)).state_dict()
        assert loaded.keys() == reference.keys()
        assert all(torch.equal(loaded[k], reference[k]) for k in reference), file.name


def test_ldm_names_of_the_sdxl_unet() -> None:
    assert diffusers_to_ldm("down_blocks.1.attentions.0.proj_in", SDXL_LAYOUT) == "input_blocks.4.1.proj_in"
    assert diffusers_to_ldm("down_blocks.2.resnets.1.conv1", SDXL_LAYOUT) == "input_blocks.8.0.in_layers.2"
    assert diffusers_to_ldm("down_blocks.1.downsamplers.0.conv", SDXL_LAYOUT) == "input_blocks.6.0.op"
    assert diffusers_to_ldm("mid_block.resnets.1.time_emb_proj", SDXL_LAYOUT) == "middle_block.2.emb_layers.1"
    assert diffusers_to_ldm("up_blocks.0.upsamplers.0.conv", SDXL_LAYOUT) == "output_blocks.2.2.conv"
    assert diffusers_to_ldm("up_blocks.2.resnets.2.conv_shortcut", SDXL_LAYOUT) == "output_blocks.8.0.skip_connection"
    assert diffusers_to_ldm("add_embedding.linear_2.weight", SDXL_LAYOUT) == "label_emb.0.2.weight"
    for bad in ("down_blocks.0.attentions.0.proj_in", "down_blocks.2.downsamplers.0.conv", "up_blocks.3.resnets.0"):
        with pytest.raises(KeyError):
            diffusers_to_ldm(bad, SDXL_LAYOUT)


# -- training, export, resume --------------------------------------------------------------------------------------


def test_fit_with_noise_offset_exports_the_sgm_names_from_its_checkpoint(
    tmp_path: Path, tiny_sdxl_dir: Path, photos_dir: Path
) -> None:
    """Beyond the family contract's fit: noise offset (a UNet family option) trains, the samples are written, and the
    checkpoint knows its family and options."""
    config = family_config(
        tmp_path,
        tiny_sdxl_dir,
        photos_dir,
        "SDXL",
        {"noise_offset": 0.05},
        # The tiny UNet's attention runs on 4x4 and 2x2 latents: it learns mostly through the convolutions (locon).
        **{"trainer.max_steps": 16, "model.lora.targets": "locon", "model.optimizer.init_args": {"lr": 0.003}},
    )
    cli = run_cli(["fit", "--config", str(config)])
    assert cli.trainer.global_step == 16
    check_fit_lowers_eval_loss(cli)
    assert sorted(p.name for p in (tmp_path / "run" / "samples").iterdir()) == [
        "step000000_00.png",
        "step000016_00.png",
    ]
    # The checkpoint knows its family: `lightning-lora export` picks the SDXL kohya layout without the base model.
    state, lora, family, info = checkpoint_lora(tmp_path / "run" / "checkpoints" / "last.ckpt")
    assert info["family"] == "sdxl" and lora.rank == 4
    assert isinstance(family, SDXL) and family.noise_offset == 0.05  # built with the run's family options
    kohya = export_lora(state, tmp_path / "k.safetensors", format="kohya", lora=lora, family=family, info=info)
    assert any(k.startswith("lora_unet_input_blocks_") for k in load_file(kohya))


def test_the_kohya_file_has_sgm_names_and_the_trained_alpha(tmp_path: Path, tiny_sdxl_dir: Path) -> None:
    """The kohya file of a LoCon LoRA (the contract loads both files into diffusers, every layer, as trained): the
    original SGM UNet's names, the convolutions' 4-D shapes, the trained alpha."""
    model = lora_model(SDXL(), tiny_sdxl_dir, "locon")
    lora = LoraOptions(rank=RANK, alpha=ALPHA, targets="locon")
    files = {
        fmt: save_lora(model, tmp_path / f"{fmt}.safetensors", family=SDXL(), lora=lora, info={}, format=fmt)
        for fmt in ("diffusers", "kohya")
    }
    kohya = load_file(files["kohya"])
    assert "lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q.lora_down.weight" in kohya
    assert kohya["lora_unet_input_blocks_1_0_in_layers_2.lora_down.weight"].shape == (RANK, 16, 3, 3)
    assert all(float(v) == ALPHA for k, v in kohya.items() if k.endswith(".alpha"))


def test_pipeline_folder_of_another_family_is_refused(tiny_sd15_dir: Path) -> None:
    with pytest.raises(ConfigError, match="StableDiffusionPipeline"):
        SDXL().check_source(ModelSource(str(tiny_sd15_dir)))


def test_loss_without_a_loaded_schedule_is_a_clear_error(tiny_sdxl_dir: Path) -> None:
    unet = UNet2DConditionModel.from_pretrained(tiny_sdxl_dir, subfolder="unet")
    with pytest.raises(RuntimeError, match="load_denoiser"):
        SDXL().loss(unet, {"latents": torch.zeros(1, 4, 2, 2)}, torch.zeros(1, 4, 2, 2), torch.zeros(1))


def test_tiny_sdxl_is_deterministic_and_saved_losslessly(tiny_sdxl_dir: Path) -> None:
    from lightning_lora.tiny.sdxl import build_tiny_sdxl, save_tiny_sdxl

    a, b = build_tiny_sdxl(seed=0), build_tiny_sdxl(seed=0)
    loaded = StableDiffusionXLPipeline.from_pretrained(tiny_sdxl_dir)
    for name in ("unet", "vae", "text_encoder", "text_encoder_2"):
        sa, sb, sl = (getattr(p, name).state_dict() for p in (a, b, loaded))
        assert all(torch.equal(sa[k], sb[k]) and torch.equal(sa[k], sl[k]) for k in sa), name
        assert not any(m.training for m in getattr(a, name).modules()), f"{name} is not in eval mode"
    assert save_tiny_sdxl(tiny_sdxl_dir) == tiny_sdxl_dir  # idempotent: an existing folder is kept
    with pytest.raises(FileExistsError, match="seed"):
        save_tiny_sdxl(tiny_sdxl_dir, seed=1)
