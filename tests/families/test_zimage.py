"""The Z-Image family: its objective against the pipeline's own components (scheduler, timestep convention, sign),
cached caption features, latents, LoRA presets and files, loading (folder, single files), and the real model's sizes
from the hub id with nothing downloaded. What every family must do (offloading, text-encoder quantization, hub ids
offline...) is the family contract's (test_contract.py).

Model-level facts these tests pin (diffusers 0.42.1, ``pipelines/z_image/pipeline_z_image.py``): the pipeline feeds
the transformer ``(1000 - t) / 1000`` for a scheduler timestep ``t = 1000 * sigma`` and negates its output before
``FlowMatchEulerDiscreteScheduler.step``; captions are Qwen3's second-to-last hidden states of the chat-templated
prompt, masked to the real tokens.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from diffusers import ZImagePipeline, ZImageTransformer2DModel
from peft.utils import get_peft_model_state_dict
from safetensors.torch import load_file, save_file

from lightning_lora.errors import ConfigError
from lightning_lora.export import export_lora, read_metadata
from lightning_lora.families import ModelSource, ZImage
from lightning_lora.formats.nextdit import comfy_target, diffusers_to_original
from lightning_lora.lora import LoraOptions, peft_config, resolve_targets

PROMPT = "a photo of sks cat"
HUB_ID = "Tongyi-MAI/Z-Image-Turbo"


@pytest.fixture(scope="module")
def pipe(tiny_zimage_dir: Path) -> ZImagePipeline:
    """The pipeline's own components, loaded from the saved tiny folder."""
    pipe = ZImagePipeline.from_pretrained(tiny_zimage_dir)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _latents(pipe: ZImagePipeline, seed: int = 0) -> torch.Tensor:
    pixels = torch.rand(2, 3, 32, 48, generator=torch.Generator().manual_seed(seed)) * 2 - 1
    return ZImage().encode_images(pipe.vae, pixels)


# -- the objective -------------------------------------------------------------------------------------------------


def test_loss_is_the_pipelines_own_flow_matching_objective(pipe: ZImagePipeline) -> None:
    """Noised by the pipeline's scheduler at two of its timesteps, fed ``(1000 - t) / 1000`` as ``__call__`` does, the
    negated output (the pipeline's ``noise_pred``) against the velocity ``noise - x0``: our loss, per sample."""
    family, scheduler = ZImage(), pipe.scheduler
    x0 = _latents(pipe)
    noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(1))
    scheduler.set_timesteps(sigmas=[1.0, 0.75, 0.5, 0.25], mu=0.0)  # Turbo: static shift 3, mu unused
    t = scheduler.timesteps[[1, 2]]
    sigmas = scheduler.sigmas[[1, 2]]
    with torch.no_grad():
        noisy = torch.cat([scheduler.scale_noise(x0[i : i + 1], t[i : i + 1], noise[i : i + 1]) for i in range(2)])
        captions, _ = pipe.encode_prompt([PROMPT, ""], do_classifier_free_guidance=False)
        out = pipe.transformer(list(noisy.unsqueeze(2).unbind(0)), (1000 - t) / 1000, captions, return_dict=False)[0]
        noise_pred = -torch.stack(out).squeeze(2)
        expected = (noise_pred - (noise - x0)).pow(2).mean(dim=(1, 2, 3))
        batch = {"latents": x0, **family.encode_prompts(pipe, [PROMPT, ""])}
        loss = family.loss(pipe.transformer, batch, noise, sigmas)
        # The other conventions give other numbers: the test can tell them apart.
        wrong_time = pipe.transformer(list(noisy.unsqueeze(2).unbind(0)), sigmas, captions, return_dict=False)[0]
        wrong_time_loss = (torch.stack(wrong_time).squeeze(2) - (x0 - noise)).pow(2).mean(dim=(1, 2, 3))
        wrong_sign_loss = (-noise_pred - (noise - x0)).pow(2).mean(dim=(1, 2, 3))  # the output as the velocity
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    assert (wrong_time_loss - expected).abs().max() > 1e-3 and (wrong_sign_loss - expected).abs().max() > 1e-1


def test_the_velocity_target_steps_along_the_path(pipe: ZImagePipeline) -> None:
    """The pipeline's Euler step with ``noise_pred = noise - x0`` (our target, negated) moves ``x_sigma`` exactly to
    ``x_sigma'``: the sign convention of the target is the scheduler's."""
    scheduler = pipe.scheduler
    x0 = _latents(pipe)
    noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(2))
    scheduler.set_timesteps(sigmas=[1.0, 0.75, 0.5, 0.25], mu=0.0)
    t, t_next = scheduler.timesteps[1:2], scheduler.timesteps[2:3]
    here = scheduler.scale_noise(x0, t, noise)
    scheduler._step_index = None  # a fresh step from timestep t
    stepped = scheduler.step(noise - x0, t, here, return_dict=False)[0]
    torch.testing.assert_close(stepped, scheduler.scale_noise(x0, t_next, noise))


def test_timesteps_use_the_static_shift() -> None:
    """Z-Image's scheduler shifts by a constant (no image-size dependence); shift 1 is the plain logit-normal draw."""
    small, large = (torch.zeros(1, 1, 1, 1).expand(4000, 16, side, side) for side in (32, 128))  # no memory
    family = ZImage(shift=3.0)
    a = family.sample_timesteps(small, torch.Generator().manual_seed(0))
    b = family.sample_timesteps(large, torch.Generator().manual_seed(0))
    torch.testing.assert_close(a, b)
    plain = ZImage(timestep_sampling="logit_normal").sample_timesteps(small, torch.Generator().manual_seed(0))
    assert a.mean() > plain.mean() + 0.1
    torch.testing.assert_close(ZImage(shift=1.0).sample_timesteps(small, torch.Generator().manual_seed(0)), plain)


def test_bad_options_name_the_option() -> None:
    with pytest.raises(ConfigError, match=r"model\.family\.init_args\.shift"):
        ZImage(shift=0.0)
    with pytest.raises(ConfigError, match=r"model\.family\.init_args\.max_sequence_length"):
        ZImage(max_sequence_length=8)


# -- text and images -----------------------------------------------------------------------------------------------


def test_cached_captions_are_the_pipelines(pipe: ZImagePipeline) -> None:
    """Padded to max_sequence_length with a mask, the cached features give back exactly the pipeline's per-prompt
    features (Qwen3's second-to-last layer of the chat-templated prompt), zeros past each caption."""
    from lightning_lora.families.zimage import caption_features

    prompts = [PROMPT, "", "a close up portrait of a young woman in red"]
    family = ZImage(max_sequence_length=32)
    cached = family.encode_prompts(pipe, prompts)
    assert cached["prompt_embeds"].shape == (3, 32, pipe.text_encoder.config.hidden_size)
    assert cached["prompt_mask"].dtype == torch.bool
    theirs, _ = pipe.encode_prompt(list(prompts), do_classifier_free_guidance=False, max_sequence_length=32)
    ours = caption_features(cached["prompt_embeds"], cached["prompt_mask"], "cpu", torch.float32)
    for mine, reference in zip(ours, theirs, strict=True):
        torch.testing.assert_close(mine, reference)
    assert (cached["prompt_embeds"][~cached["prompt_mask"]] == 0).all()
    lengths = cached["prompt_mask"].sum(1).tolist()
    assert lengths[1] == 8 and lengths[0] == 8 + 5  # the template's 8 tokens, and one per caption word here


def test_prompt_limit_counts_the_chat_template(pipe: ZImagePipeline) -> None:
    """A caption is reported as cut exactly when the pipeline's templated tokens exceed max_sequence_length."""
    family = ZImage(max_sequence_length=16)
    limit = family.prompt_limit(pipe)
    assert limit.tokens == 16 - 8 and "Qwen3" in str(limit)
    prompts = [" ".join(["cat"] * n) for n in (7, 8, 9)]
    templated = [
        pipe.tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True, enable_thinking=True
        )
        for p in prompts
    ]
    cut = [len(ids) > 16 for ids in pipe.tokenizer(templated).input_ids]
    assert limit.truncated(prompts) == cut == [False, False, True]


def test_latents_are_normalized_as_the_pipeline_decodes(pipe: ZImagePipeline) -> None:
    """``ZImagePipeline`` decodes ``latents / scaling_factor + shift_factor``: that is the VAE's own mean."""
    pixels = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(3)) * 2 - 1
    latents = ZImage().encode_images(pipe.vae, pixels)
    with torch.no_grad():
        z = pipe.vae.encode(pixels).latent_dist.mode()
    config = pipe.vae.config
    torch.testing.assert_close(latents / config.scaling_factor + config.shift_factor, z)
    assert latents.shape == (1, 16, 4, 4) and latents.dtype == torch.float32


def test_the_text_cache_key_covers_the_caption_length(tiny_zimage_dir: Path, tmp_path: Path) -> None:
    from lightning_lora.data.cache import LatentCache

    source = ModelSource(str(tiny_zimage_dir))
    keys = {LatentCache(tmp_path, ZImage(max_sequence_length=n), source).text_key(PROMPT) for n in (64, 512)}
    assert len(keys) == 2


# -- LoRA ----------------------------------------------------------------------------------------------------------


def _linear_names(model: torch.nn.Module) -> set[str]:
    return {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def test_lora_presets(pipe: ZImagePipeline) -> None:
    t = pipe.transformer
    names = _linear_names(t)

    def matches(preset: str) -> set[str]:
        return {n for n in names if re.fullmatch(ZImage.architecture.lora_presets[preset], n)}

    blocks = ["noise_refiner.0", "context_refiner.0", "layers.0", "layers.1"]
    attention = {f"{b}.attention.{p}" for b in blocks for p in ("to_q", "to_k", "to_v", "to_out.0")}
    ff = {f"{b}.feed_forward.{w}" for b in blocks for w in ("w1", "w2", "w3")}
    modulation = {f"{b}.adaLN_modulation.0" for b in blocks if not b.startswith("context")}  # no modulation there
    assert attention | ff | modulation <= names
    assert matches("attention") == attention
    assert matches("attention_ff") == attention | ff
    assert matches("all_linear") == attention | ff | modulation
    assert not any("embedder" in n or "final_layer" in n for n in matches("all_linear"))


def _adapted(pipe: ZImagePipeline, targets: str) -> tuple[torch.nn.Module, LoraOptions]:
    family, model = ZImage(), ZImageTransformer2DModel.from_config(pipe.transformer.config)
    model.load_state_dict(pipe.transformer.state_dict())
    options = LoraOptions(rank=4, alpha=2.0, targets=targets)
    model.add_adapter(peft_config(options, resolve_targets(targets, family, model)))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=generator))
    return model.eval(), options


def test_the_diffusers_file_loads_with_no_key_left_over(
    pipe: ZImagePipeline, tiny_zimage_dir: Path, tmp_path: Path
) -> None:
    """``ZImagePipeline.load_lora_weights`` puts every tensor of the file into the transformer's adapter (nothing
    unexpected, nothing missing), the scale folded so that the model computes what was trained; and the file carries
    the ModelSpec kohya's musubi-tuner writes for Z-Image and says it loads in diffusers (ComfyUI maps its names only
    in the releases with its Z-Image rule: the ComfyUI-layout file is the one every release loads)."""
    family = ZImage()
    model, options = _adapted(pipe, "all_linear")
    state = get_peft_model_state_dict(model)
    path = export_lora(state, tmp_path / "z.safetensors", format="diffusers", lora=options, family=family, info={})
    tensors = load_file(path)
    assert all(k.startswith("transformer.") for k in tensors)
    fresh = ZImagePipeline.from_pretrained(tiny_zimage_dir)
    fresh.load_lora_weights(path, adapter_name="z")
    loaded = {n: p for n, p in fresh.transformer.named_parameters() if ".lora_" in n}
    assert len(loaded) == len(tensors)
    for key, tensor in tensors.items():
        module, ab, _ = key.removeprefix("transformer.").rsplit(".", 2)
        torch.testing.assert_close(loaded[f"{module}.{ab}.z.weight"], tensor)
    inputs = {
        "x": list(torch.randn(1, 16, 1, 4, 4, generator=torch.Generator().manual_seed(4)).unbind(0)),
        "t": torch.tensor([0.3]),
        "cap_feats": [torch.randn(5, model.config.cap_feat_dim, generator=torch.Generator().manual_seed(5))],
        "return_dict": False,
    }
    with torch.no_grad():
        torch.testing.assert_close(fresh.transformer(**inputs)[0][0], model(**inputs)[0][0], rtol=1e-4, atol=1e-5)
    meta = read_metadata(path)
    assert meta["modelspec.architecture"] == "Z-Image/lora"
    assert meta["modelspec.implementation"] == "https://github.com/Tongyi-MAI/Z-Image"
    assert json.loads(meta["lightning_lora.loads_in"]) == ["diffusers"]
    comfy = export_lora(
        state, tmp_path / "z.comfyui.safetensors", format="comfyui", lora=options, family=family, info={}
    )
    assert json.loads(read_metadata(comfy)["lightning_lora.loads_in"]) == ["ComfyUI"]
    assert all(k.startswith("diffusion_model.") for k in load_file(comfy))
    adapter = json.loads(meta["lora_adapter_metadata"])
    assert adapter["transformer.r"] == 4 and adapter["transformer.lora_alpha"] == 4  # alpha / rank folded into B


def test_layers_outside_the_blocks_and_files_made_elsewhere(
    pipe: ZImagePipeline, tiny_zimage_dir: Path, tmp_path: Path
) -> None:
    """Custom targets outside the blocks (embedders, final layer) load in diffusers as trained, the diffusers file
    says diffusers applies it and the ComfyUI-layout file that every ComfyUI release does; a Z-Image file without our
    metadata (made elsewhere) is still read as Z-Image."""
    from lightning_lora.export import file_coverage, read_lora_file

    outside = ["all_x_embedder.2-1", "cap_embedder.1", "t_embedder.mlp.0", "all_final_layer.2-1.adaLN_modulation.1"]
    model, options = _adapted(pipe, outside)
    state = get_peft_model_state_dict(model)
    family = ZImage()
    coverage = file_coverage(state, family, "diffusers")
    assert coverage.exact("diffusers") and not coverage.exact("ComfyUI") and not coverage.exact("kohya")
    assert file_coverage(state, family, "comfyui").loads_in == ["ComfyUI"]
    path = export_lora(state, tmp_path / "o.safetensors", format="diffusers", lora=options, family=family, info={})
    fresh = ZImagePipeline.from_pretrained(tiny_zimage_dir)
    fresh.load_lora_weights(path)
    for name in outside:  # the merged weight of each layer is the trained one
        got, want = fresh.transformer.get_submodule(name), model.get_submodule(name)
        got.merge(), want.merge()
        torch.testing.assert_close(got.base_layer.weight, want.base_layer.weight, msg=name)
    bare = tmp_path / "bare.safetensors"
    save_file(load_file(path), bare)  # the tensors, no metadata
    assert read_lora_file(bare).family.name == "zimage"


def _deltas(path: Path) -> dict[str, torch.Tensor]:
    """Each layer's update ``B @ A`` in a diffusers-layout file (the scale folded into ``B``)."""
    tensors = load_file(path)
    modules = {k.removeprefix("transformer.").rsplit(".", 2)[0] for k in tensors}
    return {m: tensors[f"transformer.{m}.lora_B.weight"] @ tensors[f"transformer.{m}.lora_A.weight"] for m in modules}


def test_the_export_command_writes_and_reads_the_comfyui_file(
    pipe: ZImagePipeline, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``lightning-lora export --format comfyui`` turns a Z-Image diffusers file into the ComfyUI-layout file (every
    ComfyUI release), and that back into a diffusers file with the same update in every layer (q/k/v out of the fused
    ``qkv``); a FLUX file asked for the ComfyUI layout is one line naming the formats FLUX writes, and no file."""
    from lightning_lora.cli.export import main as export_main

    model, options = _adapted(pipe, "all_linear")
    state = get_peft_model_state_dict(model)
    path = export_lora(state, tmp_path / "z.safetensors", format="diffusers", lora=options, family=ZImage(), info={})
    comfy, back = tmp_path / "z.comfyui.safetensors", tmp_path / "back.safetensors"
    assert export_main([str(path), "--format", "comfyui", "--out", str(comfy)]) == 0
    assert "applies every layer as trained in: ComfyUI" in capsys.readouterr().out
    assert all(k.startswith("diffusion_model.") for k in load_file(comfy))
    assert any(".attention.qkv." in k for k in load_file(comfy))
    assert export_main([str(comfy), "--format", "diffusers", "--out", str(back)]) == 0
    want, got = _deltas(path), _deltas(back)
    assert got.keys() == want.keys()
    for module, delta in want.items():
        torch.testing.assert_close(got[module], delta, atol=1e-6, rtol=1e-5, msg=module)

    flux = tmp_path / "flux.safetensors"
    save_file(
        {"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": torch.ones(2, 64)}
        | {"transformer.transformer_blocks.0.attn.to_q.lora_B.weight": torch.ones(64, 2)},
        flux,
    )
    out = tmp_path / "flux.comfyui.safetensors"
    assert export_main([str(flux), "--format", "comfyui", "--out", str(out), "--family", "flux"]) == 2
    err = capsys.readouterr().err
    assert "comfyui" in err and "kohya" in err and "\n" not in err.strip() and not out.exists()


def test_comfyui_targets_every_linear_layer(pipe: ZImagePipeline) -> None:
    """ComfyUI's Z-Image key map (``z_image_to_diffusers``) has an entry for every linear layer of the model, q/k/v
    on their thirds of the fused ``qkv`` (whose rows the original file holds in that order)."""
    dim = pipe.transformer.config.dim
    original = diffusers_to_original(pipe.transformer.state_dict())
    for name in _linear_names(pipe.transformer):
        target = comfy_target(name, dim)
        assert target is not None, name
        weight, rows = target
        if rows is None:
            assert original[weight].shape == pipe.transformer.get_submodule(name).weight.shape
        else:
            part = original[weight][rows[0] : rows[0] + rows[1]]
            assert torch.equal(part, pipe.transformer.get_submodule(name).weight), name
    assert comfy_target("layers.0.attention.norm_q", dim) is None


# -- memory options ------------------------------------------------------------------------------------------------


# -- the tiny pipeline ---------------------------------------------------------------------------------------------


def test_the_tiny_pipeline_is_deterministic_and_its_words_are_tokens() -> None:
    from lightning_lora.tiny.shared import CAPTION_WORDS
    from lightning_lora.tiny.zimage import build_tiny_zimage, make_qwen_tokenizer

    a, b = build_tiny_zimage(seed=0), build_tiny_zimage(seed=0)
    for name in ("transformer", "text_encoder", "vae"):
        sa, sb = getattr(a, name).state_dict(), getattr(b, name).state_dict()
        assert all(torch.equal(sa[k], sb[k]) for k in sa), name
    tokenizer = make_qwen_tokenizer()
    for word in CAPTION_WORDS:
        assert len(tokenizer(word).input_ids) == 1 and len(tokenizer(" " + word).input_ids) == 1, word
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [
        tokenizer.pad_token_id,
        len(tokenizer) - 2,
        tokenizer.eos_token_id,
    ]


# -- loading -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["original", "comfy", "diffusers"])
def test_single_file_transformer(tmp_path: Path, tiny_zimage_dir: Path, layout: str) -> None:
    """The single files people download (the original names, ComfyUI's ``model.diffusion_model.`` prefix) and a file
    in diffusers' names load through diffusers' ``from_single_file``, the rest of the pipeline from the folder."""
    reference = ZImageTransformer2DModel.from_pretrained(tiny_zimage_dir, subfolder="transformer").state_dict()
    weights = {
        "original": lambda: diffusers_to_original(reference),
        "comfy": lambda: diffusers_to_original(reference, prefix="model.diffusion_model."),
        "diffusers": lambda: reference,
    }[layout]()
    file = tmp_path / "z_image_turbo_bf16.safetensors"
    save_file({k: v.contiguous() + 0.5 for k, v in weights.items()}, file)  # the file's weights, not the folder's
    source = ModelSource(str(tiny_zimage_dir), denoiser_file=str(file), dtype=torch.float32)
    ZImage().check_source(source)
    loaded = ZImage().load_denoiser(source).state_dict()
    assert loaded.keys() == reference.keys()
    for key, value in loaded.items():
        torch.testing.assert_close(value, reference[key] + 0.5, msg=key)


def test_local_folder_and_wrong_family(tiny_zimage_dir: Path, tiny_flux_dir: Path) -> None:
    family, source = ZImage(), ModelSource(str(tiny_zimage_dir), dtype=torch.float32)
    family.check_source(source)
    denoiser = family.load_denoiser(source)
    assert not any(p.requires_grad for p in denoiser.parameters()) and not denoiser.training
    encoders = family.load_text_encoders(source)
    assert not encoders.text_encoder.training and encoders.tokenizer.chat_template
    with pytest.raises(ConfigError, match=r"model\.pretrained: .* holds a FluxPipeline pipeline.*ZImagePipeline"):
        family.check_source(ModelSource(str(tiny_flux_dir)))


# -- memory plan ---------------------------------------------------------------------------------------------------


def test_the_hub_model_plans_the_real_sizes_with_nothing_downloaded() -> None:
    """``plan`` on the hub id needs no file (the family contract checks it plans as a folder of the same configs) and
    the sizes are the real model's: 6.15 B transformer, 4.02 B Qwen3-4B encoder."""
    from lightning_lora.data.recipe import DataRecipe
    from lightning_lora.model.recipe import ModelRecipe
    from lightning_lora.plan import caching_peaks, plan_for

    data = DataRecipe(resolutions=(512,), batch_size=1)
    lora = LoraOptions(rank=8)
    hub = ModelRecipe(ZImage(), ModelSource(HUB_ID), lora, gradient_checkpointing=True)
    from_hub = plan_for(hub, data)
    assert from_hub.weights * 2**30 / 2 == pytest.approx(6.1549e9, rel=1e-3)  # bf16: 2 bytes a parameter
    text = {mode: caching_peaks(hub, mode, 4, 1024)[0] for mode in ("none", "nf4")}
    assert text["none"] == pytest.approx(4.0225e9 * 2 / 2**30 + 4 * 512 * 2560 * 106 / 2**30 + 0.35, rel=1e-3)
    assert text["nf4"] < 0.5 * text["none"]
