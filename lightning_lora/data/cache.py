"""The latent cache: VAE latents and text embeddings computed once, stored as safetensors, keyed by content.

Training never runs the VAE or the text encoders: every image is encoded once into normalized latents, every distinct
caption once into the family's text embeddings, and the files are reused by every later run and epoch.

Keys are content hashes of everything that determines the tensor:

* latents: the image file's bytes, the resolution and crop rule, the VAE's identity and dtype;
* text: the caption, the text encoders' identity and dtype, and the family's text options (e.g. T5 length).

So editing one caption re-encodes only that caption, swapping the model or the resolution re-encodes what depends on
it, and a stale tensor is never served: a changed input has a new key. Files are written atomically (see
:mod:`lightning_lora.io`); an unreadable file (a crash in an old version, a full disk) is detected and rebuilt.

Layout::

    <cache_dir>/latents/<key>.safetensors    {"latents": [C, h, w] float32}
    <cache_dir>/text/<key>.safetensors       {"prompt_embeds": ..., "pooled_prompt_embeds": ...}   (family-defined)

This is the first, simple cache: one square resolution, center crop. Aspect-ratio buckets come on top of it.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from lightning_lora.errors import ConfigError
from lightning_lora.families.base import DiffusionFamily, ModelSource
from lightning_lora.io import save_safetensors

__all__ = ["IMAGE_EXTENSIONS", "CacheEntry", "LatentCache", "Sample", "find_samples", "load_image"]

log = logging.getLogger(__name__)

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp")
_CROP_RULE = "short-side-resize-lanczos+center-crop-v1"


@dataclass(frozen=True)
class Sample:
    """One training image and its caption."""

    image: Path
    caption: str


@dataclass(frozen=True)
class CacheEntry:
    """Where a sample's tensors live in the cache."""

    sample: Sample
    latent_key: str
    text_key: str


def find_samples(folders: Sequence[str], caption_ext: str = ".txt", default_caption: str | None = None) -> list[Sample]:
    """Images in ``folders`` (not recursive), sorted, each with the caption from its same-named text file.

    Raises :class:`ConfigError` for a missing folder, a folder without images, or an image without a caption when
    no ``default_caption`` is set.
    """
    samples: list[Sample] = []
    for folder in folders:
        root = Path(folder).expanduser()
        if not root.is_dir():
            raise ConfigError(f"data.images: folder {folder!r} does not exist. Check the path.")
        images = sorted(p for p in root.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS)
        if not images:
            raise ConfigError(
                f"data.images: folder {folder!r} holds no images ({', '.join(IMAGE_EXTENSIONS)}). Put your training "
                "images there, or point data.images at the right folder."
            )
        for image in images:
            caption_file = image.with_suffix(caption_ext)
            if caption_file.is_file():
                caption = caption_file.read_text(encoding="utf-8").strip()
            elif default_caption is not None:
                caption = default_caption
            else:
                raise ConfigError(
                    f"data: image {str(image)!r} has no caption file {caption_file.name!r}. Write one, or set "
                    "data.default_caption to use one caption for every image without a file."
                )
            samples.append(Sample(image, caption))
    return samples


def load_image(path: Path, resolution: int) -> torch.Tensor:
    """Decode an image to ``[3, resolution, resolution]`` in [-1, 1]: EXIF rotation, RGB, resize, center crop.

    Transparent pixels are composited on white; grayscale, palette, CMYK and 16-bit images are converted to RGB.
    """
    with Image.open(path) as im:
        im = ImageOps.exif_transpose(im)
        if im.mode in ("RGBA", "LA") or (im.mode == "P" and "transparency" in im.info):
            rgba = im.convert("RGBA")
            background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            im = Image.alpha_composite(background, rgba)
        elif im.mode.startswith("I"):  # 16-bit (I;16, I;16B, I;16L) or 32-bit integer grayscale
            arr = np.asarray(im, dtype=np.float64)
            full_scale = 65535.0 if im.mode.startswith("I;16") or arr.max() <= 65535 else float(arr.max())
            im = Image.fromarray(np.clip(arr / full_scale * 255.0, 0, 255).round().astype(np.uint8))
        im = im.convert("RGB")
        w, h = im.size
        scale = resolution / min(w, h)
        new_size = (max(resolution, round(w * scale)), max(resolution, round(h * scale)))
        im = im.resize(new_size, Image.Resampling.LANCZOS)
        left, top = (new_size[0] - resolution) // 2, (new_size[1] - resolution) // 2
        im = im.crop((left, top, left + resolution, top + resolution))
        arr = np.asarray(im, dtype=np.float32) / 127.5 - 1.0
    return torch.from_numpy(arr).permute(2, 0, 1).contiguous()


def _hash(*parts: str | bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p if isinstance(p, bytes) else p.encode())
        h.update(b"\x00")
    return h.hexdigest()[:32]


def _readable(path: Path) -> bool:
    if not path.is_file():
        return False
    try:
        # Opening parses the header and checks it against the file size: a truncated file fails here.
        with safe_open(path, framework="pt") as f:
            f.keys()
    except (SafetensorError, OSError, RuntimeError):
        log.warning("cache file %s is unreadable; it will be rebuilt", path)
        return False
    return True


class LatentCache:
    """Content-keyed cache of latents and text embeddings under ``root``."""

    def __init__(self, root: str | Path, family: DiffusionFamily, source: ModelSource, resolution: int) -> None:
        self.root = Path(root).expanduser()
        self.family = family
        self.source = source
        self.resolution = resolution

    # -- keys --------------------------------------------------------------------------------------------------
    def latent_key(self, sample: Sample) -> str:
        return _hash(
            sample.image.read_bytes(), str(self.resolution), _CROP_RULE, self.source.identity("vae"), self.family.name
        )

    def text_key(self, caption: str) -> str:
        identity = self.source.identity("text_encoder") + self.source.identity("text_encoder_2")
        return _hash(caption, identity, self.family.text_cache_tag())

    def latent_path(self, key: str) -> Path:
        return self.root / "latents" / f"{key}.safetensors"

    def text_path(self, key: str) -> Path:
        return self.root / "text" / f"{key}.safetensors"

    def entries(self, samples: Iterable[Sample]) -> list[CacheEntry]:
        return [CacheEntry(s, self.latent_key(s), self.text_key(s.caption)) for s in samples]

    # -- reading -----------------------------------------------------------------------------------------------
    def load_latents(self, key: str) -> torch.Tensor:
        return load_file(self.latent_path(key))["latents"]

    def load_text(self, key: str) -> dict[str, torch.Tensor]:
        return load_file(self.text_path(key))

    def missing(self, entries: Sequence[CacheEntry]) -> tuple[list[CacheEntry], list[str]]:
        """Entries whose latents are missing or unreadable, and captions whose embeddings are."""
        latents = [e for e in entries if not _readable(self.latent_path(e.latent_key))]
        texts: dict[str, str] = {}
        for e in entries:
            if e.text_key not in texts and not _readable(self.text_path(e.text_key)):
                texts[e.text_key] = e.sample.caption
        return latents, list(texts.values())

    # -- building ----------------------------------------------------------------------------------------------
    def build(
        self, samples: Sequence[Sample], device: torch.device, batch_size: int = 4
    ) -> tuple[list[CacheEntry], dict[str, int]]:
        """Encode what is missing; return the usable entries and counts (found, encoded, reused, skipped).

        An image that cannot be decoded is skipped with a warning that names it (the rest of the data set still
        trains); if no image is usable, :class:`ConfigError`.
        """
        start = time.perf_counter()
        entries = self.entries(samples)
        todo_latents, todo_texts = self.missing(entries)
        skipped: set[Path] = set()
        if todo_latents:
            skipped = self._encode_images(todo_latents, device, batch_size)
        if todo_texts:
            self.encode_texts(todo_texts, device, batch_size)
        usable = [e for e in entries if e.sample.image not in skipped]
        if not usable:
            raise ConfigError("data.images: none of the images could be read (see the warnings above).")
        stats = {
            "images": len(entries),
            "encoded": len(todo_latents) - len(skipped),
            "reused": len(entries) - len(todo_latents),
            "skipped": len(skipped),
            "captions_encoded": len(todo_texts),
            "seconds": round(time.perf_counter() - start, 2),
        }
        return usable, stats

    def _encode_images(self, entries: Sequence[CacheEntry], device: torch.device, batch_size: int) -> set[Path]:
        vae = self.family.load_vae(self.source).to(device)
        skipped: set[Path] = set()
        try:
            for i in range(0, len(entries), batch_size):
                chunk, pixels = [], []
                for e in entries[i : i + batch_size]:
                    try:
                        pixels.append(load_image(e.sample.image, self.resolution))
                        chunk.append(e)
                    except (OSError, ValueError, SyntaxError) as err:
                        log.warning("skipping image %s: cannot decode it (%s)", e.sample.image, err)
                        skipped.add(e.sample.image)
                if not chunk:
                    continue
                latents = self.family.encode_images(vae, torch.stack(pixels).to(device))
                for e, lat in zip(chunk, latents, strict=True):
                    save_safetensors({"latents": lat}, self.latent_path(e.latent_key))
        finally:
            del vae
            _free(device)
        return skipped

    def encode_texts(self, captions: Sequence[str], device: torch.device, batch_size: int = 4) -> None:
        """Encode captions (or sample prompts) into the text cache."""
        encoders = self.family.load_text_encoders(self.source).to(device)
        try:
            for i in range(0, len(captions), batch_size):
                chunk = list(captions[i : i + batch_size])
                embeds = self.family.encode_prompts(encoders, chunk)
                for j, caption in enumerate(chunk):
                    one = {k: v[j] for k, v in embeds.items()}
                    save_safetensors(one, self.text_path(self.text_key(caption)))
        finally:
            del encoders
            _free(device)

    def text_embeddings(self, prompts: Sequence[str], device: torch.device) -> list[dict[str, torch.Tensor]]:
        """Embeddings for ``prompts`` (batch of 1 each), encoding only those not cached yet."""
        missing = [p for p in dict.fromkeys(prompts) if not _readable(self.text_path(self.text_key(p)))]
        if missing:
            self.encode_texts(missing, device)
        return [{k: v.unsqueeze(0) for k, v in self.load_text(self.text_key(p)).items()} for p in prompts]


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
