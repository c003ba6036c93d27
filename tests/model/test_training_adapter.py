"""``model.training_adapter``: a LoRA merged into the frozen base for training only
(:mod:`lightning_lora.model.training_adapter`). A Turbo-like run (the tiny Z-Image, samples without guidance) with an
adapter in ostris' layout (``diffusion_model.<diffusers module>.lora_A/B`` and ``.alpha``) trains on the merged base,
draws its samples without the adapter, exports a LoRA that does not hold it, and records it in what the model is; a
distilled hub model without one gets one line from ``fit``."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import random_inputs, run_cli, write_config
from PIL import Image
from safetensors.torch import save_file

from lightning_lora.errors import ConfigError
from lightning_lora.families import Flux, Krea2, ModelSource, ZImage
from lightning_lora.model.training_adapter import adapter_removed, distillation_note

ADAPTED = {"layers.0.attention.to_q": 0.5, "layers.1.feed_forward.w1": 0.25}
"""The adapter's layers and their scale (``alpha / rank``): one the LoRA trains too, one it does not."""


def adapter_file(folder: Path, model_dir: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A rank-2 training adapter of random values for the tiny Z-Image, as ostris writes them, and each layer's delta
    ``alpha / rank * B @ A``."""
    from diffusers import ZImageTransformer2DModel

    model = ZImageTransformer2DModel.from_pretrained(model_dir, subfolder="transformer")
    g = torch.Generator().manual_seed(5)
    tensors: dict[str, torch.Tensor] = {}
    deltas: dict[str, torch.Tensor] = {}
    for module, scale in ADAPTED.items():
        out, inp = model.get_submodule(module).weight.shape
        a, b = torch.randn(2, inp, generator=g), torch.randn(out, 2, generator=g)
        tensors |= {f"diffusion_model.{module}.lora_A.weight": a, f"diffusion_model.{module}.lora_B.weight": b}
        tensors[f"diffusion_model.{module}.alpha"] = torch.tensor(2 * scale)
        deltas[module] = scale * b @ a
    path = folder / "zimage_turbo_training_adapter.safetensors"
    save_file(tensors, path)
    return path, deltas


def _image(path: Path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB"), dtype=np.int16)


def test_a_run_trains_on_the_merged_base_samples_and_exports_without_the_adapter(
    tmp_path: Path, tiny_zimage_dir: Path, photos_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from diffusers import ZImagePipeline, ZImageTransformer2DModel
    from safetensors.torch import load_file

    adapter, deltas = adapter_file(tmp_path, tiny_zimage_dir)
    samples = {"prompts": ["a photo of sks cat"], "steps": 2, "guidance_scale": 0.0, "height": 32, "width": 32}
    config = write_config(
        tmp_path,
        tiny_zimage_dir,
        photos_dir,
        **{
            "trainer.max_steps": 2,
            "trainer.callbacks": [
                {"class_path": "lightning_lora.callbacks.SampleImages", "init_args": samples},
                {"class_path": "lightning_lora.callbacks.LoraExport"},
            ],
            "model.family": {"class_path": "lightning_lora.families.ZImage", "init_args": {"max_sequence_length": 32}},
            "model.training_adapter": str(adapter),
            "model.lora": {"rank": 4, "alpha": 8, "targets": "attention"},
        },
    )
    cli = run_cli(["fit", "--config", str(config)])
    assert "Training adapter: zimage_turbo_training_adapter.safetensors merged" in capsys.readouterr().out
    from lightning_lora.cli.fit import run_summary

    assert f"training adapter:         {adapter}" in run_summary(cli.trainer)
    trained = cli.model.denoiser.eval()
    base = ZImageTransformer2DModel.from_pretrained(tiny_zimage_dir, subfolder="transformer").eval()
    for module, delta in deltas.items():  # the frozen base is the merged one
        layer = trained.get_submodule(module)
        weight = getattr(layer, "base_layer", layer).weight
        torch.testing.assert_close(weight, base.get_submodule(module).weight + delta)
    assert cli.model.model_identity()["training_adapter"] is not None

    # The exported LoRA holds the trained adapter alone: a fresh pipeline with it computes what the trained model
    # computes without the training adapter, and not what it computes with it.
    path = tmp_path / "run" / "lora" / "lora.safetensors"
    assert all(".attention.to_" in k for k in load_file(path)), "a layer the LoRA does not train is in the file"
    fresh = ZImagePipeline.from_pretrained(tiny_zimage_dir)
    fresh.set_progress_bar_config(disable=True)
    fresh.load_lora_weights(path)
    inputs = random_inputs(ZImage(), trained, 1)
    with torch.no_grad():
        exported = torch.stack(fresh.transformer(**inputs)[0])
        with adapter_removed(trained):
            without = torch.stack(trained(**inputs)[0])
        merged = torch.stack(trained(**inputs)[0])
    torch.testing.assert_close(exported, without, atol=1e-5, rtol=1e-4)
    assert (merged - without).abs().max() > 1e-3

    # The first samples (before any step) are the distilled base's own, not the merged model's.
    run = tmp_path / "run" / "samples"
    first = _image(run / "step000000_00.png")
    base_pipe = ZImagePipeline.from_pretrained(tiny_zimage_dir)
    base_pipe.set_progress_bar_config(disable=True)
    draw: dict[str, Any] = {"prompt": "a photo of sks cat", "height": 32, "width": 32, "num_inference_steps": 2}
    draw |= {"guidance_scale": 0.0, "output_type": "pil"}
    image = np.asarray(base_pipe(generator=torch.Generator().manual_seed(0), **draw).images[0], dtype=np.int16)
    assert np.abs(first - image).max() <= 1
    base_pipe.load_lora_weights(str(adapter))  # the adapter in the pipeline: another image (the test can fail)
    with_adapter = np.asarray(base_pipe(generator=torch.Generator().manual_seed(0), **draw).images[0], dtype=np.int16)
    assert np.abs(with_adapter - image).max() >= 8


def test_the_adapter_is_part_of_the_models_identity_not_of_the_caches(tmp_path: Path, tiny_zimage_dir: Path) -> None:
    """A resume with another adapter (or none) is refused, naming the option; the cached latents and captions do not
    depend on it (the VAE and the text encoder are not adapted)."""
    from lightning_lora.checkpoint import check_compatible
    from lightning_lora.data.cache import LatentCache

    one, _ = adapter_file(tmp_path, tiny_zimage_dir)
    other = tmp_path / "other.safetensors"
    save_file({"diffusion_model.layers.0.attention.to_q.lora_A.weight": torch.ones(1, 64)}, other)
    sources = [ModelSource(str(tiny_zimage_dir), training_adapter=str(p)) for p in (one, other)]
    hparams = [{"pretrained": str(tiny_zimage_dir), "training_adapter": s.training_adapter} for s in sources]
    identities = [s.model_identity() for s in sources]
    check_compatible(hparams[0], hparams[0], "last.ckpt", identities[0], identities[0])
    with pytest.raises(ConfigError, match=r"model\.training_adapter .* not the model the run was trained on"):
        check_compatible(hparams[0], hparams[1], "last.ckpt", identities[0], identities[1])
    plain = ModelSource(str(tiny_zimage_dir))
    caches = [LatentCache(tmp_path / "cache", ZImage(), s) for s in (plain, sources[0])]
    assert caches[0].text_key("a cat") == caches[1].text_key("a cat")


def test_a_bad_adapter_is_one_line_naming_the_option(tmp_path: Path, tiny_zimage_dir: Path) -> None:
    from lightning_lora.lora import LoraOptions
    from lightning_lora.model.assembly import build_lora_model
    from lightning_lora.model.recipe import ModelRecipe
    from lightning_lora.precision import BF16

    with pytest.raises(ConfigError, match=r"model\.training_adapter: .*missing\.safetensors.* not a \.safetensors"):
        ZImage().check_source(ModelSource(str(tiny_zimage_dir), training_adapter=str(tmp_path / "missing.safetensors")))
    foreign = tmp_path / "foreign.safetensors"
    save_file(
        {"diffusion_model.layers.9.attention.to_q.lora_A.weight": torch.ones(1, 64)}
        | {"diffusion_model.layers.9.attention.to_q.lora_B.weight": torch.ones(64, 1)},
        foreign,
    )
    source = ModelSource(str(tiny_zimage_dir), training_adapter=str(foreign), dtype=torch.float32)
    recipe = ModelRecipe(ZImage(), source, LoraOptions(rank=2), precision=BF16(dtype="fp32"))
    with pytest.raises(ConfigError, match=r"model\.training_adapter: .* 'layers\.9\.attention\.to_q'.*another model"):
        build_lora_model(recipe)


def test_a_distilled_hub_model_without_an_adapter_gets_one_line(caplog: pytest.LogCaptureFixture) -> None:
    """Z-Image-Turbo, FLUX.1-schnell and Krea 2 Turbo are step-distilled: ``fit`` says once what training one does and
    what to do (the undistilled model to train instead, where there is one); not with an adapter, and not for the
    undistilled models."""
    note = distillation_note(ZImage(), ModelSource("Tongyi-MAI/Z-Image-Turbo"))
    assert note is not None and "\n" not in note
    assert "model.training_adapter" in note and "undistilled Tongyi-MAI/Z-Image" in note
    assert "undistilled" not in (distillation_note(Flux(), ModelSource("black-forest-labs/FLUX.1-schnell")) or "")
    assert distillation_note(Flux(), ModelSource("black-forest-labs/FLUX.1-schnell")) is not None
    assert "undistilled krea/Krea-2-Raw instead" in (distillation_note(Krea2(), ModelSource("krea/Krea-2-Turbo")) or "")
    assert distillation_note(Krea2(), ModelSource("krea/Krea-2-Raw")) is None
    assert distillation_note(ZImage(), ModelSource("Tongyi-MAI/Z-Image")) is None
    assert distillation_note(Flux(), ModelSource("black-forest-labs/FLUX.1-dev")) is None

    from lightning.pytorch import Trainer

    from lightning_lora.module import LoraModule

    module = LoraModule("Tongyi-MAI/Z-Image-Turbo", family=ZImage())
    module.trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    with caplog.at_level(logging.INFO):
        module.setup("fit")
    assert [r.getMessage() for r in caplog.records if "step-distilled" in r.getMessage()] == [note]


def test_the_adapter_is_merged_before_the_base_is_quantized(tmp_path: Path, tiny_zimage_dir: Path) -> None:
    """With an FP8 base, an adapted layer stores the FP8 form of the merged weight ``W + B A``, bit for bit (not the
    base's own FP8 form), and taking the adapter out of a forward leaves ``Q(W + B A) x - B A x``."""
    from diffusers import ZImageTransformer2DModel
    from helpers import build_model

    from lightning_lora.lora import LoraOptions
    from lightning_lora.precision import FP8
    from lightning_lora.precision.fp8 import FP8Linear, quantize_rowwise

    adapter, deltas = adapter_file(tmp_path, tiny_zimage_dir)
    source = ModelSource(str(tiny_zimage_dir), training_adapter=str(adapter), dtype=torch.float32)
    model = build_model(ZImage(), source, LoraOptions(rank=2, targets="attention"), precision=FP8(dtype="fp32"))
    base = ZImageTransformer2DModel.from_pretrained(tiny_zimage_dir, subfolder="transformer")
    for module, delta in deltas.items():
        layer = model.get_submodule(module)
        stored = getattr(layer, "base_layer", layer)
        assert isinstance(stored, FP8Linear), module
        weight = base.get_submodule(module).weight.detach()
        merged, scale = quantize_rowwise(weight + delta)
        assert torch.equal(stored.weight.view(torch.uint8), merged.view(torch.uint8)), module
        torch.testing.assert_close(stored.weight_scale, scale.squeeze(1))
        assert not torch.equal(stored.weight.view(torch.uint8), quantize_rowwise(weight)[0].view(torch.uint8))
        x = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(1))
        with torch.no_grad(), adapter_removed(model):
            without = layer(x)  # the LoRA's B is zero: the layer computes its base
        expected = x @ stored.dequantized(torch.float32).T - x @ delta.T
        if stored.bias is not None:
            expected = expected + stored.bias
        torch.testing.assert_close(without, expected, atol=1e-4, rtol=1e-4)
