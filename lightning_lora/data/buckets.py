"""Aspect-ratio buckets, and a stateful, distributed sampler whose batches each hold one bucket.

Buckets
-------
A *bucket* is a ``width x height`` in pixels, both multiples of a step (64, or the family's latent divisor when a
resolution is not a multiple of 64), with an area of at most ``resolution²`` and an aspect ratio of at most
``max_aspect``. For each width the tallest height that fits the area is taken, so every bucket of one resolution has
about the same number of pixels (and the same cost per step). Example, resolution 512, step 64, max aspect 2:
``384x640, 448x576, 512x512, 576x448, 640x384``.

An image of ``W x H`` (as viewed) goes to the bucket with the nearest aspect ratio (in log space), is scaled by
``s = max(bw/W, bh/H)`` so it covers the bucket, and is center-cropped: :class:`Placement` records the original
size, the bucket, the resized size and the crop offset (SDXL's ``original_size``, ``target_size`` and
``crop_top_left`` come from it).

Images are never enlarged by more than ``max_upscale`` (1.0: never). An image too small for a resolution is used at
the other, smaller resolutions of the list only. At the smallest resolution it steps down a *ladder* of smaller
resolutions (one step at a time, down to ``min_resolution``) to the largest bucket it fills; an image smaller than
even that bucket is skipped, or enlarged into it when ``small_images`` is ``upscale``.

Sampler
-------
:class:`BucketBatchSampler` groups sample indices by bucket (samples of one bucket share a latent shape, so they can
be stacked), shuffles each bucket and the order of the batches with a generator seeded by ``seed + epoch``, and hands
rank ``r`` of ``n`` every n-th batch; every rank gets the same number of batches (DDP needs it). Nothing is drawn from
the global random state: the order of epoch ``e`` is the same in a run that was never interrupted and in one that was
resumed. With ``tag_epoch`` it yields ``(epoch, index)`` pairs, so a dataset can make its per-sample random choices a
function of (seed, epoch, index), even in persistent worker processes that never see ``set_epoch``.

:class:`ResumableLoader` is a ``DataLoader`` with ``state_dict`` / ``load_state_dict`` (the protocol Lightning looks
for to restore a loader's position; without it a resumed epoch starts again from its first batch). It counts the
batches it has handed to the training loop in the current epoch; after a resume it skips exactly those in the
restored epoch. It also gets its own generator, so creating its iterator (which draws a base seed for worker
processes) does not consume the global random state either.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

__all__ = ["BucketBatchSampler", "BucketSpec", "Placement", "ResumableLoader", "bucket_sizes", "cover"]

SmallImages = Literal["skip", "upscale"]


@dataclass(frozen=True)
class Placement:
    """How one image becomes the pixels of one bucket. Sizes are ``(width, height)``; offsets ``(left, top)``."""

    original: tuple[int, int]
    bucket: tuple[int, int]
    resized: tuple[int, int]
    crop: tuple[int, int]

    @property
    def scale(self) -> float:
        return max(self.resized[0] / self.original[0], self.resized[1] / self.original[1])

    def source_box(self) -> tuple[float, float, float, float]:
        """The crop as a box (left, top, right, bottom) in pixels of the original image."""
        sx, sy = self.resized[0] / self.original[0], self.resized[1] / self.original[1]
        left, top = self.crop
        return left / sx, top / sy, (left + self.bucket[0]) / sx, (top + self.bucket[1]) / sy

    def crop_top_left(self, flipped: bool = False) -> tuple[int, int]:
        """``(top, left)`` of the crop in the resized image; for the mirrored image, in the mirrored image."""
        left = self.resized[0] - self.crop[0] - self.bucket[0] if flipped else self.crop[0]
        return self.crop[1], left


@lru_cache(maxsize=256)
def bucket_sizes(resolution: int, step: int, max_aspect: float) -> tuple[tuple[int, int], ...]:
    """The buckets ``(width, height)`` of one resolution, sorted by aspect ratio (tall to wide)."""
    area = resolution * resolution
    sizes: set[tuple[int, int]] = set()
    for width in range(step, int(math.ceil(resolution * math.sqrt(max_aspect))) + step, step):
        height = (area // width) // step * step
        if height >= step and max(width / height, height / width) <= max_aspect + 1e-9:
            sizes.update({(width, height), (height, width)})  # a portrait bucket for every landscape one
    return tuple(sorted(sizes, key=lambda s: (s[0] / s[1], -s[0] * s[1])))


def nearest_bucket(width: int, height: int, buckets: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """The bucket with the nearest aspect ratio in log space; ties go to the larger bucket."""
    target = math.log(width / height)
    return min(buckets, key=lambda b: (round(abs(math.log(b[0] / b[1]) - target), 9), -b[0] * b[1]))


def cover(width: int, height: int, bucket: tuple[int, int]) -> Placement:
    """Scale ``width x height`` to cover ``bucket``, then center-crop."""
    bw, bh = bucket
    scale = max(bw / width, bh / height)
    rw, rh = max(bw, round(width * scale)), max(bh, round(height * scale))
    return Placement((width, height), (bw, bh), (rw, rh), ((rw - bw) // 2, (rh - bh) // 2))


@dataclass(frozen=True)
class BucketSpec:
    """Bucketing options (see the module docstring); validated by the data module."""

    resolutions: tuple[int, ...]
    step: int
    max_aspect: float = 2.0
    max_upscale: float = 1.0
    min_resolution: int | None = None
    small_images: SmallImages = "skip"

    def ladder(self) -> list[int]:
        """The resolutions the smallest one steps down to for small images, largest first."""
        smallest = min(self.resolutions)
        floor = self.min_resolution if self.min_resolution is not None else smallest
        return list(range(smallest, max(floor, self.step) - 1, -self.step)) or [smallest]

    def at(self, resolution: int, width: int, height: int) -> Placement:
        """The placement of a ``width x height`` image in its nearest bucket of ``resolution``."""
        return cover(width, height, nearest_bucket(width, height, bucket_sizes(resolution, self.step, self.max_aspect)))

    def place(self, width: int, height: int) -> tuple[list[tuple[int, Placement]], str | None]:
        """The ``(resolution, placement)`` pairs of an image, or ``([], reason)`` when it is too small."""
        limit = self.max_upscale + 1e-9
        smallest = min(self.resolutions)
        larger = [r for r in sorted(set(self.resolutions), reverse=True) if r != smallest]
        placements = [(r, p) for r in larger if (p := self.at(r, width, height)).scale <= limit]
        ladder = self.ladder()
        for level in ladder:
            p = self.at(level, width, height)
            if p.scale <= limit:
                return [*placements, (smallest, p)], None
        p = self.at(ladder[-1], width, height)
        if self.small_images == "upscale":
            return [(smallest, p)], None
        return [], (
            f"{width}x{height} is smaller than the smallest bucket it could use ({p.bucket[0]}x{p.bucket[1]}, "
            f"data.min_resolution {ladder[-1]}); lower data.min_resolution or set data.small_images: upscale"
        )


class BucketBatchSampler(Sampler[list[Any]]):
    """Yield lists of sample indices (or ``(epoch, index)`` pairs); every list comes from one bucket.

    Args:
        buckets: the bucket id of each sample (e.g. its latent shape's index).
        batch_size: samples per batch (per rank).
        seed: base seed of the shuffles; epoch ``e`` uses ``seed + e``.
        shuffle: shuffle samples within buckets and the order of batches.
        drop_last: drop each bucket's last incomplete batch.
        num_replicas: number of ranks sharing the data.
        rank: this rank.
        tag_epoch: yield ``(epoch, index)`` pairs instead of indices.
    """

    def __init__(
        self,
        buckets: Sequence[int],
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
        num_replicas: int = 1,
        rank: int = 0,
        tag_epoch: bool = False,
    ) -> None:
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is not in [0, {num_replicas})")
        self.buckets = list(buckets)
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.num_replicas = num_replicas
        self.rank = rank
        self.tag_epoch = tag_epoch
        self.epoch = 0
        self.skip = 0
        self._cached: tuple[int, list[list[int]]] | None = None

    def set_epoch(self, epoch: int) -> None:
        """Called by Lightning at the start of every epoch (through :attr:`sampler`)."""
        self.epoch = epoch

    @property
    def sampler(self) -> BucketBatchSampler:
        """Itself. Lightning sets the epoch on ``loader.sampler`` and ``loader.batch_sampler.sampler``, never on the
        batch sampler itself: without this every epoch would replay epoch 0's order, flips, dropouts and noise."""
        return self

    def global_batches(self, epoch: int) -> list[list[int]]:
        """The global batches of ``epoch`` in order: ``batch_size x num_replicas`` samples of one bucket each, rank
        ``r`` taking the ``r``-th slice. A pure function of (seed, epoch, buckets, global batch size), so 2 ranks x
        batch b see exactly the samples of 1 rank x batch 2b, step by step."""
        if self._cached is not None and self._cached[0] == epoch:
            return self._cached[1]
        generator = torch.Generator().manual_seed(self.seed + epoch)
        by_bucket: dict[int, list[int]] = {}
        for index, bucket in enumerate(self.buckets):
            by_bucket.setdefault(bucket, []).append(index)
        size = self.batch_size * self.num_replicas
        # With several ranks an incomplete global batch cannot be split evenly (DDP needs every rank to step).
        keep_partial = not self.drop_last and self.num_replicas == 1
        batches: list[list[int]] = []
        for bucket in sorted(by_bucket):
            indices = by_bucket[bucket]
            if self.shuffle:
                indices = [indices[i] for i in torch.randperm(len(indices), generator=generator).tolist()]
            for start in range(0, len(indices), size):
                batch = indices[start : start + size]
                if len(batch) == size or keep_partial:
                    batches.append(batch)
        if self.shuffle:
            batches = [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]
        self._cached = (epoch, batches)
        return batches

    def __iter__(self) -> Iterator[list[Any]]:
        epoch = self.epoch
        skip, self.skip = self.skip, 0
        lo, hi = self.rank * self.batch_size, (self.rank + 1) * self.batch_size
        for batch in self.global_batches(epoch)[skip:]:
            mine = batch[lo:hi]
            yield [(epoch, i) for i in mine] if self.tag_epoch else list(mine)

    def __len__(self) -> int:
        return len(self.global_batches(self.epoch))


class ResumableLoader(DataLoader):
    """A DataLoader over a :class:`BucketBatchSampler` whose position in the epoch survives a restart."""

    def __init__(
        self,
        dataset: Dataset,
        batch_sampler: BucketBatchSampler,
        num_workers: int = 0,
        pin_memory: bool = False,
        collate_fn: Callable[[list[Any]], Any] | None = None,
    ) -> None:
        super().__init__(
            dataset,
            batch_sampler=batch_sampler,
            collate_fn=collate_fn,
            num_workers=num_workers,
            persistent_workers=num_workers > 0,
            pin_memory=pin_memory,
            generator=torch.Generator().manual_seed(batch_sampler.seed),
        )
        self._consumed = 0
        self._resume: tuple[int, int] | None = None

    @property
    def sampler_state(self) -> BucketBatchSampler:
        sampler = self.batch_sampler
        assert isinstance(sampler, BucketBatchSampler)
        return sampler

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        sampler = self.sampler_state
        skip = 0
        if self._resume is not None and self._resume[0] == sampler.epoch:
            skip = self._resume[1]
        self._resume = None
        sampler.skip = skip
        self._consumed = skip
        for batch in super().__iter__():
            self._consumed += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        """Where the training loop is: the epoch and how many of its batches it has taken."""
        return {"epoch": self.sampler_state.epoch, "consumed": self._consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue after the ``consumed`` batches of ``epoch`` when that epoch is iterated next."""
        self._resume = (int(state["epoch"]), int(state["consumed"]))
