"""LatentDataModule: folders of captioned images in, batches of cached latents and text embeddings out.

* ``__init__`` turns the options into one frozen :class:`~lightning_lora.data.recipe.DataRecipe` (checked once) and
  scans the folders and captions (no pixels): a wrong path or option fails before any model loads.
* ``prepare_data`` (local rank 0; the other ranks wait) builds whatever is missing from the cache (see
  :mod:`lightning_lora.data.build`) for the trainer's model (its family and weights: :class:`ModelSide`) and logs the
  summary. ``lightning-lora cache`` calls :meth:`build_cache` directly.
* ``setup`` lists the usable cache entries; ``train_dataloader`` serves them in batches of one bucket. No VAE or text
  encoder runs during training.

Batches are dicts of tensors: ``latents [B, C, h, w]``, the family's text embeddings (``prompt_embeds``,
``pooled_prompt_embeds`` for FLUX), and ``original_size``, ``crop_top_left``, ``target_size`` (int64 ``[B, 2]``, in
``(height, width)`` / ``(top, left)`` order, SDXL's micro-conditioning). When the data has masks, every batch also holds
``loss_mask [B, 1, h, w]`` (float32 loss weights on the latents' grid, 1 for an image without a mask); when it has
regularization or preservation samples or a folder's ``loss_weight``, ``loss_weight [B]`` (float32) and ``role`` (a list
of :data:`~lightning_lora.objectives.SampleRole` strings, which stay on the host: choosing DOP's rows waits for nothing
on the GPU).

**Random choices are a function of (seed, epoch, sample index)**, never of the global random state: caption dropout
(the cached empty-prompt embedding), the mirrored latent (``random_flip``), which shuffled caption variant, and the
training noise and timestep (``noise [B, C, h, w]`` float32 and ``timesteps [B]`` in training batches).
The sampler hands the dataset ``(epoch, index)`` pairs, so this holds in persistent worker processes too, and a
resumed run draws exactly what the uninterrupted one drew.

**Evaluation data.** :meth:`eval_dataloader` serves the first ``eval_samples`` training images and
:meth:`val_dataloader_fixed` the held-out validation images (``val_images`` folders and/or ``val_fraction``); both in
a fixed order, with the caption as written, no flip and no dropout.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from safetensors.torch import load_file
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from lightning_lora.data.buckets import BucketBatchSampler, ResumableLoader, SmallImages
from lightning_lora.data.build import CacheEntry, CacheReport, OnBadFile, build, plan, usable
from lightning_lora.data.cache import ImageIndex, LatentCache, readable
from lightning_lora.data.recipe import DEFAULT_RESOLUTION, DataRecipe, TextEncoderQuantization
from lightning_lora.data.sources import ImageFolder, Item, Skip, as_folders, scan, split_validation
from lightning_lora.errors import ConfigError
from lightning_lora.families.base import DiffusionFamily, ModelSource
from lightning_lora.objectives import Preservation, mask_weights

__all__ = ["CachedDataset", "DataOptions", "LatentDataModule", "ModelSide", "sample_generator", "uniform"]

log = logging.getLogger(__name__)


def _digest(seed: int, epoch: int, index: int, stream: str) -> int:
    digest = hashlib.blake2b(f"{seed}:{epoch}:{index}:{stream}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def uniform(seed: int, epoch: int, index: int, stream: str) -> float:
    """A number in [0, 1) that depends only on its arguments (not on any random state, process or order)."""
    return _digest(seed, epoch, index, stream) / 2.0**64


def sample_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    """A CPU generator seeded from (seed, epoch, index) alone: the noise and timestep of a sample."""
    return torch.Generator().manual_seed(_digest(seed, epoch, index, "noise") >> 1)


class CachedDataset(Dataset):
    """Reads samples from the cache. Index ``i`` or ``(epoch, i)``; random choices per (seed, epoch, i).

    Args:
        root: the cache folder.
        entries: one per sample (repeats already expanded).
        empty_text_key: the cache key of the empty prompt, for caption dropout.
        seed: seed of the per-sample choices.
        caption_dropout: probability of the empty prompt.
        flip_probability: probability of the mirrored latent (entries without one are never flipped).
        augment: False serves every sample as written (variant 0, no flip, no dropout), for evaluation.
        family: when given (training), each sample also carries its training ``noise`` and ``timesteps``, drawn by
            the family from :func:`sample_generator`, so that they depend on the sample and not on the rank or the
            number of GPUs: 2 GPUs x batch b train what 1 GPU x batch 2b trains.
    """

    def __init__(
        self,
        root: Path,
        entries: list[CacheEntry],
        empty_text_key: str,
        *,
        seed: int = 0,
        caption_dropout: float = 0.0,
        flip_probability: float = 0.5,
        augment: bool = True,
        family: DiffusionFamily | None = None,
    ) -> None:
        self.root = Path(root)
        self.entries = entries
        self.empty_text_key = empty_text_key
        self.seed = seed
        self.caption_dropout = caption_dropout
        self.flip_probability = flip_probability
        self.augment = augment
        self.family = family
        #: Whether samples carry a ``loss_mask`` (any entry has a mask) and a ``loss_weight`` and ``role`` (any entry is
        #: not a plain training sample of weight 1): every sample of a batch has the same keys.
        self.masked = any(e.mask is not None for e in entries)
        self.weighted = any(e.role != "train" or e.loss_weight != 1.0 for e in entries)

    def __len__(self) -> int:
        return len(self.entries)

    def flipped(self, epoch: int, index: int) -> bool:
        """Whether sample ``index`` is served mirrored in ``epoch``."""
        entry = self.entries[index]
        if not self.augment or entry.flip_key is None:
            return False
        return uniform(self.seed, epoch, index, "flip") < self.flip_probability

    def choose(self, epoch: int, index: int) -> tuple[str, str]:
        """``(latent key, text key)`` of sample ``index`` in ``epoch``."""
        entry = self.entries[index]
        if not self.augment:
            return entry.latent_key, entry.text_keys[0]
        latent_key = entry.flip_key if self.flipped(epoch, index) and entry.flip_key else entry.latent_key
        if self.caption_dropout > 0 and uniform(self.seed, epoch, index, "dropout") < self.caption_dropout:
            return latent_key, self.empty_text_key
        variant = int(uniform(self.seed, epoch, index, "variant") * len(entry.text_keys))
        return latent_key, entry.text_keys[variant]

    def __getitem__(self, key: int | tuple[int, int]) -> dict[str, Any]:
        epoch, index = key if isinstance(key, tuple) else (0, key)
        latent_key, text_key = self.choose(epoch, index)
        item: dict[str, Any] = load_file(self.root / "latents" / f"{latent_key}.safetensors")
        item.update(load_file(self.root / "text" / f"{text_key}.safetensors"))
        entry = self.entries[index]
        if self.masked:
            item["loss_mask"] = self._loss_mask(entry, self.flipped(epoch, index), item["latents"])
        if self.weighted:
            item["loss_weight"] = torch.tensor(entry.loss_weight, dtype=torch.float32)
            item["role"] = entry.role
        if self.family is not None:
            generator = sample_generator(self.seed, epoch, index)
            latents = item["latents"][None]
            item["noise"] = self.family.sample_noise(latents, generator)[0]
            item["timesteps"] = self.family.sample_timesteps(latents, generator)[0]
        return item

    def _loss_mask(self, entry: CacheEntry, flipped: bool, latents: torch.Tensor) -> torch.Tensor:
        """The loss weights ``[1, h, w]`` of a sample on its latents' grid: from its mask
        (:func:`~lightning_lora.objectives.mask_weights`), or ones."""
        if entry.mask is None:
            return torch.ones(1, *latents.shape[-2:], dtype=torch.float32)
        key = entry.mask.flip_key if flipped and entry.mask.flip_key else entry.mask.key
        mask = load_file(self.root / "masks" / f"{key}.safetensors")["mask"]
        return mask_weights(mask, entry.mask.unmasked_weight)


@runtime_checkable
class ModelSide(Protocol):
    """What the data module reads of the trainer's model: the family whose latents and text embeddings it caches, and
    the weights they are computed with (:class:`~lightning_lora.module.LoraModule`, which sits above the data)."""

    @property
    def family(self) -> DiffusionFamily: ...

    @property
    def source(self) -> ModelSource: ...

    @property
    def preservation(self) -> Preservation: ...


def _fixed_batches(entries: list[CacheEntry], batch_size: int) -> list[list[int]]:
    """Indices in batches of one bucket, in a fixed order (buckets by first appearance, entries in order)."""
    by_bucket: dict[tuple[int, int], list[int]] = {}
    for i, e in enumerate(entries):
        by_bucket.setdefault(e.bucket, []).append(i)
    return [idx[s : s + batch_size] for idx in by_bucket.values() for s in range(0, len(idx), batch_size)]


class LatentDataModule(LightningDataModule):
    """Training data from folders of captioned images, served from the latent cache.

    Args:
        images: a folder, or a list of folders, of images (jpg, png, webp, gif, tif, bmp, avif or any other format
            Pillow reads; the first frame of an animation). A list item may be a mapping with per-folder options:
            ``{path: data/me, repeats: 5, default_caption: ..., trigger: ..., loss_weight: 1.0, masks: data/me_masks,
            unmasked_weight: 0.0}``; ``masks`` is a folder of masks named like the images (white: train there) or
            ``alpha`` (each image's transparency); ``{path: data/class, role: regularization}`` is a folder of class
            images for ``model.preservation``.
        resolution: the target size in pixels (an image is resized to about ``resolution²`` pixels in the bucket of
            its aspect ratio), or a list of sizes (each image is used at every listed size it is large enough for).
            Multiples of the family's latent divisor (16 for FLUX).
        batch_size: images per batch; a batch holds one bucket.
        cache_dir: where latents and text embeddings are cached; shared safely between runs and configs (keys are
            content hashes). Default: ``<trainer.default_root_dir>/cache``.
        caption_ext: captions are read from the same-named file with this extension; then from ``metadata.jsonl``
            / ``metadata.csv`` in the folder. UTF-8 or UTF-16 (with a byte-order mark); anything else is read as
            Windows-1252 with a note.
        default_caption: the caption (instance prompt) of images without one; null skips them.
        trigger: a trigger word: replaces ``[trigger]`` in captions, else is prepended as the first tag.
        caption_dropout: probability of training a sample with the empty prompt (its embedding is cached).
        shuffle_tags: shuffle the comma-separated tags of captions (from ``caption_variants`` cached orderings).
        keep_tokens: with ``shuffle_tags``, this many leading tags stay in place.
        caption_variants: with ``shuffle_tags``, how many orderings of each caption are cached (each costs one
            text embedding on disk: 4 MB for FLUX at 512 tokens).
        random_flip: mirror images at random (p=0.5); the mirrored latent is cached as a second entry. Leave off
            for subjects whose left and right differ (text, logos, asymmetric faces).
        max_aspect_ratio: the widest and tallest bucket, as long side / short side.
        bucket_step: bucket sides are multiples of this; default 64 when every resolution is a multiple of 64,
            else the family's latent divisor.
        max_upscale: images are never enlarged by more than this factor to fill their bucket (1.0: never).
        min_resolution: an image too small for ``resolution`` goes to a smaller bucket (steps of ``bucket_step``)
            down to this size; default half the smallest resolution.
        small_images: an image too small even for ``min_resolution``: ``skip`` it, or ``upscale`` it into the
            smallest bucket.
        alpha_background: the colour transparent pixels are composited on (a name or ``#rrggbb``).
        val_images: folder(s) of held-out validation images (same caption rules); never trained on.
        val_fraction: hold out this fraction of the training images (chosen by file-name hash, so stable).
        on_bad_file: ``skip`` files that cannot be used (one line each, counted in the summary), or stop with an
            ``error``. Notes (a caption read as Windows-1252 or cut, a metadata row naming no image) never stop.
        num_workers: DataLoader worker processes for training.
        cache_workers: worker processes that decode and resize images while the encoder runs; default: CPU cores
            (at most 8).
        encode_batch_size: images / captions per encoder call while building the cache.
        text_encoder_quantization: load the text encoders in ``nf4`` (bitsandbytes, CUDA) or ``fp8`` while caching
            captions and sample prompts, so that FLUX's T5 (9.5 GB in bf16) fits a small card; the embeddings differ
            slightly from bf16 ones and are cached under their own keys.
        eval_samples: how many training images (the first, in folder and file-name order) the fixed evaluation
            loss uses.
        seed: seed of the batch order and the per-sample random choices; null uses the run's ``seed_everything``.
    """

    reads_images: ClassVar[bool] = True
    """Whether creating it lists the image folders (:meth:`scan`); :class:`DataOptions` does not."""

    def __init__(
        self,
        images: str | list[str | ImageFolder],
        resolution: int | list[int] = DEFAULT_RESOLUTION,
        batch_size: int = 1,
        cache_dir: str | None = None,
        caption_ext: str = ".txt",
        default_caption: str | None = None,
        trigger: str | None = None,
        caption_dropout: float = 0.0,
        shuffle_tags: bool = False,
        keep_tokens: int = 0,
        caption_variants: int = 4,
        random_flip: bool = False,
        max_aspect_ratio: float = 2.0,
        bucket_step: int | None = None,
        max_upscale: float = 1.0,
        min_resolution: int | None = None,
        small_images: SmallImages = "skip",
        alpha_background: str = "white",
        val_images: str | list[str | ImageFolder] | None = None,
        val_fraction: float = 0.0,
        on_bad_file: OnBadFile = "skip",
        num_workers: int = 0,
        cache_workers: int | None = None,
        encode_batch_size: int = 4,
        text_encoder_quantization: TextEncoderQuantization = "none",
        eval_samples: int = 4,
        seed: int | None = None,
    ) -> None:
        super().__init__()
        #: The options, checked once (:mod:`lightning_lora.data.recipe`): what the cache, the memory planner and the
        #: callbacks read.
        self.recipe = DataRecipe(
            folders=tuple(as_folders(images, "data.images")),
            resolutions=(resolution,) if isinstance(resolution, int) else tuple(resolution),
            batch_size=batch_size,
            cache_dir=cache_dir,
            caption_ext=caption_ext,
            default_caption=default_caption,
            trigger=trigger,
            caption_dropout=caption_dropout,
            shuffle_tags=shuffle_tags,
            keep_tokens=keep_tokens,
            caption_variants=caption_variants,
            random_flip=random_flip,
            max_aspect_ratio=max_aspect_ratio,
            bucket_step=bucket_step,
            max_upscale=max_upscale,
            min_resolution=min_resolution,
            small_images=small_images,
            alpha_background=alpha_background,
            val_folders=tuple(as_folders(val_images, "data.val_images")) if val_images is not None else (),
            val_fraction=val_fraction,
            on_bad_file=on_bad_file,
            num_workers=num_workers,
            cache_workers=cache_workers,
            encode_batch_size=encode_batch_size,
            text_encoder_quantization=text_encoder_quantization,
            eval_samples=eval_samples,
            seed=seed,
        )
        self.items: list[Item] = []
        self.val_items: list[Item] = []
        self.scan_skips: list[Skip] = []
        if self.reads_images:
            self.scan()
        self.train_entries: list[CacheEntry] = []
        self.val_entries: list[CacheEntry] = []
        self.report: CacheReport | None = None
        self._cache: LatentCache | None = None

    def scan(self) -> None:
        """List the images and their captions (no pixels are read): the training and validation items and what is
        left out. A folder that does not exist, or data without any image, is a :class:`ConfigError`."""
        recipe = self.recipe
        options: dict[str, Any] = {
            "caption_ext": recipe.caption_ext,
            "default_caption": recipe.default_caption,
            "trigger": recipe.trigger,
        }
        self.items, self.scan_skips = scan(recipe.folders, **options)
        self.val_items = []
        if recipe.val_folders:
            self.val_items, val_skips = scan(recipe.val_folders, **options, option="data.val_images")
            self.scan_skips += val_skips
        if recipe.val_fraction > 0:  # of the images to learn: class images are never held out
            learn = [i for i in self.items if i.role == "train"]
            kept, held = split_validation(learn, recipe.val_fraction)
            self.items = kept + [i for i in self.items if i.role != "train"]
            self.val_items += held

    # -- the model's side ---------------------------------------------------------------------------------------
    def _model(self) -> ModelSide:
        """The trainer's model, as the data module reads it (its family and weights)."""
        module = self.trainer.lightning_module if self.trainer is not None else None
        if not isinstance(module, ModelSide):
            raise RuntimeError("LatentDataModule needs a Trainer with a LoraModule attached")
        return module

    def cache(self) -> LatentCache:
        """The cache for the attached trainer's model (family, weights)."""
        if self._cache is None:
            model = self._model()
            assert self.trainer is not None
            root = self.recipe.cache_root(self.trainer.default_root_dir)
            self._cache = LatentCache(root, model.family, model.source, self.recipe.text_encoder_quantization)
        return self._cache

    # -- building ----------------------------------------------------------------------------------------------
    def build_cache(
        self,
        family: DiffusionFamily,
        source: ModelSource,
        device: torch.device | str,
        *,
        preservation: Preservation | None = None,
        default_root_dir: str | None = None,
        progress: bool = True,
    ) -> CacheReport:
        """Build whatever is missing from the cache for this model (and its ``model.preservation``: the preservation
        captions); return the report (``lightning-lora cache``)."""
        recipe = self.recipe
        spec = recipe.spec(family, preservation)
        cache = LatentCache(recipe.cache_root(default_root_dir), family, source, recipe.text_encoder_quantization)
        self.report = build(
            cache,
            self.items,
            self.val_items,
            spec,
            torch.device(device),
            scan_skips=self.scan_skips,
            batch_size=recipe.encode_batch_size,
            workers=recipe.cache_worker_count,
            on_bad_file=recipe.on_bad_file,
            progress=progress,
        )
        self._cache = cache
        self.train_entries, self.val_entries = self.report.train, self.report.validation
        return self.report

    @override
    def prepare_data(self) -> None:
        assert self.trainer is not None
        model = self._model()
        report = self.build_cache(
            model.family,
            model.source,
            self.trainer.strategy.root_device,
            preservation=model.preservation,
            default_root_dir=self.trainer.default_root_dir,
        )
        rank_zero_info(report.format())

    @override
    def setup(self, stage: str) -> None:
        cache = self.cache()
        if self.report is None or self.report.root != cache.root:  # not built in this process (another rank)
            spec = self.recipe.spec(cache.family, self._model().preservation)
            index = ImageIndex(cache.root)  # read-only here: rank 0 wrote it in prepare_data
            self.train_entries = usable(cache, plan(cache, self.items, spec, index)[0])
            self.val_entries = usable(cache, plan(cache, self.val_items, spec, index, validation=True)[0])
        keys = {cache.text_key("")} | {k for e in self.train_entries + self.val_entries for k in e.text_keys}
        missing = [k for k in keys if not readable(cache.text_path(k))]
        if missing:
            raise RuntimeError(f"text cache incomplete after prepare_data ({len(missing)} texts missing)")
        if not self.train_entries:
            raise ConfigError("data.images: no usable images after caching (see the warnings above).")
        if self.val_items and not self.val_entries:
            rank_zero_warn("data.val_images / data.val_fraction: no usable validation image; val/loss is not logged.")

    def _seed(self) -> int:
        seed = self.recipe.seed
        return seed if seed is not None else int(os.environ.get("PL_GLOBAL_SEED", 0))

    def _dataset(self, entries: list[CacheEntry], augment: bool) -> CachedDataset:
        cache = self.cache()
        return CachedDataset(
            cache.root,
            entries,
            cache.text_key(""),
            seed=self._seed(),
            caption_dropout=self.recipe.caption_dropout,
            augment=augment,
            family=cache.family if augment else None,
        )

    def expanded_entries(self) -> list[CacheEntry]:
        """The training samples of one epoch: every entry ``repeats`` times."""
        return [e for e in self.train_entries for _ in range(e.repeats)]

    @override
    def train_dataloader(self) -> DataLoader:
        world_size, rank = (self.trainer.world_size, self.trainer.global_rank) if self.trainer else (1, 0)
        samples = self.expanded_entries()
        bucket_ids = {b: i for i, b in enumerate(sorted({e.bucket for e in samples}))}
        sampler = BucketBatchSampler(
            [bucket_ids[e.bucket] for e in samples],
            self.recipe.batch_size,
            seed=self._seed(),
            num_replicas=world_size,
            rank=rank,
            tag_epoch=True,
        )
        if len(sampler) == 0:
            raise ConfigError(
                f"data: {len(samples)} images make no batch for {world_size} GPUs; add images or lower data.batch_size."
            )
        # Pinned batches let the copy to a CUDA device overlap with the previous step.
        pin = self.trainer is not None and self.trainer.strategy.root_device.type == "cuda"
        return ResumableLoader(
            self._dataset(samples, augment=True), sampler, num_workers=self.recipe.num_workers, pin_memory=pin
        )

    def _fixed_loader(self, entries: list[CacheEntry]) -> DataLoader:
        return DataLoader(
            self._dataset(entries, augment=False),
            batch_sampler=_fixed_batches(entries, self.recipe.batch_size),
            generator=torch.Generator().manual_seed(0),  # observing a run must not draw from its random state
        )

    def eval_dataloader(self) -> DataLoader:
        """The first ``eval_samples`` training images (one entry each), fixed order, no augmentation: for the
        fixed evaluation loss."""
        first: dict[Path, CacheEntry] = {}
        for e in self.train_entries:
            if e.role == "train":  # the images to learn: not the regularization or preservation samples
                first.setdefault(e.image, e)
        return self._fixed_loader(list(first.values())[: self.recipe.eval_samples])

    def val_dataloader_fixed(self) -> DataLoader | None:
        """Every held-out validation entry in a fixed order, without augmentation (caption as written, no flip, no
        dropout); ``None`` when there is no validation data. For ``val/loss``."""
        if not self.val_entries:
            return None
        return self._fixed_loader(self.val_entries)

    @property
    def skipped(self) -> list[Skip]:
        return list(self.report.skipped) if self.report is not None else list(self.scan_skips)


class DataOptions(LatentDataModule):
    """The ``data:`` options without the data: what ``lightning-lora plan`` reads (resolution, batch size, the text
    encoders' precision) before any image exists. It takes exactly :class:`LatentDataModule`'s options and checks
    them the same way, but lists no folder."""

    reads_images: ClassVar[bool] = False
