"""The FLUX.2 family: its objective against the pipeline's own components (scheduler, packing, position ids, timestep
convention), cached text and latents against the pipeline's, its timestep shift, LoRA presets and files, loading
(folder, single files, the klein/dev variant), and the real models' sizes from the hub ids with nothing downloaded (what
every family must do is the family contract's, test_contract.py, which runs dev too). klein's tests run on the tiny
``Flux2KleinPipeline``; the ``dev`` tests (at the end) repeat the ones where dev differs on the tiny ``Flux2Pipeline``:
the guidance input, Mistral3's text with its system message, its tokenizer folder, LoRA files loaded by
``Flux2Pipeline``, single files.

Model-level facts these tests pin (diffusers 0.42.1, ``pipelines/flux2/pipeline_flux2_klein.py`` and
``pipeline_flux2.py``): the pipeline feeds the transformer ``t / 1000`` for a scheduler timestep ``t = 1000 sigma`` and
steps with its output as the velocity; latents are the VAE's mean, patchified 2x2 and batch-normalised; captions are
three layers' hidden states (Qwen3's 9/18/27; dev: Mistral3's 10/20/30) of the chat-templated prompt padded to
``max_sequence_length``, every position kept; dev's guidance is a float32 input of the scale, ``guidance_scale``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from diffusers import Flux2KleinPipeline, Flux2Pipeline, Flux2Transformer2DModel
from peft.utils import get_peft_model_state_dict
from safetensors.torch import load_file, save_file

from lightning_lora.errors import ConfigError
from lightning_lora.export import export_lora, read_lora_file, read_metadata
from lightning_lora.families import Flux2, ModelSource
from lightning_lora.families.flux2 import empirical_mu
from lightning_lora.formats.bfl import flux2_diffusers_to_bfl as diffusers_to_bfl
from lightning_lora.lora import LoraOptions, peft_config, resolve_targets

PROMPT = "a photo of sks cat"
HUB_ID = "black-forest-labs/FLUX.2-klein-4B"
LENGTH = 32  # text tokens in these tests (the template is 13 of them)


@pytest.fixture(scope="module")
def pipe(tiny_flux2_dir: Path) -> Flux2KleinPipeline:
    """The pipeline's own components, loaded from the saved tiny folder."""
    pipe = Flux2KleinPipeline.from_pretrained(tiny_flux2_dir)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _pixels(seed: int = 0, batch: int = 2) -> torch.Tensor:
    return torch.rand(batch, 3, 32, 48, generator=torch.Generator().manual_seed(seed)) * 2 - 1


# -- the objective -------------------------------------------------------------------------------------------------


def test_loss_is_the_pipelines_own_flow_matching_objective(pipe: Flux2KleinPipeline) -> None:
    """Noised by the pipeline's scheduler at two of its timesteps, packed and positioned by the pipeline's own
    helpers, fed ``t / 1000`` as ``__call__`` does: its prediction against the velocity ``noise - x0`` is our loss,
    per sample."""
    family, scheduler = Flux2(max_sequence_length=LENGTH), pipe.scheduler
    x0 = family.encode_images(pipe.vae, _pixels())
    noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(1))
    scheduler.set_timesteps(sigmas=[1.0, 0.75, 0.5, 0.25], mu=1.3)
    t, sigmas = scheduler.timesteps[[1, 2]], scheduler.sigmas[[1, 2]]
    with torch.no_grad():
        noisy = torch.cat([scheduler.scale_noise(x0[i : i + 1], t[i : i + 1], noise[i : i + 1]) for i in range(2)])
        embeds, txt_ids = pipe.encode_prompt([PROMPT, ""], max_sequence_length=LENGTH)

        def predict(timestep: torch.Tensor) -> torch.Tensor:
            return pipe.transformer(
                hidden_states=pipe._pack_latents(noisy),
                timestep=timestep,
                guidance=None,
                encoder_hidden_states=embeds,
                txt_ids=txt_ids,
                img_ids=pipe._prepare_latent_ids(noisy),
                return_dict=False,
            )[0]

        target = pipe._pack_latents(noise - x0)
        expected = (predict(t / 1000) - target).pow(2).mean(dim=(1, 2))
        batch = {"latents": x0, **family.encode_prompts(pipe, [PROMPT, ""])}
        loss = family.loss(pipe.transformer, batch, noise, sigmas)
        # Other conventions give other numbers: the test can tell them apart.
        wrong_time = (predict(t) - target).pow(2).mean(dim=(1, 2))  # the scheduler's timestep, not / 1000
        wrong_sign = (predict(t / 1000) + target).pow(2).mean(dim=(1, 2))  # x0 - noise
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    assert (wrong_time - expected).abs().max() > 1e-3 and (wrong_sign - expected).abs().max() > 1e-2


def test_the_velocity_target_steps_along_the_path(pipe: Flux2KleinPipeline) -> None:
    """The scheduler's Euler step with ``noise - x0`` (our target) moves ``x_sigma`` exactly to ``x_sigma'``."""
    scheduler = pipe.scheduler
    x0 = Flux2().encode_images(pipe.vae, _pixels(1))
    noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(2))
    scheduler.set_timesteps(sigmas=[1.0, 0.75, 0.5, 0.25], mu=1.3)
    t, t_next = scheduler.timesteps[1:2], scheduler.timesteps[2:3]
    here = scheduler.scale_noise(x0, t, noise)
    scheduler._step_index = None  # a fresh step from timestep t
    stepped = scheduler.step(noise - x0, t, here, return_dict=False)[0]
    torch.testing.assert_close(stepped, scheduler.scale_noise(x0, t_next, noise))


def test_timesteps_follow_the_pipelines_shift() -> None:
    """``empirical_mu`` is the pipeline's ``compute_empirical_mu``; ``flux2_shift`` moves the draw by ``exp(mu)`` of the
    batch's image tokens (more for larger images, and for fewer inference steps); a fixed shift of 1 is the plain
    logit-normal draw."""
    from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu

    for tokens in (64, 1024, 4096, 4300, 4301, 16384):
        for steps in (1, 4, 28, 50, 200):
            assert empirical_mu(tokens, steps) == pytest.approx(compute_empirical_mu(tokens, steps), abs=1e-9)
    small, large = (torch.zeros(1, 1, 1, 1).expand(4000, 128, side, side) for side in (32, 64))  # no memory
    draw = lambda family, x: family.sample_timesteps(x, torch.Generator().manual_seed(0))  # noqa: E731
    a, b = draw(Flux2(), small), draw(Flux2(), large)
    assert b.mean() > a.mean() + 0.02
    assert draw(Flux2(inference_steps=4), small).mean() > a.mean() + 0.01
    plain = draw(Flux2(timestep_sampling="logit_normal"), small)
    assert a.mean() > plain.mean() + 0.2
    torch.testing.assert_close(draw(Flux2(shift=1.0), small), plain)
    torch.testing.assert_close(draw(Flux2(shift=3.0), small), draw(Flux2(shift=3.0), large))


def test_bad_options_name_the_option() -> None:
    with pytest.raises(ConfigError, match=r"model\.family\.init_args\.shift"):
        Flux2(shift=0.0)
    with pytest.raises(ConfigError, match=r"model\.family\.init_args\.max_sequence_length"):
        Flux2(max_sequence_length=8)
    with pytest.raises(ConfigError, match=r"model\.family\.init_args\.variant"):
        Flux2(variant="pro")  # type: ignore[arg-type]


# -- text and images -----------------------------------------------------------------------------------------------


def test_cached_text_is_the_pipelines(pipe: Flux2KleinPipeline) -> None:
    """The cached embeddings are exactly the pipeline's ``encode_prompt`` (three stacked Qwen3 layers, every padded
    position), and each prompt's alone."""
    prompts = [PROMPT, "", "a close up portrait of a young woman in red"]
    cached = Flux2(max_sequence_length=LENGTH).encode_prompts(pipe, prompts)
    assert cached.keys() == {"prompt_embeds"}
    assert cached["prompt_embeds"].shape == (3, LENGTH, 3 * pipe.text_encoder.config.hidden_size)
    theirs, _ = pipe.encode_prompt(prompts, max_sequence_length=LENGTH)
    torch.testing.assert_close(cached["prompt_embeds"], theirs)
    alone = Flux2(max_sequence_length=LENGTH).encode_prompts(pipe, [prompts[2]])["prompt_embeds"]
    torch.testing.assert_close(alone[0], theirs[2])


def test_prompt_limit_counts_the_chat_template(pipe: Flux2KleinPipeline) -> None:
    family = Flux2(max_sequence_length=64)  # the tiny vocabulary spells <think> out: a longer template than Qwen3's
    limit = family.prompt_limit(pipe)
    assert "Qwen3" in str(limit)
    prompts = [" ".join(["cat"] * n) for n in range(limit.tokens - 1, limit.tokens + 2)]
    templated = [
        pipe.tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True, enable_thinking=False
        )
        for p in prompts
    ]
    cut = [len(ids) > 64 for ids in pipe.tokenizer(templated).input_ids]
    assert limit.truncated(prompts) == cut == [False, False, True]


def test_latents_are_the_pipelines(pipe: Flux2KleinPipeline) -> None:
    """Our latents are the pipeline's ``_encode_vae_image`` (mean, patchified, batch-normalised), and its decoding path
    (de-normalise, unpatchify) gives back the VAE's own posterior mean."""
    pixels = _pixels(3, batch=1)
    latents = Flux2().encode_images(pipe.vae, pixels)
    assert latents.shape == (1, 4 * pipe.vae.config.latent_channels, 2, 3) and latents.dtype == torch.float32
    with torch.no_grad():
        torch.testing.assert_close(latents, pipe._encode_vae_image(pixels, generator=None))
        z = pipe.vae.encode(pixels).latent_dist.mode()
    bn = pipe.vae.bn
    assert bn.running_mean.abs().max() > 0.1  # the tiny VAE's statistics are not the identity
    denormalized = latents * torch.sqrt(bn.running_var.view(1, -1, 1, 1) + pipe.vae.config.batch_norm_eps)
    denormalized = denormalized + bn.running_mean.view(1, -1, 1, 1)
    torch.testing.assert_close(pipe._unpatchify_latents(denormalized), z)


def test_the_text_cache_key_covers_length_and_variant(tiny_flux2_dir: Path, tmp_path: Path) -> None:
    from lightning_lora.data.cache import LatentCache

    source = ModelSource(str(tiny_flux2_dir))
    families = [Flux2(max_sequence_length=64), Flux2(max_sequence_length=512), Flux2(variant="dev")]
    assert len({LatentCache(tmp_path, f, source).text_key(PROMPT) for f in families}) == 3


# -- LoRA ----------------------------------------------------------------------------------------------------------


def _linear_names(model: torch.nn.Module) -> set[str]:
    return {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def test_lora_presets(pipe: Flux2KleinPipeline) -> None:
    names = _linear_names(pipe.transformer)

    def matches(preset: str) -> set[str]:
        return {n for n in names if re.fullmatch(Flux2.architecture.lora_presets[preset], n)}

    double = [f"transformer_blocks.{i}" for i in range(2)]
    single = {f"single_transformer_blocks.{i}.attn.{p}" for i in range(2) for p in ("to_qkv_mlp_proj", "to_out")}
    image = {f"{b}.attn.{p}" for b in double for p in ("to_q", "to_k", "to_v", "to_out.0")}
    text = {f"{b}.attn.{p}" for b in double for p in ("add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")}
    mlp = {f"{b}.{ff}.{p}" for b in double for ff in ("ff", "ff_context") for p in ("linear_in", "linear_out")}
    assert image | text | mlp | single <= names
    assert matches("attention") == image | single
    assert matches("attention_all") == image | text | single
    assert matches("all_linear") == image | text | mlp | single
    assert not any("modulation" in n or "embed" in n for n in matches("all_linear"))


def _adapted(pipe: Flux2KleinPipeline, targets: str | list[str]) -> tuple[torch.nn.Module, LoraOptions]:
    family = Flux2()
    model = Flux2Transformer2DModel.from_config(pipe.transformer.config)
    model.load_state_dict(pipe.transformer.state_dict())
    options = LoraOptions(rank=4, alpha=2.0, targets=targets)
    model.add_adapter(peft_config(options, resolve_targets(targets, family, model)))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=generator))
    return model.eval(), options


def _inputs(model: torch.nn.Module) -> dict[str, object]:
    from lightning_lora.families.flux2 import image_ids, text_ids

    g = torch.Generator().manual_seed(4)
    return {
        "hidden_states": torch.randn(1, 6, model.config.in_channels, generator=g),
        "encoder_hidden_states": torch.randn(1, 5, model.config.joint_attention_dim, generator=g),
        "timestep": torch.tensor([0.3]),
        "img_ids": image_ids(2, 3),
        "txt_ids": text_ids(5),
        "guidance": torch.tensor([3.5]) if model.config.guidance_embeds else None,  # dev's input
        "return_dict": False,
    }


def test_the_diffusers_file_loads_with_no_key_left_over(
    pipe: Flux2KleinPipeline, tiny_flux2_dir: Path, tmp_path: Path
) -> None:
    """``Flux2KleinPipeline.load_lora_weights`` puts every tensor of the file into the transformer's adapter (nothing
    unexpected, nothing missing), the scale folded so that the model computes what was trained; the file carries its
    ModelSpec and is read back as FLUX.2 even without our metadata."""
    family = Flux2()
    model, options = _adapted(pipe, "all_linear")
    state = get_peft_model_state_dict(model)
    path = export_lora(state, tmp_path / "f.safetensors", format="diffusers", lora=options, family=family, info={})
    tensors = load_file(path)
    assert all(k.startswith("transformer.") for k in tensors)
    fresh = Flux2KleinPipeline.from_pretrained(tiny_flux2_dir)
    fresh.load_lora_weights(path, adapter_name="f")
    loaded = {n: p for n, p in fresh.transformer.named_parameters() if ".lora_" in n}
    assert len(loaded) == len(tensors)
    for key, tensor in tensors.items():
        module, ab, _ = key.removeprefix("transformer.").rsplit(".", 2)
        torch.testing.assert_close(loaded[f"{module}.{ab}.f.weight"], tensor)
    with torch.no_grad():
        torch.testing.assert_close(fresh.transformer(**_inputs(model))[0], model(**_inputs(model))[0])
    meta = read_metadata(path)
    assert meta["modelspec.architecture"] == "flux-2/lora"
    assert json.loads(meta["lightning_lora.loads_in"]) == ["diffusers"]
    bare = tmp_path / "bare.safetensors"
    save_file(tensors, bare)  # the tensors, no metadata
    assert read_lora_file(bare).family.name == "flux2"


def test_the_comfyui_file_round_trips(pipe: Flux2KleinPipeline, tiny_flux2_dir: Path, tmp_path: Path) -> None:
    """The ComfyUI layout (``lora_unet_<BFL module>``, q/k/v fused block-diagonally): applied to BFL's weights by
    ComfyUI's rule (the generic ``lora_unet_`` map, ``up @ down * alpha / rank``) and converted back by diffusers' own
    single-file converter, it is the trained model; diffusers' ``load_lora_weights`` reads the same file to the same
    model; and converting it to the diffusers layout and back gives the same file."""
    from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers as to_diffusers

    from lightning_lora.export import convert_lora_file

    family = Flux2()
    model, options = _adapted(pipe, "all_linear")
    state = get_peft_model_state_dict(model)
    path = export_lora(state, tmp_path / "c.kohya.safetensors", format="kohya", lora=options, family=family, info={})
    lora = load_file(path)
    assert "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight" in lora
    assert json.loads(read_metadata(path)["lightning_lora.loads_in"]) == ["diffusers", "ComfyUI"]
    merged = {k: v for k, v in _merged(model).items()}
    bfl = diffusers_to_bfl(pipe.transformer.state_dict())
    for key in {k.rsplit(".", 2)[0] for k in lora}:
        down, up = lora[f"{key}.lora_down.weight"], lora[f"{key}.lora_up.weight"]
        weight = f"{key.removeprefix('lora_unet_')}".replace("_", ".")
        target = next(k for k in bfl if k.replace("_", ".") == f"{weight}.weight")
        bfl[target] = bfl[target] + up @ down * (float(lora[f"{key}.alpha"]) / down.shape[0])
    comfy = to_diffusers(dict(bfl))
    assert comfy.keys() == merged.keys()
    for key, value in merged.items():
        torch.testing.assert_close(comfy[key], value, atol=1e-5, rtol=1e-4, msg=key)
    fresh = Flux2KleinPipeline.from_pretrained(tiny_flux2_dir)
    fresh.load_lora_weights(path)
    with torch.no_grad():
        torch.testing.assert_close(fresh.transformer(**_inputs(model))[0], model(**_inputs(model))[0])
    as_diffusers = convert_lora_file(path, tmp_path / "d.safetensors", format="diffusers")
    again = load_file(convert_lora_file(as_diffusers, tmp_path / "e.kohya.safetensors", format="kohya"))
    assert again.keys() == lora.keys()

    def delta(tensors: dict[str, torch.Tensor], key: str) -> torch.Tensor:
        down, up = tensors[f"{key}.lora_down.weight"], tensors[f"{key}.lora_up.weight"]
        return up @ down * (float(tensors[f"{key}.alpha"]) / down.shape[0])

    for key in {k.rsplit(".", 2)[0] for k in lora}:
        torch.testing.assert_close(delta(again, key), delta(lora, key), atol=1e-6, rtol=1e-5, msg=key)


def _merged(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    import copy

    from peft.tuners.tuners_utils import BaseTunerLayer

    model = copy.deepcopy(model)
    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            module.merge()
    out = {}
    for key, value in model.state_dict().items():
        if "lora_" in key:
            continue
        out[key.replace(".base_layer.", ".")] = value
    return out


# -- memory options ------------------------------------------------------------------------------------------------


# -- the tiny pipeline ---------------------------------------------------------------------------------------------


def test_the_tiny_pipeline_is_deterministic_and_reads_the_real_layers() -> None:
    from lightning_lora.tiny.flux2 import build_tiny_flux2

    a, b = build_tiny_flux2(seed=0), build_tiny_flux2(seed=0)
    for name in ("transformer", "text_encoder", "vae"):
        sa, sb = getattr(a, name).state_dict(), getattr(b, name).state_dict()
        assert all(torch.equal(sa[k], sb[k]) for k in sa), name
    # The pipeline's default layers (9, 18, 27) exist, and 27 is not the normed last one.
    assert a.text_encoder.config.num_hidden_layers > 27
    assert a.transformer.config.joint_attention_dim == 3 * a.text_encoder.config.hidden_size


# -- loading -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["bfl", "comfy", "diffusers"])
def test_single_file_transformer(tmp_path: Path, tiny_flux2_dir: Path, layout: str) -> None:
    """The single files people download (BFL's names, ComfyUI's ``model.diffusion_model.`` prefix) and a file in
    diffusers' names load through diffusers' ``from_single_file``, the rest of the pipeline from the folder."""
    reference = Flux2Transformer2DModel.from_pretrained(tiny_flux2_dir, subfolder="transformer").state_dict()
    weights = {
        "bfl": lambda: diffusers_to_bfl(reference),
        "comfy": lambda: diffusers_to_bfl(reference, prefix="model.diffusion_model."),
        "diffusers": lambda: reference,
    }[layout]()
    file = tmp_path / "flux-2-klein-4b.safetensors"
    save_file({k: v.contiguous() + 0.5 for k, v in weights.items()}, file)  # the file's weights, not the folder's
    source = ModelSource(str(tiny_flux2_dir), denoiser_file=str(file), dtype=torch.float32)
    Flux2().check_source(source)
    loaded = Flux2().load_denoiser(source).state_dict()
    assert loaded.keys() == reference.keys()
    for key, value in loaded.items():
        torch.testing.assert_close(value, reference[key] + 0.5, msg=key)


def test_local_folder_wrong_family_and_wrong_variant(tiny_flux2_dir: Path, tiny_flux_dir: Path, tmp_path: Path) -> None:
    family, source = Flux2(), ModelSource(str(tiny_flux2_dir), dtype=torch.float32)
    family.check_source(source)
    denoiser = family.load_denoiser(source)
    assert not any(p.requires_grad for p in denoiser.parameters()) and not denoiser.training
    encoders = family.load_text_encoders(source)
    assert not encoders.text_encoder.training and encoders.tokenizer.chat_template
    assert not family.is_distilled(source)
    with pytest.raises(ConfigError, match=r"model\.pretrained: .* holds a FluxPipeline pipeline.*Flux2KleinPipeline"):
        family.check_source(ModelSource(str(tiny_flux_dir)))
    dev = tmp_path / "FLUX.2-dev"
    dev.mkdir()
    (dev / "model_index.json").write_text(json.dumps({"_class_name": "Flux2Pipeline"}))
    with pytest.raises(ConfigError, match=r"holds a Flux2Pipeline.*variant: dev"):
        family.check_source(ModelSource(str(dev)))
    Flux2(variant="dev").check_source(ModelSource(str(dev)))
    with pytest.raises(ConfigError, match=r"variant: .*FLUX.2-dev is FLUX.2 dev, not klein; set variant: dev"):
        family.check_source(ModelSource("black-forest-labs/FLUX.2-dev"))


def test_the_klein_hub_ids_say_whether_they_are_distilled(monkeypatch: pytest.MonkeyPatch) -> None:
    """Offline, with nothing downloaded (the family contract checks a hub id is accepted and fails to load clearly):
    the step-distilled klein samples without guidance, the base model with it."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    source = ModelSource(HUB_ID)
    base = ModelSource(HUB_ID.replace("klein-", "klein-base-"))
    assert Flux2().is_distilled(source) and not Flux2().is_distilled(base)


# -- FLUX.2 dev ----------------------------------------------------------------------------------------------------

DEV_LENGTH = 64  # dev's template (<s>, the system message, the turn markers) is 32 tokens of the tiny vocabulary


@pytest.fixture(scope="module")
def dev_pipe(tiny_flux2_dev_dir: Path) -> Flux2Pipeline:
    """The tiny dev pipeline's own components, loaded from its saved folder."""
    pipe = Flux2Pipeline.from_pretrained(tiny_flux2_dev_dir)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_dev_loss_is_the_pipelines_objective_with_its_guidance_input(dev_pipe: Flux2Pipeline) -> None:
    """As klein's, through ``Flux2Pipeline``'s components, with the guidance input the pipeline builds for
    ``guidance_scale`` (float32, one per sample): our loss feeds ``model.family.init_args.guidance``."""
    family, scheduler = Flux2(variant="dev", guidance=3.5, max_sequence_length=DEV_LENGTH), dev_pipe.scheduler
    x0 = family.encode_images(dev_pipe.vae, _pixels())
    noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(1))
    scheduler.set_timesteps(sigmas=[1.0, 0.75, 0.5, 0.25], mu=1.3)
    t, sigmas = scheduler.timesteps[[1, 2]], scheduler.sigmas[[1, 2]]
    with torch.no_grad():
        noisy = torch.cat([scheduler.scale_noise(x0[i : i + 1], t[i : i + 1], noise[i : i + 1]) for i in range(2)])
        embeds, txt_ids = dev_pipe.encode_prompt([PROMPT, ""], max_sequence_length=DEV_LENGTH)

        def predict(timestep: torch.Tensor, scale: float) -> torch.Tensor:
            return dev_pipe.transformer(
                hidden_states=dev_pipe._pack_latents(noisy),
                timestep=timestep,
                guidance=torch.full([1], scale, dtype=torch.float32).expand(2),  # as Flux2Pipeline.__call__
                encoder_hidden_states=embeds,
                txt_ids=txt_ids,
                img_ids=dev_pipe._prepare_latent_ids(noisy),
                return_dict=False,
            )[0]

        target = dev_pipe._pack_latents(noise - x0)
        expected = (predict(t / 1000, 3.5) - target).pow(2).mean(dim=(1, 2))
        batch = {"latents": x0, **family.encode_prompts(dev_pipe, [PROMPT, ""])}
        loss = family.loss(dev_pipe.transformer, batch, noise, sigmas)
        other_guidance = (predict(t / 1000, 1.0) - target).pow(2).mean(dim=(1, 2))
        wrong_time = (predict(t, 3.5) - target).pow(2).mean(dim=(1, 2))
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    assert (other_guidance - expected).abs().max() > 1e-4 and (wrong_time - expected).abs().max() > 1e-3


def test_dev_cached_text_is_the_pipelines(dev_pipe: Flux2Pipeline) -> None:
    """The cached embeddings are ``Flux2Pipeline.encode_prompt``'s (the system message and the prompt through Mistral3,
    layers 10, 20 and 30 stacked, every padded position), and each prompt's alone."""
    prompts = [PROMPT, "", "a close up portrait of a young woman in red"]
    family = Flux2(variant="dev", max_sequence_length=DEV_LENGTH)
    cached = family.encode_prompts(dev_pipe, prompts)
    assert cached.keys() == {"prompt_embeds"}
    assert cached["prompt_embeds"].shape == (3, DEV_LENGTH, 3 * dev_pipe.text_encoder.config.text_config.hidden_size)
    theirs, _ = dev_pipe.encode_prompt(prompts, max_sequence_length=DEV_LENGTH)
    torch.testing.assert_close(cached["prompt_embeds"], theirs)
    alone = family.encode_prompts(dev_pipe, [prompts[2]])["prompt_embeds"]
    torch.testing.assert_close(alone[0], theirs[2])
    klein_layers = dev_pipe.encode_prompt(prompts, max_sequence_length=DEV_LENGTH, text_encoder_out_layers=(9, 18, 27))
    assert not torch.allclose(klein_layers[0], theirs)  # the layers matter: the test would see klein's


def test_dev_prompt_limit_counts_the_system_message(dev_pipe: Flux2Pipeline) -> None:
    """The prompt tokens dev reads are ``max_sequence_length`` less the system turn and the turn markers: a prompt is
    reported cut exactly when the pipeline's templated, tokenized input is longer than that."""
    from diffusers.pipelines.flux2.pipeline_flux2 import format_input

    limit = Flux2(variant="dev", max_sequence_length=DEV_LENGTH).prompt_limit(dev_pipe)
    assert "Mistral" in str(limit) and 0 < limit.tokens < DEV_LENGTH - 30
    # limit.tokens counts the <s> a plain call of the tokenizer adds: a prompt of limit.tokens - 1 words just fits.
    prompts = [" ".join(["cat"] * n) for n in range(limit.tokens - 2, limit.tokens + 1)]
    ids = dev_pipe.tokenizer.apply_chat_template(
        format_input(prompts, system_message=dev_pipe.system_message), tokenize=True, return_dict=True
    )["input_ids"]
    assert limit.truncated(prompts) == [len(i) > DEV_LENGTH for i in ids] == [False, False, True]


def test_dev_local_folder_and_variant(tiny_flux2_dev_dir: Path) -> None:
    """A ``Flux2Pipeline`` folder loads as dev (frozen, in eval mode, the guidance embedder present) and is refused as
    klein with the option to set."""
    family, source = Flux2(variant="dev"), ModelSource(str(tiny_flux2_dev_dir), dtype=torch.float32)
    family.check_source(source)
    denoiser = family.load_denoiser(source)
    assert denoiser.config.guidance_embeds and not denoiser.training
    assert not any(p.requires_grad for p in denoiser.parameters())
    encoders = family.load_text_encoders(source)
    assert type(encoders).__name__ == "Flux2Pipeline" and not encoders.text_encoder.training
    assert not family.is_distilled(source)
    with pytest.raises(ConfigError, match=r"holds a Flux2Pipeline.*variant: dev"):
        Flux2().check_source(source)


def test_dev_reads_the_real_tokenizer_folder_without_torchvision(tiny_flux2_dev_dir: Path, tmp_path: Path) -> None:
    """FLUX.2 dev's ``tokenizer`` folder is a ``PixtralProcessor`` (``processor_config.json``,
    ``preprocessor_config.json``), which transformers 5 builds only with torchvision; the family reads its tokenizer
    and chat template alone and encodes exactly as from the tiny folder. A tokenizer without a chat template is refused
    naming the option."""
    import importlib.util
    import shutil

    from transformers import AutoProcessor

    folder = tmp_path / "FLUX.2-dev"
    shutil.copytree(tiny_flux2_dev_dir, folder)
    index = json.loads((folder / "model_index.json").read_text())
    index["tokenizer"] = ["transformers", "PixtralProcessor"]
    (folder / "model_index.json").write_text(json.dumps(index))
    processor = {"processor_class": "PixtralProcessor", "patch_size": 16, "spatial_merge_size": 2}
    (folder / "tokenizer" / "processor_config.json").write_text(json.dumps(processor))
    image = {"image_processor_type": "PixtralImageProcessorFast", "processor_class": "PixtralProcessor"}
    (folder / "tokenizer" / "preprocessor_config.json").write_text(json.dumps(image))
    if importlib.util.find_spec("torchvision") is None:  # why the family does not load the processor
        with pytest.raises(ImportError, match="Torchvision"):
            AutoProcessor.from_pretrained(folder / "tokenizer")
    family = Flux2(variant="dev", max_sequence_length=DEV_LENGTH)
    got = family.encode_prompts(family.load_text_encoders(ModelSource(str(folder))), [PROMPT])
    tiny = family.load_text_encoders(ModelSource(str(tiny_flux2_dev_dir)))
    torch.testing.assert_close(got["prompt_embeds"], family.encode_prompts(tiny, [PROMPT])["prompt_embeds"])
    (folder / "tokenizer" / "chat_template.jinja").unlink()
    with pytest.raises(ConfigError, match=r"model\.pretrained: .*no chat template"):
        family.load_text_encoders(ModelSource(str(folder)))


@pytest.mark.parametrize("fmt", ["diffusers", "kohya"])
def test_dev_lora_files_load_into_flux2_pipeline(
    dev_pipe: Flux2Pipeline, tiny_flux2_dev_dir: Path, tmp_path: Path, fmt: str
) -> None:
    """``Flux2Pipeline.load_lora_weights`` reads both files (diffusers' names; ComfyUI's BFL names) to the trained
    model's output, guidance input included; the diffusers file's every tensor lands in the adapter, none left over."""
    family = Flux2(variant="dev")
    model, options = _adapted(dev_pipe, "all_linear")
    state = get_peft_model_state_dict(model)
    path = export_lora(state, tmp_path / f"f.{fmt}.safetensors", format=fmt, lora=options, family=family, info={})
    tensors = load_file(path)
    fresh = Flux2Pipeline.from_pretrained(tiny_flux2_dev_dir)
    fresh.load_lora_weights(path, adapter_name="f")
    if fmt == "diffusers":
        loaded = {n: p for n, p in fresh.transformer.named_parameters() if ".lora_" in n}
        assert len(loaded) == len(tensors)
        for key, tensor in tensors.items():
            module, ab, _ = key.removeprefix("transformer.").rsplit(".", 2)
            torch.testing.assert_close(loaded[f"{module}.{ab}.f.weight"], tensor)
    inputs = _inputs(model)
    assert inputs["guidance"] is not None
    with torch.no_grad():
        expected, base = model(**inputs)[0], dev_pipe.transformer(**inputs)[0]
        torch.testing.assert_close(fresh.transformer(**inputs)[0], expected, atol=1e-5, rtol=1e-4)
    assert (expected - base).abs().max() > 1e-3  # the LoRA changes the output


@pytest.mark.parametrize("layout", ["bfl", "comfy"])
def test_dev_single_file_transformer(tmp_path: Path, tiny_flux2_dev_dir: Path, layout: str) -> None:
    """dev's single files (BFL's names, with ``guidance_in``; ComfyUI's prefix) load through diffusers'
    ``from_single_file`` with the guidance embedder's weights."""
    reference = Flux2Transformer2DModel.from_pretrained(tiny_flux2_dev_dir, subfolder="transformer").state_dict()
    bfl = diffusers_to_bfl(reference, prefix="model.diffusion_model." if layout == "comfy" else "")
    assert any("guidance_in." in k for k in bfl)
    file = tmp_path / "flux2-dev.safetensors"
    save_file({k: v.contiguous() + 0.5 for k, v in bfl.items()}, file)
    source = ModelSource(str(tiny_flux2_dev_dir), denoiser_file=str(file), dtype=torch.float32)
    Flux2(variant="dev").check_source(source)
    loaded = Flux2(variant="dev").load_denoiser(source).state_dict()
    assert loaded.keys() == reference.keys() and any("guidance_embedder" in k for k in loaded)
    for key, value in loaded.items():
        torch.testing.assert_close(value, reference[key] + 0.5, msg=key)


def test_dev_tiny_pipeline_is_deterministic_and_reads_the_real_layers() -> None:
    from lightning_lora.tiny.flux2 import build_tiny_flux2_dev

    a, b = build_tiny_flux2_dev(seed=0), build_tiny_flux2_dev(seed=0)
    for name in ("transformer", "text_encoder", "vae"):
        sa, sb = getattr(a, name).state_dict(), getattr(b, name).state_dict()
        assert all(torch.equal(sa[k], sb[k]) for k in sa), name
    text = a.text_encoder.config.text_config
    assert text.num_hidden_layers > 30  # the pipeline's layers 10, 20, 30 exist, and 30 is not the normed last one
    assert a.transformer.config.joint_attention_dim == 3 * text.hidden_size and a.transformer.config.guidance_embeds
    assert a.tokenizer.convert_tokens_to_ids("[IMG]") == a.text_encoder.config.image_token_index


# -- memory plan ---------------------------------------------------------------------------------------------------


def test_the_hub_models_plan_the_real_sizes_with_nothing_downloaded() -> None:
    """``plan`` on the hub ids needs no file (the family contract checks it plans as a folder of the same configs) and
    the sizes are the real models': klein 4B's 3.88 B transformer and 4.02 B Qwen3-4B encoder, dev's 32 B."""
    from lightning_lora.data.recipe import DataRecipe
    from lightning_lora.model.recipe import ModelRecipe
    from lightning_lora.plan import caching_peaks, plan_for

    data = DataRecipe(resolutions=(512,), batch_size=1)
    hub = ModelRecipe(Flux2(), ModelSource(HUB_ID), LoraOptions(rank=8), gradient_checkpointing=True)
    from_hub = plan_for(hub, data)
    assert from_hub.weights * 2**30 / 2 == pytest.approx(3.876e9, rel=2e-3)  # bf16: 2 bytes a parameter
    text = {mode: caching_peaks(hub, mode, 4, 1024)[0] for mode in ("none", "nf4")}
    assert text["nf4"] < 0.5 * text["none"]
    dev = ModelRecipe(Flux2(variant="dev"), ModelSource("black-forest-labs/FLUX.2-dev"), LoraOptions(rank=8))
    assert plan_for(dev, data).weights * 2**30 / 2 == pytest.approx(32.2e9, rel=0.02)
