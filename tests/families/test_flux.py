"""The FLUX family: latent packing vs diffusers, the loss on a tiny transformer, LoRA presets, source checks."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from diffusers import FluxPipeline
from peft import LoraConfig
from safetensors.torch import save_file

from lightning_lora.errors import ConfigError
from lightning_lora.families.base import ModelSource, check_source
from lightning_lora.families.flux import Flux, latent_image_ids, pack_latents, unpack_latents
from lightning_lora.tiny.flux import build_tiny_flux

# -- packing -------------------------------------------------------------------------------------------------------

SHAPES = [(1, 4, 2, 2), (2, 4, 8, 6), (3, 16, 4, 10)]


@pytest.mark.parametrize("shape", SHAPES)
def test_pack_unpack_round_trip_is_exact(shape: tuple[int, int, int, int]) -> None:
    b, c, h, w = shape
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    tokens = pack_latents(x)
    assert tokens.shape == (b, (h // 2) * (w // 2), 4 * c)
    assert torch.equal(unpack_latents(tokens, h, w), x)


def test_pack_puts_one_2x2_patch_in_each_token() -> None:
    x = torch.arange(1 * 2 * 4 * 6, dtype=torch.float32).view(1, 2, 4, 6)
    tokens = pack_latents(x)
    # Token 1 is patch row 0, patch col 1: pixels (0..1, 2..3); features are channel-major, then the 2x2 patch.
    expected = torch.cat([x[0, ch, 0:2, 2:4].reshape(-1) for ch in range(2)])
    assert torch.equal(tokens[0, 1], expected)


@pytest.mark.parametrize("shape", SHAPES)
def test_pack_unpack_agree_with_diffusers(shape: tuple[int, int, int, int]) -> None:
    b, c, h, w = shape
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    ours = pack_latents(x)
    theirs = FluxPipeline._pack_latents(x, b, c, h, w)
    assert torch.equal(ours, theirs)
    vae_scale = 8  # diffusers' _unpack_latents takes the pixel size
    assert torch.equal(
        unpack_latents(ours, h, w), FluxPipeline._unpack_latents(theirs, h * vae_scale, w * vae_scale, vae_scale)
    )


@pytest.mark.parametrize("hw", [(2, 2), (8, 6), (4, 10), (64, 64)])
def test_latent_image_ids_agree_with_diffusers(hw: tuple[int, int]) -> None:
    h, w = hw
    ids = latent_image_ids(h, w, dtype=torch.bfloat16)
    theirs = FluxPipeline._prepare_latent_image_ids(1, h // 2, w // 2, torch.device("cpu"), torch.bfloat16)
    assert ids.dtype == torch.bfloat16
    assert ids.shape == ((h // 2) * (w // 2), 3)
    assert torch.equal(ids, theirs)


# -- loss on a tiny transformer ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_pipe() -> FluxPipeline:
    return build_tiny_flux(seed=0)


def _batch(transformer: torch.nn.Module, b: int = 2, h: int = 8, w: int = 8, seq: int = 6) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    c = transformer.config.in_channels // 4
    dim = transformer.config.joint_attention_dim
    return {
        "latents": torch.randn(b, c, h, w, generator=g),
        "prompt_embeds": torch.randn(b, seq, dim, generator=g),
        "pooled_prompt_embeds": torch.randn(b, transformer.config.pooled_projection_dim, generator=g),
    }


def test_flux_loss_and_lora_gradients() -> None:
    family = Flux()
    transformer = build_tiny_flux(seed=0).transformer.requires_grad_(False)
    batch = _batch(transformer, b=3)
    g = torch.Generator().manual_seed(1)
    noise = torch.randn(batch["latents"].shape, generator=g)
    timesteps = family.sample_timesteps(batch["latents"], generator=g)
    assert timesteps.shape == (3,)

    loss = family.loss(transformer, batch, noise, timesteps)
    assert loss.shape == (3,) and loss.dtype == torch.float32
    assert torch.isfinite(loss).all() and (loss > 0).all()
    assert not loss.requires_grad  # frozen base, no adapter: nothing to differentiate

    transformer.add_adapter(
        LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian", target_modules=["to_q", "to_v"])
    )
    loss2 = family.loss(transformer, batch, noise, timesteps)
    torch.testing.assert_close(loss2, loss)  # lora_B = 0 at init: same function
    assert loss2.requires_grad
    loss2.mean().backward()
    grads = {n: p.grad for n, p in transformer.named_parameters() if p.grad is not None}
    assert grads and all("lora_" in n for n in grads)
    assert all(p.grad is None for n, p in transformer.named_parameters() if "lora_" not in n)
    lora_b = [grads[n] for n in grads if "lora_B" in n]
    assert lora_b and any(gr.abs().sum() > 0 for gr in lora_b)


def test_flux_loss_is_the_flow_matching_mse(tiny_pipe: FluxPipeline) -> None:
    """The loss equals MSE(transformer(packed x_sigma), packed(noise - x0)) computed by hand."""
    transformer = tiny_pipe.transformer
    batch = _batch(transformer, b=2, h=4, w=6)
    x0 = batch["latents"]
    noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(3))
    sig = torch.tensor([0.25, 0.8])
    with torch.no_grad():
        loss = Flux(guidance=2.0).loss(transformer, batch, noise, sig)
        pred = transformer(
            hidden_states=pack_latents((1 - sig.view(-1, 1, 1, 1)) * x0 + sig.view(-1, 1, 1, 1) * noise),
            timestep=sig,
            guidance=torch.full((2,), 2.0),
            pooled_projections=batch["pooled_prompt_embeds"],
            encoder_hidden_states=batch["prompt_embeds"],
            txt_ids=torch.zeros(batch["prompt_embeds"].shape[1], 3),
            img_ids=latent_image_ids(4, 6),
            return_dict=False,
        )[0]
        expected = (pred - pack_latents(noise - x0)).pow(2).mean(dim=(1, 2))
        other_guidance = Flux(guidance=5.0).loss(transformer, batch, noise, sig)
    torch.testing.assert_close(loss, expected)
    assert not torch.allclose(other_guidance, loss)  # the guidance value reaches the model


def test_sample_timesteps_resolution_shift() -> None:
    # No fixed shift: larger images are shifted more towards noise.
    family = Flux(timestep_sampling="flux_shift")
    small = family.sample_timesteps(torch.zeros(4000, 1, 32, 32), generator=torch.Generator().manual_seed(0))
    large = family.sample_timesteps(torch.zeros(4000, 1, 128, 128), generator=torch.Generator().manual_seed(0))
    assert large.mean() > small.mean() + 0.05
    fixed = Flux(timestep_sampling="flux_shift", shift=1.0)
    plain = Flux(timestep_sampling="logit_normal")
    lat = torch.zeros(16, 1, 128, 128)
    torch.testing.assert_close(
        fixed.sample_timesteps(lat, torch.Generator().manual_seed(5)),
        plain.sample_timesteps(lat, torch.Generator().manual_seed(5)),
    )


# -- LoRA presets --------------------------------------------------------------------------------------------------


def _linear_names(model: torch.nn.Module) -> set[str]:
    return {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def _preset_matches(preset: str, model: torch.nn.Module) -> set[str]:
    regex = re.compile(Flux.architecture.lora_presets[preset])
    return {n for n in _linear_names(model) if regex.fullmatch(n)}


def test_lora_preset_attention(tiny_pipe: FluxPipeline) -> None:
    t = tiny_pipe.transformer
    double = {f"transformer_blocks.{i}.attn.{p}" for i in range(2) for p in ("to_q", "to_k", "to_v", "to_out.0")}
    # Single blocks have no to_out (their attention output goes through proj_out together with the MLP).
    single = {f"single_transformer_blocks.{i}.attn.{p}" for i in range(2) for p in ("to_q", "to_k", "to_v")}
    assert (double | single) <= _linear_names(t)
    assert _preset_matches("attention", t) == double | single


def test_lora_preset_attention_all(tiny_pipe: FluxPipeline) -> None:
    t = tiny_pipe.transformer
    text = {
        f"transformer_blocks.{i}.attn.{p}"
        for i in range(2)
        for p in ("add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
    }
    assert _preset_matches("attention_all", t) == _preset_matches("attention", t) | text


def test_lora_preset_all_linear(tiny_pipe: FluxPipeline) -> None:
    t = tiny_pipe.transformer
    got = _preset_matches("all_linear", t)
    mlp = {
        f"transformer_blocks.{i}.{ff}.net.{p}" for i in range(2) for ff in ("ff", "ff_context") for p in ("0.proj", "2")
    }
    single = {f"single_transformer_blocks.{i}.{p}" for i in range(2) for p in ("proj_mlp", "proj_out")}
    assert got == _preset_matches("attention_all", t) | mlp | single
    # Embedders, modulation (norm*.linear) and the final projection stay frozen.
    assert not any("norm" in n or "embed" in n for n in got)
    assert "proj_out" not in got and "x_embedder" not in got


# -- check_source --------------------------------------------------------------------------------------------------


def _check(pretrained: str | Path, denoiser_file: str | Path | None = None) -> None:
    source = ModelSource(str(pretrained), None if denoiser_file is None else str(denoiser_file))
    Flux().check_source(source)


def _pipeline_folder(root: Path, class_name: str = "FluxPipeline") -> Path:
    folder = root / "pipe"
    folder.mkdir()
    (folder / "model_index.json").write_text(json.dumps({"_class_name": class_name}))
    return folder


def test_check_source_accepts_a_real_folder(tiny_flux_dir: Path) -> None:
    _check(tiny_flux_dir)
    check_source(ModelSource(str(tiny_flux_dir)), ("FluxPipeline",))


def test_check_source_accepts_a_hub_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    _check("black-forest-labs/FLUX.1-dev")
    _check("someone/my_model-v1.0")


@pytest.mark.parametrize("bad", ["no/such/folder/here", "not a hub id", "./missing", "a/b/c"])
def test_check_source_missing_folder(bad: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"model\.pretrained") as e:
        _check(bad)
    assert bad in str(e.value)


def test_check_source_file_instead_of_folder(tmp_path: Path) -> None:
    f = tmp_path / "flux1-dev.safetensors"
    f.write_bytes(b"x")
    with pytest.raises(ConfigError, match=r"model\.pretrained.*is a file.*model\.denoiser_file"):
        _check(f)


def test_check_source_folder_without_model_index(tmp_path: Path) -> None:
    (tmp_path / "transformer").mkdir()
    with pytest.raises(ConfigError, match=r"model\.pretrained.*no model_index\.json"):
        _check(tmp_path)


def test_check_source_wrong_pipeline_class(tmp_path: Path) -> None:
    folder = _pipeline_folder(tmp_path, "StableDiffusionXLPipeline")
    with pytest.raises(ConfigError, match=r"model\.pretrained.*StableDiffusionXLPipeline.*model\.family"):
        _check(folder)


def test_check_source_unreadable_model_index(tmp_path: Path) -> None:
    folder = tmp_path / "pipe"
    folder.mkdir()
    (folder / "model_index.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"model\.pretrained"):
        _check(folder)


def test_check_source_denoiser_file_not_safetensors(tmp_path: Path) -> None:
    folder = _pipeline_folder(tmp_path)
    ckpt = tmp_path / "flux1-dev.ckpt"
    ckpt.write_bytes(b"x")
    with pytest.raises(ConfigError, match=r"model\.denoiser_file.*not a \.safetensors"):
        _check(folder, ckpt)


def test_check_source_denoiser_file_missing(tmp_path: Path) -> None:
    folder = _pipeline_folder(tmp_path)
    with pytest.raises(ConfigError, match=r"model\.denoiser_file.*does not exist"):
        _check(folder, tmp_path / "nope.safetensors")


def test_check_source_denoiser_file_ok(tmp_path: Path) -> None:
    folder = _pipeline_folder(tmp_path)
    f = tmp_path / "flux1-dev.safetensors"
    save_file({"x": torch.zeros(2)}, f)  # only the header is read here
    _check(folder, f)


def test_check_resolution() -> None:
    Flux().check_resolution(512, 768, "data.resolution")
    with pytest.raises(ConfigError, match=r"data\.resolution.*Use 512x512"):
        Flux().check_resolution(510, 520, "data.resolution")
