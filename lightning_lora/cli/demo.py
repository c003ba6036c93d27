"""Prepare the CPU demo: tiny random FLUX, SDXL and SD1.5 pipelines and a folder of real captioned photos.

``python -m lightning_lora.cli.demo [--out .demo]`` writes::

    .demo/tiny-flux/     a complete diffusers FluxPipeline folder (random weights, ~1 MB), loaded back by the trainer
                         through the real ``from_pretrained`` path
    .demo/tiny-sdxl/     a StableDiffusionXLPipeline folder with SDXL's UNet layout (~4 MB)
    .demo/tiny-sd15/     a StableDiffusionPipeline folder (~2 MB)
    .demo/tiny-zimage/   a ZImagePipeline folder (Qwen3 text encoder, chat-template tokenizer; ~3 MB)
    .demo/tiny-qwenimage/ a QwenImagePipeline folder (video VAE, Qwen2.5-VL text encoder; ~1.4 MB)
    .demo/tiny-flux2/    a Flux2KleinPipeline folder (batch-normalised VAE, 28-layer Qwen3 text encoder; ~6 MB)
    .demo/photos/        photos that ship inside scikit-image (no download) as PNG, each with a .txt caption

``configs/tiny_cpu.yaml`` (FLUX, what ``make demo`` trains), ``configs/tiny_sdxl_cpu.yaml``,
``configs/tiny_sd15_cpu.yaml``, ``configs/tiny_zimage_cpu.yaml``, ``configs/tiny_qwenimage_cpu.yaml`` and
``configs/tiny_flux2_cpu.yaml`` train on exactly these. Existing files are left as they are (the step is idempotent).
"""

from __future__ import annotations

import argparse
import functools
import importlib
from pathlib import Path

import numpy as np

__all__ = ["PHOTOS", "TINY_MODELS", "prepare"]

#: Folder name under the demo folder -> ``module:function`` that writes it (one module of :mod:`lightning_lora.tiny`
#: per family).
TINY_MODELS: dict[str, str] = {
    "tiny-flux": "lightning_lora.tiny.flux:save_tiny_flux",
    "tiny-sdxl": "lightning_lora.tiny.sdxl:save_tiny_sdxl",
    "tiny-sd15": "lightning_lora.tiny.sd15:save_tiny_sd15",
    "tiny-zimage": "lightning_lora.tiny.zimage:save_tiny_zimage",
    "tiny-qwenimage": "lightning_lora.tiny.qwenimage:save_tiny_qwenimage",
    "tiny-flux2": "lightning_lora.tiny.flux2:save_tiny_flux2",
}

# scikit-image sample name -> caption. "sks" is the usual rare trigger token of DreamBooth-style LoRAs.
PHOTOS: dict[str, str] = {
    "astronaut": "a photo of sks astronaut in a white space suit with a flag",
    "chelsea": "a photo of sks cat, a tabby cat looking to the side",
    "coffee": "a photo of sks coffee cup on a saucer, top view",
    "rocket": "a photo of sks rocket on the launch pad under a blue sky",
    "hubble_deep_field": "a photo of sks galaxies in deep space",
    "colorwheel": "a sks color wheel with all the hues of the rainbow",
    "camera": "a black and white photo of sks man with a camera on a tripod",
    "coins": "a black and white photo of sks coins on a table",
}


def _photo(name: str) -> np.ndarray:
    try:
        from skimage import data
    except ImportError as e:  # pragma: no cover - the demo extra is part of `make demo`
        raise SystemExit("the demo needs scikit-image: pip install 'lightning-lora[demo]'") from e
    return np.asarray(getattr(data, name)())


def prepare(out: Path) -> tuple[Path, Path]:
    """Write the tiny pipelines (:data:`TINY_MODELS`) and the photos under ``out``; return tiny-flux/ and photos/."""
    from PIL import Image

    from lightning_lora.io import atomic_write, atomic_write_bytes

    models = {}
    for name, where in TINY_MODELS.items():
        module, function = where.split(":")
        models[name] = getattr(importlib.import_module(module), function)(out / name, seed=0)
    model = models["tiny-flux"]
    photos = out / "photos"
    photos.mkdir(parents=True, exist_ok=True)
    for name, caption in PHOTOS.items():
        image_path = photos / f"{name}.png"
        if not image_path.exists():
            image = Image.fromarray(_photo(name))
            atomic_write(image_path, functools.partial(image.save, format="PNG"))
        caption_path = photos / f"{name}.txt"
        if not caption_path.exists():
            atomic_write_bytes(caption_path, (caption + "\n").encode())
    return model, photos


def _quiet() -> None:
    """The demo prints its two lines: the libraries' notes (no torchvision here) and their save progress bars are not
    for the user (set before transformers / diffusers are imported, so their import-time notes are quiet too)."""
    import os

    from lightning_lora.cli.console import quiet_library_loggers

    quiet_library_loggers()  # bitsandbytes' CPU kernel note (AVX-512 BF16 CPUs), the ``kernels`` package's notes
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    diffusers_logging.disable_progress_bar()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(".demo"), help="folder for the model and photos")
    args = parser.parse_args()
    _quiet()
    model, photos = prepare(args.out)
    others = ", ".join(str(args.out / name) for name in TINY_MODELS if name != model.name)
    print(f"demo model:  {model} (also {others})\ndemo photos: {photos} ({len(PHOTOS)} images with captions)")


if __name__ == "__main__":
    main()
