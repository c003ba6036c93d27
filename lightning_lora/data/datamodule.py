"""LatentDataModule: image folders in, cached latents and text embeddings out.

* ``__init__`` checks the folders and captions (cheap), so a wrong path fails before any model loads.
* ``prepare_data`` (one process per machine; the others wait) builds whatever is missing from the cache: it loads the
  VAE and text encoders through the model's family, encodes, writes, and frees them.
* ``setup`` lists the cache entries; ``train_dataloader`` serves them. Batches are dicts of tensors: ``latents``
  plus the family's text embeddings (``prompt_embeds``, ``pooled_prompt_embeds`` for FLUX).

The model identity (family, weights) comes from the LightningModule (``trainer.lightning_module``), so it is written
once in the YAML, under ``model``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from lightning_lora.data.buckets import BucketBatchSampler, ResumableLoader
from lightning_lora.data.cache import CacheEntry, LatentCache, find_samples
from lightning_lora.errors import ConfigError

__all__ = ["CachedDataset", "LatentDataModule"]

log = logging.getLogger(__name__)


class CachedDataset(Dataset):
    """Reads one sample's latents and text embeddings from the cache."""

    def __init__(self, cache: LatentCache, entries: list[CacheEntry]) -> None:
        self.cache = cache
        self.entries = entries

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        entry = self.entries[index]
        item = {"latents": self.cache.load_latents(entry.latent_key)}
        item.update(self.cache.load_text(entry.text_key))
        return item


class LatentDataModule(LightningDataModule):
    """Training data from folders of images with captions, served from the latent cache.

    Args:
        images: one folder or a list of folders of images (jpg, jpeg, png, webp, bmp).
        resolution: images are resized (short side) and center-cropped to this square size; a multiple of the
            family's latent divisor (16 for FLUX).
        batch_size: images per batch.
        cache_dir: where latents and text embeddings are cached; shared safely between runs (keys are content
            hashes). Default: ``<trainer.default_root_dir>/cache``.
        caption_ext: captions are read from the same-named file with this extension.
        default_caption: the caption for images without a caption file; null makes a missing caption an error.
        num_workers: DataLoader worker processes.
        encode_batch_size: images / captions per encoder call while building the cache.
        eval_samples: how many images (the first, in file-name order) the fixed evaluation loss uses.
        seed: seed of the batch order (epoch e shuffles with seed + e); null uses the run's ``seed_everything``.
    """

    def __init__(
        self,
        images: str | list[str],
        resolution: int = 512,
        batch_size: int = 1,
        cache_dir: str | None = None,
        caption_ext: str = ".txt",
        default_caption: str | None = None,
        num_workers: int = 0,
        encode_batch_size: int = 4,
        eval_samples: int = 4,
        seed: int | None = None,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ConfigError(f"data.batch_size: {batch_size} must be at least 1.")
        if resolution < 1:
            raise ConfigError(f"data.resolution: {resolution} must be a positive number of pixels (e.g. 512).")
        self.folders = [images] if isinstance(images, str) else list(images)
        self.samples = find_samples(self.folders, caption_ext, default_caption)
        self.resolution = resolution
        self.batch_size = batch_size
        self.cache_dir = cache_dir
        self.num_workers = num_workers
        self.encode_batch_size = encode_batch_size
        self.eval_samples = eval_samples
        self.seed = seed
        self.entries: list[CacheEntry] = []
        self._cache: LatentCache | None = None

    def cache(self) -> LatentCache:
        """The cache for the attached trainer's model (family, weights) and this resolution."""
        if self._cache is None:
            if self.trainer is None:
                raise RuntimeError("LatentDataModule needs a Trainer with a LoraModule attached")
            module: Any = self.trainer.lightning_module
            module.family.check_resolution(self.resolution, self.resolution, "data.resolution")
            root = self.cache_dir or str(Path(self.trainer.default_root_dir) / "cache")
            self._cache = LatentCache(root, module.family, module.source, self.resolution)
        return self._cache

    @override
    def prepare_data(self) -> None:
        cache = self.cache()
        assert self.trainer is not None
        device = self.trainer.strategy.root_device
        _, stats = cache.build(self.samples, device, self.encode_batch_size)
        rank_zero_info(
            f"Latent cache {cache.root}: {stats['images']} images, {stats['encoded']} encoded, "
            f"{stats['reused']} reused, {stats['skipped']} skipped, {stats['captions_encoded']} captions encoded "
            f"({stats['seconds']} s)."
        )

    @override
    def setup(self, stage: str) -> None:
        cache = self.cache()
        entries = cache.entries(self.samples)
        missing_latents, missing_texts = cache.missing(entries)
        skipped = {e.sample.image for e in missing_latents}
        if missing_texts:
            raise RuntimeError(f"text cache incomplete after prepare_data ({len(missing_texts)} captions missing)")
        self.entries = [e for e in entries if e.sample.image not in skipped]
        if not self.entries:
            raise ConfigError("data.images: no usable images after caching (see the warnings above).")

    @override
    def train_dataloader(self) -> DataLoader:
        assert self.trainer is not None
        seed = self.seed if self.seed is not None else int(os.environ.get("PL_GLOBAL_SEED", 0))
        sampler = BucketBatchSampler(
            [0] * len(self.entries),  # one square resolution: a single bucket
            self.batch_size,
            seed=seed,
            num_replicas=self.trainer.world_size,
            rank=self.trainer.global_rank,
        )
        if len(sampler) == 0:
            raise ConfigError(
                f"data: {len(self.entries)} images make no batch for {self.trainer.world_size} GPUs; add images or "
                "lower data.batch_size."
            )
        return ResumableLoader(CachedDataset(self.cache(), self.entries), sampler, num_workers=self.num_workers)

    def eval_dataloader(self) -> DataLoader:
        """The first ``eval_samples`` cached images, in a fixed order: for the fixed evaluation loss."""
        subset = self.entries[: self.eval_samples]
        return DataLoader(CachedDataset(self.cache(), subset), batch_size=self.batch_size, shuffle=False)
