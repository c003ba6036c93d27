"""Shared fixtures: tiny random FLUX pipelines saved to disk, captioned photos, and a quiet, offline, 1-thread torch.

Tests never touch a hub: HF_HUB_OFFLINE is set for the whole session, and every model is built from a config by
:mod:`lightning_lora.tiny` and loaded back through the real ``from_pretrained`` path.
"""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# On 2 cores a busy second core slows multi-threaded tiny-model steps 4-150x (shared/ENVIRONMENT.md).
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_flux_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A saved tiny FLUX.1-dev-like pipeline folder (model_index.json, transformer/, vae/, text encoders...)."""
    from lightning_lora.tiny import save_tiny_flux

    return save_tiny_flux(tmp_path_factory.mktemp("models") / "tiny-flux", seed=0)


@pytest.fixture(scope="session")
def photos_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four real photos from scikit-image (shipped in its wheel) with .txt captions."""
    from PIL import Image

    from lightning_lora.demo import PHOTOS, _photo

    folder = tmp_path_factory.mktemp("photos")
    for name in list(PHOTOS)[:4]:
        Image.fromarray(_photo(name)).save(folder / f"{name}.png")
        (folder / f"{name}.txt").write_text(PHOTOS[name])
    return folder


@pytest.fixture(scope="session")
def tiny_sdxl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A saved tiny SDXL pipeline folder (SDXL's UNet layout, two CLIP text encoders, Euler scheduler)."""
    from lightning_lora.tiny import save_tiny_sdxl

    return save_tiny_sdxl(tmp_path_factory.mktemp("models") / "tiny-sdxl", seed=0)


@pytest.fixture(scope="session")
def tiny_sd15_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A saved tiny SD1.5-like pipeline folder (one CLIP text encoder, PNDM scheduler, epsilon prediction)."""
    from lightning_lora.tiny import save_tiny_sd15

    return save_tiny_sd15(tmp_path_factory.mktemp("models") / "tiny-sd15", seed=0)
