"""The Krea 2 family against the pipeline's own components, on the tiny pipeline: its objective (the scheduler's noise
and time shift, the pipeline's packing, positions and text layout, the velocity target), cached captions and latents,
samples, LoRA presets and ComfyUI's key map, loading (folder, single files, distilled models), and the real model's
sizes from the hub ids with nothing downloaded. What every family must do (fitting, exact resume, files in a fresh
pipeline, offloading, text encoders in FP8/NF4, hub ids offline...) is the family contract's (test_contract.py).

Model-level facts these tests pin (diffusers 0.42.1, ``pipelines/krea2/pipeline_krea2.py``): the pipeline feeds the
transformer ``t / 1000`` for a scheduler timestep ``t = 1000 sigma`` and steps with its output as the velocity, in
Krea's guidance convention (``cond + scale (cond - uncond)``, on above 0); it shifts its schedule by ``calculate_shift``
of the packed image tokens (a fixed ``mu = 1.15`` when ``is_distilled``); captions are 12 layers of Qwen3-VL stacked per
token, padded inside the template, with a mask.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from diffusers import Krea2Pipeline, Krea2Transformer2DModel
from diffusers.pipelines.krea2.pipeline_krea2 import calculate_shift
from safetensors.torch import save_file
from torch.utils.data import default_collate

from lightning_lora.errors import ConfigError
from lightning_lora.families import Krea2, ModelSource
from lightning_lora.families.base import SampleSettings
from lightning_lora.families.krea2 import KREA2_TRANSFORMER, compact_text, position_ids
from lightning_lora.formats.krea2 import comfy_target, diffusers_to_original
from lightning_lora.lora import LoraOptions

PROMPTS = ["a photo of sks cat with a red mug on the table", "a dog"]  # different lengths: a mask in the batch
LENGTH = 32  # text tokens after the system turn in these tests (the template's closing 5 among them)
RAW, TURBO = "krea/Krea-2-Raw", "krea/Krea-2-Turbo"


@pytest.fixture(scope="module")
def model_dir(tiny_pipeline: Callable[[str], Path]) -> Path:
    return tiny_pipeline("krea2")


@pytest.fixture(scope="module")
def source(model_dir: Path) -> ModelSource:
    return ModelSource(str(model_dir), dtype=torch.float32)


@pytest.fixture(scope="module")
def pipe(model_dir: Path) -> Any:
    """The pipeline's own components, loaded from the saved tiny folder (``Any``: its components are attributes that
    diffusers' typing cannot see)."""
    pipe = Krea2Pipeline.from_pretrained(model_dir)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def encoded(pipe: Any) -> dict[str, torch.Tensor]:
    return Krea2(max_sequence_length=LENGTH).encode_prompts(pipe, PROMPTS)


def _latents(pipe: Any, seed: int = 0) -> torch.Tensor:
    pixels = torch.rand(2, 3, 32, 48, generator=torch.Generator().manual_seed(seed)) * 2 - 1
    return Krea2().encode_images(pipe.vae, pixels)


def _batch(latents: torch.Tensor, encoded: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A batch as the data module serves it: per-sample cache entries stacked by the default collate."""
    samples = [{"latents": latents[i], **{k: v[i] for k, v in encoded.items()}} for i in range(latents.shape[0])]
    return default_collate(samples)


# -- the objective -------------------------------------------------------------------------------------------------


def test_loss_is_the_pipelines_own_flow_matching_objective(pipe: Any, encoded: dict[str, torch.Tensor]) -> None:
    """Noised by the pipeline's scheduler at two of its timesteps, packed and positioned by the pipeline's own helpers,
    its text as ``encode_prompt`` lays it out (padding inside the template, all ``LENGTH`` positions with the mask),
    fed ``t / 1000`` as ``__call__`` does: its prediction against the velocity ``noise - x0`` is our loss, per sample,
    from the cached (compacted) text."""
    family, scheduler = Krea2(max_sequence_length=LENGTH), pipe.scheduler
    x0 = _latents(pipe)
    b, c, h, w = x0.shape
    noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(1))
    scheduler.set_timesteps(sigmas=[1.0, 0.75, 0.5, 0.25], mu=0.0)  # exp(0): the sigmas as given
    t, sigmas = scheduler.timesteps[[1, 2]], scheduler.sigmas[[1, 2]]
    with torch.no_grad():
        noisy = torch.cat([scheduler.scale_noise(x0[i : i + 1], t[i : i + 1], noise[i : i + 1]) for i in range(2)])
        embeds, mask = pipe.encode_prompt(PROMPTS, max_sequence_length=LENGTH)
        positions = pipe.prepare_position_ids(embeds.shape[1], h // 2, w // 2, "cpu")
        inputs = {"encoder_hidden_states": embeds, "position_ids": positions, "encoder_attention_mask": mask}
        packed = pipe._pack_latents(noisy, b, c, h, w)
        prediction = pipe.transformer(hidden_states=packed, timestep=t / 1000, return_dict=False, **inputs)[0]
        target = pipe._pack_latents(noise - x0, b, c, h, w)
        expected = (prediction - target).pow(2).mean(dim=(1, 2))
        loss = family.loss(pipe.transformer, _batch(x0, encoded), noise, sigmas)
        # The other conventions give other numbers: the test can tell them apart.
        flipped = (prediction + target).pow(2).mean(dim=(1, 2))
        wrong_time = pipe.transformer(hidden_states=packed, timestep=1 - t / 1000, return_dict=False, **inputs)[0]
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    assert (flipped - expected).abs().min() > 1e-2
    assert ((wrong_time - target).pow(2).mean(dim=(1, 2)) - expected).abs().max() > 1e-4


def test_the_velocity_target_steps_along_the_path(pipe: Any) -> None:
    """The pipeline's Euler step with the prediction ``noise - x0`` moves ``x_sigma`` exactly to ``x_sigma'``."""
    scheduler = pipe.scheduler
    x0 = _latents(pipe)
    noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(2))
    scheduler.set_timesteps(sigmas=[1.0, 0.75, 0.5, 0.25], mu=0.0)
    t, t_next = scheduler.timesteps[1:2], scheduler.timesteps[2:3]
    here = scheduler.scale_noise(x0, t, noise)
    scheduler._step_index = None  # a fresh step from timestep t
    stepped = scheduler.step(noise - x0, t, here, return_dict=False)[0]
    torch.testing.assert_close(stepped, scheduler.scale_noise(x0, t_next, noise))


def test_krea_shift_is_the_pipelines_shift(pipe: Any) -> None:
    """``krea_shift`` draws logit-normal sigmas and moves them as ``Krea2Pipeline`` moves its schedule for this image
    size: ``time_shift(mu)`` with its ``calculate_shift`` of the scheduler config (2.47 at 1024x1024); a fixed
    ``shift`` replaces it, 1 being the plain draw."""
    config = pipe.scheduler.config
    family = Krea2()

    def mu(tokens: int) -> float:
        return float(
            calculate_shift(
                tokens, config.base_image_seq_len, config.max_image_seq_len, config.base_shift, config.max_shift
            )
        )

    for tokens in (256, 1024, 4096, 6400):
        assert family.resolution_shift(tokens) == pytest.approx(math.exp(mu(tokens)))
    assert family.resolution_shift(64 * 64) == pytest.approx(2.47, abs=0.01)  # 1024x1024 pixels
    latents = torch.zeros(1, 1, 1, 1).expand(512, 16, 128, 128)  # 1024x1024: 4096 tokens, no memory
    draw = torch.sigmoid(torch.randn(512, generator=torch.Generator().manual_seed(7)))
    expected = pipe.scheduler.time_shift(mu(4096), 1.0, draw).clamp(1e-4, 1 - 1e-4)
    torch.testing.assert_close(family.sample_timesteps(latents, torch.Generator().manual_seed(7)), expected)
    plain = Krea2(timestep_sampling="logit_normal").sample_timesteps(latents, torch.Generator().manual_seed(7))
    torch.testing.assert_close(Krea2(shift=1.0).sample_timesteps(latents, torch.Generator().manual_seed(7)), plain)
    assert expected.mean() > plain.mean() + 0.05  # shifted towards noise


def test_bad_options_name_the_option() -> None:
    with pytest.raises(ConfigError, match=r"model\.family\.init_args\.shift"):
        Krea2(shift=0.0)
    with pytest.raises(ConfigError, match=r"model\.family\.init_args\.max_sequence_length"):
        Krea2(max_sequence_length=4)


# -- text and images -----------------------------------------------------------------------------------------------


def test_cached_captions_are_the_pipelines_valid_tokens(pipe: Any, encoded: dict[str, torch.Tensor]) -> None:
    """The cache holds, per prompt, exactly the pipeline's valid text tokens (12 tapped layers each), in order, first;
    zeros after them, a bool mask; the prompt's words and the template's 5 closing tokens."""
    embeds, mask = pipe.encode_prompt(PROMPTS, max_sequence_length=LENGTH)
    assert encoded["prompt_embeds"].shape == (2, LENGTH, 12, pipe.text_encoder.config.text_config.hidden_size)
    assert encoded["prompt_mask"].dtype == torch.bool
    for i in range(2):
        n = int(mask[i].sum())
        assert encoded["prompt_mask"][i].tolist() == [True] * n + [False] * (LENGTH - n)
        torch.testing.assert_close(encoded["prompt_embeds"][i, :n], embeds[i][mask[i]])
        assert (encoded["prompt_embeds"][i, n:] == 0).all()
    assert encoded["prompt_mask"].sum(1).tolist() == [12 + 5, 2 + 5]  # one token per tiny caption word
    ours, kept = compact_text(embeds, mask)
    assert torch.equal(ours, encoded["prompt_embeds"]) and torch.equal(kept, encoded["prompt_mask"])


def test_prompt_limit_is_where_the_pipeline_cuts(pipe: Any) -> None:
    """A caption is reported as cut exactly when the pipeline's encoding drops some of its tokens."""
    family = Krea2(max_sequence_length=16)
    limit = family.prompt_limit(pipe)
    assert limit.tokens == 16 - 5 and "Qwen3-VL" in str(limit)
    prompts = [" ".join(["cat"] * n) for n in (10, 11, 12)]
    _, mask = pipe.encode_prompt(prompts, max_sequence_length=16)
    assert limit.truncated(prompts) == [int(m.sum()) - 5 < n for m, n in zip(mask, (10, 11, 12), strict=True)]
    assert limit.truncated(prompts) == [False, False, True]


def test_each_prompt_trains_as_if_alone(pipe: Any, encoded: dict[str, torch.Tensor]) -> None:
    """The loss cuts a batch's cached text back to its longest prompt and masks the shorter ones: each sample's loss is
    what it is in a batch of one, where no padding and no mask reach the transformer."""
    family = Krea2(max_sequence_length=LENGTH)
    x0 = _latents(pipe)
    seen: list[tuple[int, torch.Tensor | None]] = []
    hook = pipe.transformer.register_forward_pre_hook(
        lambda m, args, kw: seen.append((kw["encoder_hidden_states"].shape[1], kw["encoder_attention_mask"])),
        with_kwargs=True,
    )
    noise, sigmas = torch.randn(x0.shape, generator=torch.Generator().manual_seed(4)), torch.tensor([0.4, 0.6])
    try:
        with torch.no_grad():
            both = family.loss(pipe.transformer, _batch(x0, encoded), noise, sigmas)
            alone = [
                family.loss(
                    pipe.transformer,
                    _batch(x0[i : i + 1], {k: v[i : i + 1] for k, v in encoded.items()}),
                    noise[i : i + 1],
                    sigmas[i : i + 1],
                )
                for i in range(2)
            ]
    finally:
        hook.remove()
    torch.testing.assert_close(both, torch.cat(alone), atol=1e-6, rtol=1e-5)
    lengths = encoded["prompt_mask"].sum(dim=1).tolist()
    (n, mask), *singles = seen
    assert n == max(lengths) < LENGTH and mask is not None and mask.sum(dim=1).tolist() == lengths
    assert [(length, m) for length, m in singles] == [(length, None) for length in lengths]


def test_positions_are_the_pipelines() -> None:
    torch.testing.assert_close(position_ids(7, 3, 5), Krea2Pipeline.prepare_position_ids(7, 3, 5, torch.device("cpu")))


def test_latents_are_normalized_as_the_pipeline_decodes(pipe: Any) -> None:
    """``Krea2Pipeline`` decodes ``x * std + mean`` per channel (one frame of the video VAE): that is the VAE's own
    mean."""
    pixels = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(3)) * 2 - 1
    latents = Krea2().encode_images(pipe.vae, pixels)
    config = pipe.vae.config
    with torch.no_grad():
        z = pipe.vae.encode(pixels.unsqueeze(2)).latent_dist.mode()[:, :, 0]
    std, mean = (torch.tensor(v).view(1, -1, 1, 1) for v in (config.latents_std, config.latents_mean))
    torch.testing.assert_close(latents * std + mean, z)
    assert latents.shape == (1, config.z_dim, 4, 4) and latents.dtype == torch.float32


def test_the_text_cache_key_covers_the_caption_length(model_dir: Path, tmp_path: Path) -> None:
    from lightning_lora.data.cache import LatentCache

    source = ModelSource(str(model_dir))
    keys = {LatentCache(tmp_path, Krea2(max_sequence_length=n), source).text_key("a cat") for n in (64, 512)}
    assert len(keys) == 2


# -- sampling and distillation -------------------------------------------------------------------------------------


def test_samples_are_the_pipelines_images(source: ModelSource, pipe: Any, encoded: dict[str, torch.Tensor]) -> None:
    """The family's generate from cached text is ``pipe(prompt, guidance_scale=...)``: without guidance (Turbo's way)
    and with Krea's classifier-free guidance, the empty prompt as the negative (another length than the prompt's);
    guidance needs the negative."""
    import numpy as np

    family = Krea2(max_sequence_length=LENGTH)
    sampler = family.pipeline(family.load_denoiser(source), family.load_vae(source), source)
    negative = family.encode_prompts(pipe, [""])
    prompt = {k: v[:1] for k, v in encoded.items()}
    for scale in (0.0, 3.5):
        ours = family.generate(sampler, prompt, SampleSettings(3, 32, 32, 2, scale), negative=negative)
        theirs = pipe(
            PROMPTS[0],
            guidance_scale=scale,
            generator=torch.Generator().manual_seed(3),
            max_sequence_length=LENGTH,
            height=32,
            width=32,
            num_inference_steps=2,
        ).images[0]
        difference = np.abs(np.asarray(ours, dtype=np.int16) - np.asarray(theirs, dtype=np.int16))
        assert difference.max() <= 1, scale
    with pytest.raises(ConfigError, match="guidance_scale"):
        family.generate(sampler, prompt, SampleSettings(3, 32, 32, 2, 3.5))


def test_turbo_is_the_distilled_model(model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Offline, with nothing downloaded: Turbo is the family's distilled model (``architecture.distilled_models``) and
    Raw is not; a folder says it in its ``model_index.json``, and the sampling pipeline draws with that schedule."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    family = Krea2()
    assert family.architecture.distilled_models == (TURBO,)
    assert family.is_distilled(ModelSource(TURBO)) and not family.is_distilled(ModelSource(RAW))
    assert not family.is_distilled(ModelSource(str(model_dir)))
    turbo = tmp_path / "turbo"
    turbo.mkdir()
    index = json.loads((model_dir / "model_index.json").read_text())
    (turbo / "model_index.json").write_text(json.dumps({**index, "is_distilled": True}))
    assert family.pipeline_options(ModelSource(str(turbo))) == {"is_distilled": True}


def test_a_model_with_other_text_layers_is_refused(model_dir: Path, tmp_path: Path) -> None:
    """The text cache holds Krea 2's 12 taps: a model whose ``model_index.json`` taps others is refused, naming them."""
    import shutil

    other = tmp_path / "other"
    shutil.copytree(model_dir, other)
    index = json.loads((other / "model_index.json").read_text())
    (other / "model_index.json").write_text(json.dumps({**index, "text_encoder_select_layers": list(range(12))}))
    with pytest.raises(ConfigError, match=r"model\.pretrained: .*taps the text encoder's layers \[0, 1"):
        Krea2().load_text_encoders(ModelSource(str(other)))


# -- LoRA ----------------------------------------------------------------------------------------------------------


def _linear_names(model: torch.nn.Module) -> set[str]:
    return {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def test_lora_presets(pipe: Any) -> None:
    names = _linear_names(pipe.transformer)

    def matches(preset: str) -> set[str]:
        return {n for n in names if re.fullmatch(Krea2.architecture.lora_presets[preset], n)}

    blocks = [f"transformer_blocks.{i}" for i in range(2)]
    text_blocks = [f"text_fusion.{kind}_blocks.{i}" for kind in ("layerwise", "refiner") for i in range(2)]
    attention = {f"{b}.attn.{p}" for b in blocks for p in ("to_q", "to_k", "to_v", "to_gate", "to_out.0")}
    ff = {f"{b}.ff.{p}" for b in blocks for p in ("gate", "up", "down")}
    assert matches("attention") == attention
    assert matches("attention_ff") == attention | ff
    assert matches("all_linear") == names  # every linear layer, Krea's default (musubi-tuner's 264 at full size)
    assert {n for n in names if n.startswith(tuple(text_blocks))} < matches("all_linear")


def test_comfyui_targets_every_linear_layer(pipe: Any) -> None:
    """ComfyUI's Krea 2 key map (``krea2_to_diffusers``) has an entry for every linear layer of the model, each onto the
    original weight of the same tensor (:func:`diffusers_to_original`, checked against diffusers' own converter in
    ``test_single_file_transformer``)."""
    original = diffusers_to_original(pipe.transformer.state_dict())
    for name in _linear_names(pipe.transformer):
        target = comfy_target(name)
        assert target is not None, name
        assert torch.equal(original[target], pipe.transformer.get_submodule(name).weight), name
    assert comfy_target("transformer_blocks.0.attn.norm_q") is None
    assert comfy_target("transformer_blocks.0.attn.to_q") == "blocks.0.attn.wq.weight"


def test_krea_files_are_told_by_their_names(pipe: Any) -> None:
    """A LoRA file of Krea 2's names (diffusers', Krea's original ones, musubi-tuner's ``lora_unet_``) is Krea 2's for
    every family's claim, even without our metadata; another family's file is not."""
    from lightning_lora.export import _family_from_keys

    t = torch.zeros(1)
    for key in (
        "transformer.transformer_blocks.0.attn.to_gate.lora_A.weight",
        "transformer.text_fusion.refiner_blocks.1.ff.up.lora_B.weight",
        "diffusion_model.blocks.3.attn.wq.lora_A.weight",
        "lora_unet_blocks_3_mlp_down.lora_down.weight",
        "lora_unet_txtfusion_layerwise_blocks_0_attn_wk.alpha",
    ):
        assert _family_from_keys({key: t}) is Krea2, key
    assert Krea2.claims_lora_keys({"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": t}) == 0
    assert Krea2.claims_lora_keys({"transformer.layers.0.feed_forward.w1.lora_A.weight": t}) == 0  # Z-Image


# -- loading -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["original", "comfy", "diffusers"])
def test_single_file_transformer(tmp_path: Path, model_dir: Path, layout: str) -> None:
    """The single files people download (Krea's ``raw.safetensors`` names, ComfyUI's ``model.diffusion_model.``
    prefix) and a file in diffusers' names load through diffusers' ``from_single_file``, the rest from the folder."""
    reference = Krea2Transformer2DModel.from_pretrained(model_dir, subfolder="transformer").state_dict()
    weights = {
        "original": lambda: diffusers_to_original(reference),
        "comfy": lambda: diffusers_to_original(reference, prefix="model.diffusion_model."),
        "diffusers": lambda: reference,
    }[layout]()
    file = tmp_path / "raw.safetensors"
    save_file({k: v.contiguous() + 0.5 for k, v in weights.items()}, file)  # the file's weights, not the folder's
    source = ModelSource(str(model_dir), denoiser_file=str(file), dtype=torch.float32)
    Krea2().check_source(source)
    loaded = Krea2().load_denoiser(source).state_dict()
    assert loaded.keys() == reference.keys()
    for key, value in loaded.items():
        torch.testing.assert_close(value, reference[key] + 0.5, msg=key)


def test_local_folder_and_wrong_family(source: ModelSource, tiny_qwenimage_dir: Path) -> None:
    family = Krea2()
    family.check_source(source)
    encoders = family.load_text_encoders(source)
    assert not encoders.text_encoder.training and not any(p.requires_grad for p in encoders.text_encoder.parameters())
    with pytest.raises(ConfigError, match=r"model\.pretrained: .* holds a QwenImagePipeline.*Krea2Pipeline"):
        family.check_source(ModelSource(str(tiny_qwenimage_dir)))


def test_the_tiny_pipeline_is_deterministic() -> None:
    from lightning_lora.tiny.krea2 import build_tiny_krea2

    a: Any = build_tiny_krea2(seed=0)
    b = build_tiny_krea2(seed=0)
    for name in ("transformer", "text_encoder", "vae"):
        sa, sb = getattr(a, name).state_dict(), getattr(b, name).state_dict()
        assert all(torch.equal(sa[k], sb[k]) for k in sa), name
    assert a.text_encoder.config.text_config.num_hidden_layers == 36  # the pipeline taps the real layers


# -- memory plan ---------------------------------------------------------------------------------------------------


def test_the_hub_models_plan_the_real_sizes_with_nothing_downloaded() -> None:
    """``plan`` on the hub ids needs no file (the family contract checks it plans as a folder of the same configs);
    the shipped transformer config is diffusers' defaults (Krea's reference code's, see ``KREA2_TRANSFORMER``) and the
    sizes are the real model's: a 12.8 B transformer, Qwen3-VL-4B's 4.44 B (4.02 B of it the text model)."""
    import inspect

    from lightning_lora.model.recipe import ModelRecipe
    from lightning_lora.plan import caching_peaks, weight_bytes
    from lightning_lora.precision import BF16

    defaults = inspect.signature(Krea2Transformer2DModel.__init__).parameters
    for key, value in KREA2_TRANSFORMER.items():
        if key != "_class_name":
            default = defaults[key].default
            assert value == (list(default) if isinstance(default, tuple) else default), key
    known = Krea2.planning
    assert known.known_denoisers[TURBO] == known.known_denoisers[RAW]  # Turbo is Raw distilled: one architecture
    assert known.known_text_encoders[TURBO] == known.known_text_encoders[RAW]
    family, hub = Krea2(), ModelSource(RAW)
    assert weight_bytes(family.denoiser_skeleton(hub), BF16()) / 2 == pytest.approx(12.820e9, rel=1e-3)  # 2 bytes each
    recipe = ModelRecipe(family, hub, LoraOptions(rank=8))
    text, _, host, notes = caching_peaks(recipe, "none", 4, 1024)
    assert host * 2**30 / 2 == pytest.approx(4.438e9, rel=1e-3) and text > host and not notes
    assert caching_peaks(recipe, "nf4", 4, 1024)[0] < 0.5 * text
