"""The real loading code: a local diffusers folder, a single-file transformer (diffusers and original BFL layouts),
and a hub id (offline here, so it must fail with a message that says what to do)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import allow_any_flux_width, run_cli, write_config
from safetensors.torch import save_file

from lightning_lora.errors import ConfigError
from lightning_lora.families import Flux, ModelSource
from lightning_lora.formats.bfl import BFL_PREFIX_COMFY, diffusers_to_bfl, flux_dims_from_config


def _reference(folder: Path) -> dict[str, torch.Tensor]:
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel.from_pretrained(folder, subfolder="transformer").state_dict()


def test_local_folder_loads_every_component(tiny_flux_dir: Path) -> None:
    family, source = Flux(max_sequence_length=16), ModelSource(str(tiny_flux_dir), dtype=torch.float32)
    denoiser = family.load_denoiser(source)
    assert not any(p.requires_grad for p in denoiser.parameters()) and not denoiser.training
    encoders = family.load_text_encoders(source)
    embeds = family.encode_prompts(encoders, ["a photo of sks cat", "a rocket"])
    assert embeds["prompt_embeds"].shape[:2] == (2, 16)
    assert embeds["pooled_prompt_embeds"].shape[0] == 2
    latents = family.encode_images(family.load_vae(source), torch.zeros(1, 3, 32, 32))
    assert latents.shape == (1, 4, 4, 4) and latents.dtype == torch.float32


@pytest.mark.parametrize("layout", ["diffusers", "bfl", "comfy"])
def test_single_file_transformer(
    tmp_path: Path, tiny_flux_dir: Path, monkeypatch: pytest.MonkeyPatch, layout: str
) -> None:
    reference = _reference(tiny_flux_dir)
    if layout == "diffusers":
        weights = reference
    else:
        from diffusers import FluxTransformer2DModel

        config = FluxTransformer2DModel.load_config(tiny_flux_dir, subfolder="transformer")
        allow_any_flux_width(monkeypatch, flux_dims_from_config(config))
        weights = diffusers_to_bfl(reference, prefix=BFL_PREFIX_COMFY if layout == "comfy" else "")
    # Perturb so the test can tell the file's weights from the folder's.
    weights = {k: v + 0.5 for k, v in weights.items()}
    file = tmp_path / "flux1-dev-tiny.safetensors"
    save_file({k: v.contiguous() for k, v in weights.items()}, file)

    denoiser = Flux().load_denoiser(ModelSource(str(tiny_flux_dir), denoiser_file=str(file), dtype=torch.float32))
    loaded = denoiser.state_dict()
    assert loaded.keys() == reference.keys()
    for key, value in loaded.items():
        torch.testing.assert_close(value, reference[key] + 0.5, msg=key)


def test_fit_with_a_single_file_transformer(tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path) -> None:
    file = tmp_path / "transformer.safetensors"
    save_file({k: v.contiguous() for k, v in _reference(tiny_flux_dir).items()}, file)
    config = write_config(
        tmp_path, tiny_flux_dir, photos_dir, **{"trainer.max_steps": 2, "model.denoiser_file": str(file)}
    )
    cli = run_cli(["fit", "--config", str(config)])
    assert cli.trainer.global_step == 2
    from lightning_lora.export import read_metadata

    assert read_metadata(tmp_path / "run" / "lora" / "lora.safetensors")["lightning_lora.denoiser_file"] == file.name


@pytest.mark.parametrize("damage", ["truncated", "not safetensors"])
def test_a_damaged_denoiser_file_is_refused_before_loading(tmp_path: Path, tiny_flux_dir: Path, damage: str) -> None:
    file = tmp_path / "flux1-dev.safetensors"
    save_file({k: v.contiguous() for k, v in _reference(tiny_flux_dir).items()}, file)
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"<html>404 Not Found</html>")
    with pytest.raises(ConfigError, match=r"model\.denoiser_file: .* is not a readable safetensors file .*download"):
        Flux().check_source(ModelSource(str(tiny_flux_dir), denoiser_file=str(file)))


@pytest.mark.parametrize("component", ["text_encoder", "vae", "transformer"])
def test_pickled_weights_in_a_pipeline_folder_are_refused(tmp_path: Path, tiny_flux_dir: Path, component: str) -> None:
    """diffusers and transformers would load a folder's pytorch_model.bin (pickle); we read safetensors only."""
    import shutil

    from safetensors.torch import load_file

    folder = tmp_path / "flux"
    shutil.copytree(tiny_flux_dir, folder)
    weights = next((folder / component).glob("*.safetensors"))
    pickled = weights.with_suffix(".bin")
    torch.save(load_file(weights), pickled)
    weights.unlink()
    family, source = Flux(max_sequence_length=16), ModelSource(str(folder), dtype=torch.float32)
    load = {"text_encoder": family.load_text_encoders, "vae": family.load_vae, "transformer": family.load_denoiser}
    with pytest.raises(ConfigError, match=rf"model\.pretrained: {pickled} holds the '{component}' weights in .*pickle"):
        load[component](source)
