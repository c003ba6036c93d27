"""The Qwen-Image family against the pipeline's own components, on the tiny pipeline.

Independent witnesses: ``QwenImagePipeline`` (``encode_prompt`` with its template and dropped tokens,
``_pack_latents`` / ``_unpack_latents``, ``calculate_shift``, its decode's latent de-normalisation), its
``FlowMatchEulerDiscreteScheduler`` (``time_shift``), diffusers' training recipe for Qwen-Image
(``train_dreambooth_lora_qwen_image.py``: noising, the ``t / 1000`` timestep, the ``noise - x0`` target), diffusers'
Qwen-Image LoRA loader (``load_lora_weights``, its kohya converter) and ``from_single_file``. The contract test
(test_contract.py) covers fitting, exact resume and the files in a fresh pipeline; test_samples.py the sample images;
test_lora_files.py what each tool applies of each file.
"""

from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path

import pytest
import torch
from diffusers import QwenImagePipeline
from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift
from helpers import denoiser_output, lora_layers, lora_model, random_inputs
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict
from safetensors.torch import load_file, save_file
from torch.utils.data import default_collate

from lightning_lora.errors import ConfigError
from lightning_lora.export import export_lora, read_lora_file
from lightning_lora.families import QwenImage
from lightning_lora.families.base import ModelSource, SampleSettings
from lightning_lora.families.qwenimage import QWEN_IMAGE_TRANSFORMER, pack_latents, unpack_latents
from lightning_lora.lora import LoraOptions

PROMPTS = ["a photo of sks cat with a red mug on the table", "a dog"]  # different lengths: a mask in the batch
MAX_LEN = 64


@pytest.fixture(scope="module")
def source(tiny_qwenimage_dir: Path) -> ModelSource:
    return ModelSource(str(tiny_qwenimage_dir), dtype=torch.float32)


@pytest.fixture(scope="module")
def pipe(tiny_qwenimage_dir: Path) -> QwenImagePipeline:
    pipe = QwenImagePipeline.from_pretrained(tiny_qwenimage_dir)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def encoded(source: ModelSource) -> dict[str, torch.Tensor]:
    family = QwenImage(max_sequence_length=MAX_LEN)
    return family.encode_prompts(family.load_text_encoders(source), PROMPTS)


def _pixels(b: int = 2, h: int = 32, w: int = 48) -> torch.Tensor:
    return torch.rand(b, 3, h, w, generator=torch.Generator().manual_seed(0)) * 2 - 1


# -- the tiny pipeline ---------------------------------------------------------------------------------------------


def test_the_tiny_pipeline_is_seeded_and_leaves_the_global_rng_alone() -> None:
    from lightning_lora.tiny.qwenimage import build_tiny_qwenimage, make_qwen_tokenizer

    state = torch.get_rng_state()
    a, b, other = build_tiny_qwenimage(0), build_tiny_qwenimage(0), build_tiny_qwenimage(1)
    assert torch.equal(torch.get_rng_state(), state)
    for name in ("transformer", "vae", "text_encoder"):
        sa, sb, so = (getattr(p, name).state_dict() for p in (a, b, other))
        assert all(torch.equal(sa[k], sb[k]) for k in sa), name
        assert any(not torch.equal(sa[k], so[k]) for k in sa if sa[k].is_floating_point()), name
    # Token ids are fixed by the word lists (no trainer): the same in any process, every caption word one token.
    tokenizer = make_qwen_tokenizer()
    assert tokenizer("a photo of sks cat").input_ids == a.tokenizer("a photo of sks cat").input_ids
    assert len(tokenizer("a photo of sks cat").input_ids) == 5
    assert (tokenizer.pad_token, tokenizer.eos_token) == ("<|endoftext|>", "<|im_end|>")


# -- latents -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1, 4, 2, 2), (2, 4, 4, 6), (3, 16, 8, 4)])
def test_packing_agrees_with_the_pipeline(shape: tuple[int, int, int, int]) -> None:
    b, c, h, w = shape
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    tokens = pack_latents(x)
    # The pipeline packs [B, 1, C, h, w] latents (one frame) and unpacks to [B, C, 1, h, w] from the pixel size.
    assert torch.equal(tokens, QwenImagePipeline._pack_latents(x.unsqueeze(1), b, c, h, w))
    assert torch.equal(
        unpack_latents(tokens, h, w), QwenImagePipeline._unpack_latents(tokens, 8 * h, 8 * w, 8)[:, :, 0]
    )


def test_image_latents_are_the_vae_mean_normalised_per_channel(source: ModelSource, pipe: QwenImagePipeline) -> None:
    family = QwenImage()
    pixels = _pixels()
    ours = family.encode_images(family.load_vae(source), pixels)
    assert ours.shape == (2, 4, 4, 6) and ours.dtype == torch.float32
    config = pipe.vae.config
    mean = torch.tensor(config.latents_mean).view(1, -1, 1, 1, 1)
    inverse_std = 1.0 / torch.tensor(config.latents_std).view(1, -1, 1, 1, 1)
    assert mean.abs().min() > 0.1 and (inverse_std - 1).abs().min() > 0.1  # the normalisation is not a no-op here
    with torch.no_grad():
        z = pipe.vae.encode(pixels.unsqueeze(2)).latent_dist.mode()  # one frame of the video VAE: [B, C, 1, h, w]
    torch.testing.assert_close(ours, ((z - mean) * inverse_std)[:, :, 0])  # the training script's normalisation
    # ... which the pipeline's decode undoes exactly as it reads its own latents.
    torch.testing.assert_close(ours.unsqueeze(2) / inverse_std + mean, z)


# -- text ----------------------------------------------------------------------------------------------------------


def test_prompts_are_encoded_like_the_pipeline(
    source: ModelSource, pipe: QwenImagePipeline, encoded: dict[str, torch.Tensor]
) -> None:
    embeds, mask = pipe.encode_prompt(PROMPTS, device="cpu", max_sequence_length=MAX_LEN)
    assert mask is not None and embeds.shape[0] == 2
    n = embeds.shape[1]
    assert encoded["prompt_embeds"].shape == (2, MAX_LEN, 64) and encoded["prompt_embeds_mask"].dtype == torch.int64
    torch.testing.assert_close(encoded["prompt_embeds"][:, :n], embeds)
    assert torch.equal(encoded["prompt_embeds_mask"][:, :n], mask) and not encoded["prompt_embeds_mask"][:, n:].any()
    assert not encoded["prompt_embeds"][:, n:].any()
    # Kept: the prompt's tokens and the 5 that close the template; the template's first 34 tokens are dropped (the tiny
    # tokenizer makes every template word one token, as the real one does).
    template, drop = pipe.prompt_template_encode, pipe.prompt_template_encode_start_idx
    assert drop == 34 and len(pipe.tokenizer(template.split("{}")[0]).input_ids) == drop
    lengths = [len(pipe.tokenizer(p).input_ids) + 5 for p in PROMPTS]
    assert encoded["prompt_embeds_mask"].sum(dim=1).tolist() == lengths
    # A prompt encoded alone is what it is in a batch: the cache may encode in batches of any size.
    family = QwenImage(max_sequence_length=MAX_LEN)
    alone = family.encode_prompts(family.load_text_encoders(source), PROMPTS[1:])
    torch.testing.assert_close(alone["prompt_embeds"][0], encoded["prompt_embeds"][1], atol=1e-5, rtol=1e-5)


def test_a_prompt_longer_than_the_limit_is_cut_and_counted(source: ModelSource) -> None:
    family = QwenImage(max_sequence_length=12)
    encoders = family.load_text_encoders(source)
    limit = family.prompt_limit(encoders)
    assert limit.tokens == 12 - 5 and "Qwen2.5-VL" in str(limit)
    long, short = "a photo of sks cat with a red mug on the table", "a photo of sks cat"
    assert limit.truncated([long, short]) == [True, False]
    mask = family.encode_prompts(encoders, [long, short])["prompt_embeds_mask"]
    assert mask.sum(dim=1).tolist() == [12, len(encoders.tokenizer(short).input_ids) + 5]


def test_the_text_cache_key_covers_what_changes_the_embeddings(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_lora.families import qwenimage

    tag = QwenImage().text_cache_tag()
    assert tag == QwenImage(timestep_sampling="uniform").text_cache_tag()  # training options: not the embedding
    assert tag != QwenImage(max_sequence_length=256).text_cache_tag()
    template, drop, limit = qwenimage._template()
    monkeypatch.setattr(qwenimage, "_template", lambda: (template, drop + 1, limit))  # another diffusers release
    assert QwenImage().text_cache_tag() != tag


@pytest.mark.parametrize("mode", ["fp8", "nf4"])
def test_the_text_encoder_in_fp8_or_nf4_for_caching(source: ModelSource, tmp_path: Path, mode: str) -> None:
    """``data.text_encoder_quantization``: Qwen2.5-VL's linear layers stored in 8 / 4 bits while caching (the shared
    mechanism), embeddings close to the plain ones and cached under their own keys."""
    from lightning_lora.data.cache import LatentCache, quantize_text_encoders

    dtype = torch.bfloat16 if mode == "nf4" else torch.float32  # bitsandbytes' CPU 4-bit path computes in bf16
    family, source = QwenImage(max_sequence_length=MAX_LEN), ModelSource(source.pretrained, dtype=dtype)
    plain = family.encode_prompts(family.load_text_encoders(source), PROMPTS)
    encoders = family.load_text_encoders(source)
    swapped = quantize_text_encoders(encoders, QwenImage.architecture.text_encoders, mode, torch.device("cpu"), dtype)
    layers = [type(m).__name__ for m in encoders.text_encoder.model.language_model.modules()]
    assert swapped > 0 and any(name in ("FP8Linear", "AutocastLinear4bit") for name in layers)
    quantized = family.encode_prompts(encoders, PROMPTS)
    a, b = plain["prompt_embeds"].float(), quantized["prompt_embeds"].float()
    assert not torch.equal(a, b) and (a - b).norm() < 0.15 * a.norm()
    assert torch.equal(plain["prompt_embeds_mask"], quantized["prompt_embeds_mask"])
    keys = {m: LatentCache(tmp_path, family, source, m).text_key(PROMPTS[0]) for m in ("none", mode)}
    assert keys["none"] != keys[mode]


# -- the objective -------------------------------------------------------------------------------------------------


def _batch(latents: torch.Tensor, encoded: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A batch as the data module serves it: per-sample cache entries stacked by the default collate."""
    samples = [{"latents": latents[i], **{k: v[i] for k, v in encoded.items()}} for i in range(latents.shape[0])]
    return default_collate(samples)


def test_loss_equals_the_diffusers_recipe(
    source: ModelSource, pipe: QwenImagePipeline, encoded: dict[str, torch.Tensor]
) -> None:
    """Noise ``(1 - s) x0 + s noise``, the transformer fed like the pipeline (packed [B, 1, C, h, w] latents,
    ``t / 1000`` for ``t = 1000 s``, ``img_shapes``, the batch's prompt embeddings and mask), target ``noise - x0``."""
    family = QwenImage(max_sequence_length=MAX_LEN)
    x0 = family.encode_images(family.load_vae(source), _pixels())
    b, c, h, w = x0.shape
    noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(3))
    sigmas = torch.tensor([0.25, 0.8])
    transformer = family.load_denoiser(source)
    embeds, mask = pipe.encode_prompt(PROMPTS, device="cpu", max_sequence_length=MAX_LEN)
    with torch.no_grad():
        ours = family.loss(transformer, _batch(x0, encoded), noise, sigmas)
        s = sigmas.view(-1, 1, 1, 1, 1)
        x, eps = x0.unsqueeze(2), noise.unsqueeze(2)  # [B, C, 1, h, w], as the VAE gives them
        noisy = ((1 - s) * x + s * eps).permute(0, 2, 1, 3, 4)  # [B, 1, C, h, w]
        prediction = pipe.transformer(
            hidden_states=QwenImagePipeline._pack_latents(noisy, b, c, h, w),
            timestep=(sigmas * 1000) / 1000,
            encoder_hidden_states=embeds,
            encoder_hidden_states_mask=mask,
            img_shapes=[[(1, h // 2, w // 2)]] * b,
            return_dict=False,
        )[0]
        prediction = QwenImagePipeline._unpack_latents(prediction, 8 * h, 8 * w, pipe.vae_scale_factor)
        expected = (prediction - (eps - x)).pow(2).mean(dim=(1, 2, 3, 4))
        flipped = (prediction - (x - eps)).pow(2).mean(dim=(1, 2, 3, 4))
    torch.testing.assert_close(ours, expected)
    assert not torch.allclose(ours, flipped)  # the sign convention matters here


def test_each_prompt_trains_as_if_alone(source: ModelSource, encoded: dict[str, torch.Tensor]) -> None:
    """The cached embeddings are padded to max_sequence_length; the loss cuts a batch back to its longest prompt and
    masks the shorter ones: each sample's loss is what it is in a batch of one (no padding, no mask, as the pipeline
    runs a single prompt)."""
    family = QwenImage(max_sequence_length=MAX_LEN)
    x0 = family.encode_images(family.load_vae(source), _pixels())
    transformer = family.load_denoiser(source)
    seen: list[tuple[int, torch.Tensor | None]] = []
    transformer.register_forward_pre_hook(
        lambda m, args, kw: seen.append((kw["encoder_hidden_states"].shape[1], kw["encoder_hidden_states_mask"])),
        with_kwargs=True,
    )
    noise, sigmas = torch.randn(x0.shape, generator=torch.Generator().manual_seed(4)), torch.tensor([0.4, 0.6])
    with torch.no_grad():
        both = family.loss(transformer, _batch(x0, encoded), noise, sigmas)
        alone = [
            family.loss(
                transformer,
                _batch(x0[i : i + 1], {k: v[i : i + 1] for k, v in encoded.items()}),
                noise[i : i + 1],
                sigmas[i : i + 1],
            )
            for i in range(2)
        ]
    torch.testing.assert_close(both, torch.cat(alone), atol=1e-6, rtol=1e-5)
    lengths = encoded["prompt_embeds_mask"].sum(dim=1).tolist()
    (n, mask), *singles = seen
    assert n == max(lengths) < MAX_LEN and mask is not None and mask.sum(dim=1).tolist() == lengths
    assert [(length, m) for length, m in singles] == [(length, None) for length in lengths]


def test_qwen_shift_is_the_schedulers_shift(pipe: QwenImagePipeline) -> None:
    """``qwen_shift`` draws logit-normal sigmas and moves them as Qwen-Image's scheduler moves its schedule for this
    image size: ``time_shift(mu)`` with the pipeline's ``calculate_shift`` of the scheduler config."""
    config = pipe.scheduler.config
    family = QwenImage()
    for tokens in (256, 1024, 4096, 8192):
        mu = calculate_shift(
            tokens, config.base_image_seq_len, config.max_image_seq_len, config.base_shift, config.max_shift
        )
        assert family.resolution_shift(tokens) == pytest.approx(math.exp(mu))
    assert family.resolution_shift(64 * 64) == pytest.approx(2.0, abs=0.01)  # 1024x1024 pixels
    latents = torch.zeros(512, 16, 128, 128)  # 1024x1024: 4096 tokens
    mu = calculate_shift(4096, config.base_image_seq_len, config.max_image_seq_len, config.base_shift, config.max_shift)
    draw = torch.sigmoid(torch.randn(512, generator=torch.Generator().manual_seed(7)))
    expected = pipe.scheduler.time_shift(mu, 1.0, draw).clamp(1e-4, 1 - 1e-4)
    torch.testing.assert_close(family.sample_timesteps(latents, torch.Generator().manual_seed(7)), expected)
    plain = QwenImage(timestep_sampling="logit_normal").sample_timesteps(latents, torch.Generator().manual_seed(7))
    fixed = QwenImage(shift=1.0).sample_timesteps(latents, torch.Generator().manual_seed(7))
    torch.testing.assert_close(fixed, plain)
    assert expected.mean() > plain.mean() + 0.05  # shifted towards noise


def test_options_are_validated() -> None:
    with pytest.raises(ConfigError, match=r"max_sequence_length: 2048 .*1024"):
        QwenImage(max_sequence_length=2048)
    with pytest.raises(ConfigError, match=r"init_args\.shift"):
        QwenImage(shift=0.0)


# -- sampling ------------------------------------------------------------------------------------------------------


def test_samples_are_the_pipelines_images(
    source: ModelSource, pipe: QwenImagePipeline, encoded: dict[str, torch.Tensor]
) -> None:
    """The family's generate from cached embeddings (padded) is ``pipe(prompt, negative_prompt="", true_cfg_scale)``;
    guidance above 1 needs the negative."""
    import numpy as np

    family = QwenImage(max_sequence_length=MAX_LEN)
    sampler = family.pipeline(family.load_denoiser(source), family.load_vae(source), source)
    negative = family.encode_prompts(family.load_text_encoders(source), [""])
    prompt = {k: v[:1] for k, v in encoded.items()}
    draw = {"height": 32, "width": 32, "num_inference_steps": 2}
    for scale in (1.0, 4.0):
        ours = family.generate(sampler, prompt, SampleSettings(3, 32, 32, 2, scale), negative=negative)
        theirs = pipe(
            PROMPTS[0],
            negative_prompt="" if scale > 1 else None,
            true_cfg_scale=scale,
            generator=torch.Generator().manual_seed(3),
            max_sequence_length=MAX_LEN,
            **draw,
        ).images[0]
        difference = np.abs(np.asarray(ours, dtype=np.int16) - np.asarray(theirs, dtype=np.int16))
        assert difference.max() <= 1, scale
    with pytest.raises(ValueError, match="negative"):
        family.generate(sampler, prompt, SampleSettings(3, 32, 32, 2, 4.0))


# -- LoRA ----------------------------------------------------------------------------------------------------------


def _matches(preset: str, model: torch.nn.Module) -> set[str]:
    regex = re.compile(QwenImage.architecture.lora_presets[preset])
    return {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and regex.fullmatch(n)}


def test_lora_presets(source: ModelSource) -> None:
    model = QwenImage().load_denoiser(source)
    blocks = range(2)
    image = {f"transformer_blocks.{i}.attn.{p}" for i in blocks for p in ("to_q", "to_k", "to_v", "to_out.0")}
    text_kv = {f"transformer_blocks.{i}.attn.{p}" for i in blocks for p in ("add_k_proj", "add_v_proj")}
    mlp = {f"transformer_blocks.{i}.img_mlp.net.{p}" for i in blocks for p in ("0.proj", "2")}
    assert _matches("attention", model) == image
    assert _matches("attention_all", model) == image | text_kv
    assert _matches("all_linear", model) == image | text_kv | mlp


def test_the_last_blocks_text_outputs_do_not_reach_the_image(source: ModelSource) -> None:
    """Why the presets leave the text stream's query, output and MLP out: the transformer's output is its image tokens,
    so in the last block they get no gradient (in the others they do)."""
    family = QwenImage()
    model = family.load_denoiser(source)
    layers = ["attn.add_q_proj", "attn.to_add_out", "txt_mlp.net.0.proj", "txt_mlp.net.2"]
    targets = [f"transformer_blocks.{i}.{layer}" for i in range(2) for layer in layers]
    model.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=targets, init_lora_weights="gaussian"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(generator=torch.Generator().manual_seed(0))
    model(**random_inputs(family, model, 1))[0].square().mean().backward()
    for name, p in model.named_parameters():
        if "lora_A" in name:
            reaches = p.grad is not None and bool(p.grad.abs().sum() > 0)
            assert reaches == name.startswith("transformer_blocks.0."), name


@pytest.mark.parametrize(("checkpointing", "every"), [(False, 1), (True, 1), (True, 2)])
def test_checkpointing_and_offloading_train_the_same_gradients(
    tiny_qwenimage_dir: Path, checkpointing: bool, every: int
) -> None:
    """The repository's block mechanisms on Qwen-Image's dual-stream blocks (their text mask and rotary embedding pass
    through as block inputs): recomputed and offloaded blocks give the plain model's gradients."""
    from helpers import build_tiny, two_step_grads

    family = QwenImage()
    plain = two_step_grads(build_tiny(tiny_qwenimage_dir, 0, family=family), family)
    with pytest.warns(UserWarning, match="offload_blocks: 2 saves no weight memory"):  # the tiny model has 2 blocks
        model = build_tiny(tiny_qwenimage_dir, 2, checkpointing, every, family=family)
    assert len(model._lora_offloader.blocks) == 2
    for before, after in zip(plain, two_step_grads(model, family), strict=True):
        assert before.keys() == after.keys()
        for name, grad in before.items():
            assert grad.abs().max() > 0, name
            torch.testing.assert_close(after[name], grad)


def test_the_diffusers_file_loads_with_no_key_left_over(
    tiny_qwenimage_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``QwenImagePipeline.load_lora_weights`` makes one adapter tensor of every tensor of the file (and nothing else),
    with the trained values, and the pipeline's transformer gives the trained model's output; the kohya file
    (musubi-tuner's layout, read by diffusers' own converter) too."""
    family = QwenImage()
    trained = lora_model(family, tiny_qwenimage_dir, "all_linear", alpha=2.0)  # alpha / rank = 0.5: a scale to fold
    state = get_peft_model_state_dict(trained)
    options = LoraOptions(rank=4, alpha=2.0, targets="all_linear")
    inputs = random_inputs(family, trained, 1)
    expected = denoiser_output(trained, inputs)
    for fmt in ("diffusers", "kohya"):
        path = export_lora(state, tmp_path / f"{fmt}.safetensors", format=fmt, lora=options, family=family, info={})  # type: ignore[arg-type]
        file = load_file(path)
        pipe = QwenImagePipeline.from_pretrained(tiny_qwenimage_dir)
        with caplog.at_level(logging.WARNING):
            pipe.load_lora_weights(path)
        assert not [r for r in caplog.records if "key" in r.getMessage().lower()], caplog.text
        loaded = {n: p for n, p in pipe.transformer.named_parameters() if ".lora_" in n}
        weights = [k for k in file if not k.endswith(".alpha")]  # a kohya file's alphas are folded in by diffusers
        assert len(loaded) == len(weights) and lora_layers(pipe.transformer) == lora_layers(trained)
        torch.testing.assert_close(denoiser_output(pipe.transformer, inputs), expected, atol=1e-5, rtol=1e-4)
        if fmt == "diffusers":  # the same tensors, the scale folded into lora_B
            for key, value in file.items():
                module, kind = re.fullmatch(r"transformer\.(.+)\.(lora_[AB])\.weight", key).groups()  # type: ignore[union-attr]
                torch.testing.assert_close(loaded[f"{module}.{kind}.default_0.weight"], value)
        meta = read_lora_file(path)
        assert meta.family.name == "qwenimage" and meta.layout == fmt


def test_an_attention_only_file_is_not_taken_for_flux(tiny_qwenimage_dir: Path, tmp_path: Path) -> None:
    """FLUX and Qwen-Image name their joint-attention layers alike: a file of those alone is read as the family it
    names (or the one ``--family`` gives), not guessed to be FLUX."""
    family = QwenImage()
    trained = lora_model(family, tiny_qwenimage_dir, "attention")
    state = get_peft_model_state_dict(trained)
    path = export_lora(
        state, tmp_path / "a.safetensors", format="diffusers", lora=LoraOptions(rank=4), family=family, info={}
    )  # type: ignore[arg-type]
    assert read_lora_file(path, family).family.name == "qwenimage"
    bare = tmp_path / "bare.safetensors"
    save_file(load_file(path), bare, metadata={"lora_adapter_metadata": json.dumps({})})  # no family metadata
    with pytest.raises(ConfigError, match="cannot tell which model family"):
        read_lora_file(bare)
    assert read_lora_file(bare, family).family.name == "qwenimage"


# -- loading and planning ------------------------------------------------------------------------------------------


def _reference(folder: Path) -> dict[str, torch.Tensor]:
    from diffusers import QwenImageTransformer2DModel

    return QwenImageTransformer2DModel.from_pretrained(folder, subfolder="transformer").state_dict()


@pytest.mark.parametrize("prefix", ["", "model.diffusion_model."])
def test_single_file_transformer(tiny_qwenimage_dir: Path, tmp_path: Path, prefix: str) -> None:
    """A transformer file in diffusers' (= ComfyUI's) names, bare or inside a ComfyUI checkpoint's prefix."""
    reference = _reference(tiny_qwenimage_dir)
    file = tmp_path / "qwen_image_bf16.safetensors"
    save_file({prefix + k: (v + 0.5).contiguous() for k, v in reference.items()}, file)
    source = ModelSource(str(tiny_qwenimage_dir), denoiser_file=str(file), dtype=torch.float32)
    QwenImage().check_source(source)
    loaded = QwenImage().load_denoiser(source).state_dict()
    assert loaded.keys() == reference.keys()
    for key, value in loaded.items():
        torch.testing.assert_close(value, reference[key] + 0.5, msg=key)


@pytest.mark.parametrize("damage", ["scaled fp8", "missing", "another model"])
def test_a_single_file_of_other_weights_is_refused(tiny_qwenimage_dir: Path, tmp_path: Path, damage: str) -> None:
    """diffusers would load such a file with a log line (unknown keys dropped, missing weights left empty)."""
    weights = {k: v.contiguous() for k, v in _reference(tiny_qwenimage_dir).items()}
    if damage == "scaled fp8":
        weights["transformer_blocks.0.attn.to_q.scale_weight"] = torch.ones(1)
    elif damage == "missing":
        del weights["proj_out.weight"]
    else:
        weights = {"double_blocks.0.img_attn.qkv.weight": torch.zeros(4, 4)}
    file = tmp_path / "transformer.safetensors"
    save_file(weights, file)
    source = ModelSource(str(tiny_qwenimage_dir), denoiser_file=str(file), dtype=torch.float32)
    with pytest.raises(ConfigError, match=r"model\.denoiser_file: .* is not a Qwen-Image transformer"):
        QwenImage().load_denoiser(source)


def test_a_folder_of_another_family_is_refused(tiny_flux_dir: Path) -> None:
    with pytest.raises(ConfigError, match=r"model\.pretrained.*FluxPipeline.*model\.family"):
        QwenImage().check_source(ModelSource(str(tiny_flux_dir)))


def test_the_hub_model_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    source = ModelSource("Qwen/Qwen-Image")
    QwenImage().check_source(source)
    with pytest.raises(ConfigError, match=r"model\.pretrained.*Qwen/Qwen-Image.*offline"):
        QwenImage().load_vae(source)


def test_the_shipped_architecture_plans_like_a_local_folder(tmp_path: Path) -> None:
    """``lightning-lora plan`` of Qwen/Qwen-Image needs no download: the shipped transformer and Qwen2.5-VL configs are
    the real ones (20.4 B and 8.3 B parameters), and a local folder holding those configs is read as the same model.
    (tests/cli/test_plan_anywhere.py plans the shipped configs, which name the hub id, offline.)"""
    import inspect

    from diffusers import QwenImageTransformer2DModel

    from lightning_lora.model.recipe import ModelRecipe
    from lightning_lora.plan import caching_peaks, weight_bytes
    from lightning_lora.precision import BF16

    # diffusers' defaults are Qwen-Image's transformer config (its docs load "Qwen/QwenImage-20B" with them).
    defaults = inspect.signature(QwenImageTransformer2DModel.__init__).parameters
    for key, value in QWEN_IMAGE_TRANSFORMER.items():
        if key != "_class_name":
            default = defaults[key].default
            assert value == (list(default) if isinstance(default, tuple) else default), key
    hub_id, family = "Qwen/Qwen-Image", QwenImage()
    folder = tmp_path / "local"
    (folder / "transformer").mkdir(parents=True)
    (folder / "text_encoder").mkdir()
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "QwenImagePipeline"}))
    (folder / "transformer" / "config.json").write_text(json.dumps(QwenImage.planning.known_denoisers[hub_id]))
    encoder = QwenImage.planning.known_text_encoders[hub_id]["text_encoder"]
    config = {"architectures": [encoder["_class"]], **{k: v for k, v in encoder.items() if k != "_class"}}
    (folder / "text_encoder" / "config.json").write_text(json.dumps(config))
    hub, local = ModelSource(hub_id), ModelSource(str(folder))
    shipped, read = (family.denoiser_config(s, QwenImageTransformer2DModel.load_config) for s in (hub, local))
    assert {k: read[k] for k in shipped} == shipped
    from_folder = (family.text_encoder_configs(local) or {})["text_encoder"]
    assert {k: v for k, v in from_folder.items() if k != "architectures"} == encoder
    weights = weight_bytes(family.denoiser_skeleton(hub), BF16())
    assert weights / 2 == pytest.approx(20.43e9, rel=2e-3)  # bf16: 2 bytes per weight
    text, _, host, notes = caching_peaks(ModelRecipe(family, hub, LoraOptions(rank=8)), "none", 4, 1024)
    assert host * 2**30 / 2 == pytest.approx(8.29e9, rel=2e-3) and text > host and not notes  # Qwen2.5-VL-7B, known


def test_images_cache_with_channels_last_inputs(source: ModelSource, photos_dir: Path, tmp_path: Path) -> None:
    """On CUDA the cache feeds NHWC (channels-last) pixels and converts the VAE to it; Qwen-Image's video VAE has 5-D
    convolution weights, which that layout cannot hold: they stay as they are, and the latents are the same."""
    from lightning_lora.data.buckets import BucketSpec
    from lightning_lora.data.build import DataSpec, missing_jobs, plan
    from lightning_lora.data.cache import ImageIndex, LatentCache
    from lightning_lora.data.sources import ImageFolder, scan

    items, _ = scan([ImageFolder(str(photos_dir))])
    latents = []
    for channels_last in (False, True):
        cache = LatentCache(tmp_path / str(channels_last), QwenImage(), source)
        spec = DataSpec(BucketSpec((32,), 16, max_aspect=3.0, min_resolution=16))
        entries, _ = plan(cache, items[:2], spec, ImageIndex(cache.root))
        jobs, _ = missing_jobs(cache, entries)
        assert cache.encode_latents(jobs, torch.device("cpu"), channels_last=channels_last).written == 2
        latents.append([cache.load_latents(e.latent_key)["latents"] for e in entries])
    for plain, nhwc in zip(*latents, strict=True):
        torch.testing.assert_close(nhwc, plain)
