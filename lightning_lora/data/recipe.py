"""The data recipe: the ``data:`` options in one frozen object, the way
:class:`~lightning_lora.model.recipe.ModelRecipe` holds the model's.

A user writes these as flat options of ``data:`` in the YAML (``data.resolution``, ``data.batch_size``...): they are
the typed arguments of :class:`~lightning_lora.data.datamodule.LatentDataModule`, which turns them into one
:class:`DataRecipe` when it is created. From then on the recipe is what the rest of the code reads:

* the data module lists the folders and builds the cache from it (:meth:`DataRecipe.spec`: the buckets and what is
  cached, for a family);
* the memory planner (:mod:`lightning_lora.plan`) plans its resolution, batch and caching options, and tries smaller
  ones as ``recipe.replace(...)``: a new recipe, never a change to the live data module;
* the callbacks read the resolution samples are drawn at, and the batch (:func:`data_recipe`).

**The checks of the options alone run when a recipe is created** (:meth:`DataRecipe.check`); the checks against a
model family (resolutions and bucket sides that suit its latent divisor) and against ``model.preservation``
(:meth:`DataRecipe.check_preservation`: regularization folders and triggers for its mode) run in
:meth:`DataRecipe.spec`, once the model is known.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from lightning_lora.data.buckets import BucketSpec, SmallImages
from lightning_lora.data.build import DataSpec, OnBadFile
from lightning_lora.data.images import parse_color
from lightning_lora.data.sources import ImageFolder
from lightning_lora.errors import ConfigError
from lightning_lora.objectives import Preservation

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

    from lightning_lora.families.base import DiffusionFamily

__all__ = ["DEFAULT_RESOLUTION", "DataRecipe", "TextEncoderQuantization", "data_recipe"]

DEFAULT_RESOLUTION = 512
"""``data.resolution`` when the config gives none."""

TextEncoderQuantization = Literal["none", "nf4", "fp8"]


@dataclass(frozen=True)
class DataRecipe:
    """What the data is and how it is served (see the module docstring). The fields mirror
    :class:`~lightning_lora.data.datamodule.LatentDataModule`'s options, whose docstring says what each does; a recipe
    made in Python needs none of them (the defaults are the options' defaults, without any image folder).

    Attributes:
        folders: ``data.images`` as folders (a path becomes an :class:`ImageFolder` with its defaults).
        resolutions: ``data.resolution`` as sizes, kept largest first and each once.
        val_folders: ``data.val_images`` as folders (none: no held-out folder).
        cache_workers: ``data.cache_workers`` as written (None: :attr:`cache_worker_count` decides).
        caption_variants: ``data.caption_variants`` as written (:attr:`cached_variants` is what is cached).
    """

    folders: tuple[ImageFolder, ...] = ()
    resolutions: tuple[int, ...] = (DEFAULT_RESOLUTION,)
    batch_size: int = 1
    cache_dir: str | None = None
    caption_ext: str = ".txt"
    default_caption: str | None = None
    trigger: str | None = None
    caption_dropout: float = 0.0
    shuffle_tags: bool = False
    keep_tokens: int = 0
    caption_variants: int = 4
    random_flip: bool = False
    max_aspect_ratio: float = 2.0
    bucket_step: int | None = None
    max_upscale: float = 1.0
    min_resolution: int | None = None
    small_images: SmallImages = "skip"
    alpha_background: str = "white"
    val_folders: tuple[ImageFolder, ...] = ()
    val_fraction: float = 0.0
    on_bad_file: OnBadFile = "skip"
    num_workers: int = 0
    cache_workers: int | None = None
    encode_batch_size: int = 4
    text_encoder_quantization: TextEncoderQuantization = "none"
    eval_samples: int = 4
    seed: int | None = None

    def __post_init__(self) -> None:
        # Sequences as tuples, and the sizes largest first (the first is the default size of sample images).
        object.__setattr__(self, "folders", tuple(self.folders))
        object.__setattr__(self, "val_folders", tuple(self.val_folders))
        object.__setattr__(self, "resolutions", tuple(sorted(set(self.resolutions), reverse=True)))
        self.check()

    def check(self) -> None:
        """Refuse an option out of its range with a :class:`ConfigError` that names it."""
        sizes = self.resolutions
        shown: Any = sizes[0] if len(sizes) == 1 else list(sizes)
        checks = [
            (self.batch_size >= 1, f"data.batch_size: {self.batch_size} must be at least 1."),
            (bool(sizes) and min(sizes) >= 1, f"data.resolution: {shown} must be positive pixels."),
            (0.0 <= self.caption_dropout < 1.0, f"data.caption_dropout: {self.caption_dropout} must be in [0, 1)."),
            (0.0 <= self.val_fraction < 1.0, f"data.val_fraction: {self.val_fraction} must be in [0, 1)."),
            (self.keep_tokens >= 0, f"data.keep_tokens: {self.keep_tokens} must be 0 or more."),
            (self.caption_variants >= 1, f"data.caption_variants: {self.caption_variants} must be at least 1."),
            (self.max_aspect_ratio >= 1.0, f"data.max_aspect_ratio: {self.max_aspect_ratio} must be at least 1."),
            (self.max_upscale >= 1.0, f"data.max_upscale: {self.max_upscale} must be at least 1 (1: never enlarge)."),
            (self.encode_batch_size >= 1, f"data.encode_batch_size: {self.encode_batch_size} must be at least 1."),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        for i, folder in enumerate(self.val_folders):
            if folder.role != "train" or folder.loss_weight != 1.0:
                raise ConfigError(
                    f"data.val_images[{i}] ({folder.path!r}): a validation folder is evaluated as written; role and "
                    "loss_weight belong to data.images entries. Remove them here."
                )
        if self.folders and all(f.role == "regularization" for f in self.folders):
            raise ConfigError(
                "data.images: every folder is a regularization folder; add the folder of images to learn (role: "
                "train, the default)."
            )
        try:
            parse_color(self.alpha_background)
        except ValueError as e:
            raise ConfigError(str(e)) from None

    @property
    def resolution(self) -> int:
        """The largest size: what sample images are drawn at by default, and what the memory planner plans."""
        return self.resolutions[0]

    @property
    def background(self) -> tuple[int, int, int]:
        """``alpha_background`` as an RGB triple."""
        return parse_color(self.alpha_background)

    @property
    def cached_variants(self) -> int:
        """How many orderings of each caption are cached: ``caption_variants`` with ``shuffle_tags``, else one."""
        return self.caption_variants if self.shuffle_tags else 1

    @property
    def cache_worker_count(self) -> int:
        """The processes that decode images while the cache is built: ``cache_workers``, by default the CPU cores (at
        most 8)."""
        return min(8, os.cpu_count() or 1) if self.cache_workers is None else self.cache_workers

    def cache_root(self, default_root_dir: str | None) -> Path:
        """The cache folder: ``cache_dir``, by default ``<default_root_dir>/cache`` (the trainer's run folder)."""
        if self.cache_dir is not None:
            return Path(self.cache_dir).expanduser()
        if default_root_dir is None:
            raise RuntimeError("LatentDataModule: no data.cache_dir and no trainer to put the cache under")
        return Path(default_root_dir) / "cache"

    def check_preservation(self, preservation: Preservation) -> None:
        """Refuse ``model.preservation`` where these folders give it nothing to work with (or it leaves one unused),
        with a :class:`ConfigError` that names the options."""
        regularization = [i for i, f in enumerate(self.folders) if f.role == "regularization"]
        mode = preservation.mode
        if regularization and mode == "none":
            i = regularization[0]
            raise ConfigError(
                f"data.images[{i}] ({self.folders[i].path!r}) has role: regularization, which model.preservation.mode: "
                "none leaves unused; set model.preservation.mode: prior (trained against its own images) or dop "
                "(against the base model's own prediction), or remove the role."
            )
        if mode == "prior" and not regularization:
            raise ConfigError(
                "model.preservation.mode: prior trains regularization images against their own target, but no "
                "data.images entry has role: regularization; add one ({path: data/class_images, role: "
                "regularization}), or set model.preservation.mode: none."
            )
        if mode == "dop" and not regularization and not preservation.every_image:
            raise ConfigError(
                "model.preservation.mode: dop has nothing to preserve: no data.images entry has role: regularization "
                "and model.preservation.every_image is false; add a regularization folder, or set every_image: true "
                "(each image again with its trigger removed from the caption)."
            )
        triggers = [self.trigger if f.trigger is None else f.trigger for f in self.folders if f.role == "train"]
        if preservation.every_image and not any(triggers):
            raise ConfigError(
                "model.preservation.every_image: true removes the trigger word from each caption, but no trigger is "
                "set (data.trigger, or a folder's trigger); set the trigger your captions use, or preserve with a "
                "regularization folder instead."
            )

    def spec(self, family: DiffusionFamily, preservation: Preservation | None = None) -> DataSpec:
        """The bucketing and caching options for ``family`` and ``preservation`` (``model.preservation``; None: off);
        :class:`ConfigError` names an option that does not suit them (a resolution or bucket side that is no multiple
        of the family's latent divisor; :meth:`check_preservation`)."""
        preservation = preservation if preservation is not None else Preservation()
        self.check_preservation(preservation)
        d = family.architecture.latent_divisor
        for r in self.resolutions:
            family.check_resolution(r, r, "data.resolution")
        step = self.bucket_step or (64 if all(r % 64 == 0 for r in self.resolutions) else d)
        if step % d or any(r % step for r in self.resolutions):
            raise ConfigError(
                f"data.bucket_step: {step} must be a multiple of {d} ({family.name}'s latent divisor) that divides "
                f"every data.resolution {list(self.resolutions)}."
            )
        smallest = self.resolutions[-1]
        min_resolution = self.min_resolution
        if min_resolution is None:
            min_resolution = max(step, -(-smallest // 2 // step) * step)
        if not step <= min_resolution <= smallest:
            raise ConfigError(
                f"data.min_resolution: {min_resolution} must be between data.bucket_step ({step}) and the smallest "
                f"data.resolution ({smallest})."
            )
        buckets = BucketSpec(
            self.resolutions, step, self.max_aspect_ratio, self.max_upscale, min_resolution, self.small_images
        )
        return DataSpec(
            buckets, self.random_flip, self.cached_variants, self.keep_tokens, self.background, preservation
        )

    def replace(self, **changes: Any) -> DataRecipe:
        """A new recipe with ``changes`` (checked like any recipe; a :class:`ConfigError` for an impossible one)."""
        return dataclasses.replace(self, **changes)


@runtime_checkable
class RecipeData(Protocol):
    """A data module with a data recipe: :class:`~lightning_lora.data.datamodule.LatentDataModule` (or a stand-in that
    serves other batches, such as ``tools/bench.py``'s synthetic ones)."""

    @property
    def recipe(self) -> DataRecipe: ...


def data_recipe(trainer: Trainer) -> DataRecipe | None:
    """The recipe of the data module ``trainer`` runs; None when it runs none, or one without a recipe (a Trainer given
    plain data loaders)."""
    datamodule = trainer.datamodule  # type: ignore[attr-defined]  # Lightning sets it when fit starts
    return datamodule.recipe if isinstance(datamodule, RecipeData) else None
