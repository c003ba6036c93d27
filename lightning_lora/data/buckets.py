"""Batches of one bucket each, in an order that depends only on (seed, epoch), and a loader that can resume mid-epoch.

:class:`BucketBatchSampler` groups sample indices by bucket (samples of one bucket share a latent shape, so they can
be stacked), shuffles each bucket and the order of the batches with a generator seeded by ``seed + epoch``, and hands
rank ``r`` of ``n`` every n-th batch. Nothing is drawn from the global random state: the order of epoch ``e`` is the
same in a run that was never interrupted and in one that was resumed.

:class:`ResumableLoader` is a ``DataLoader`` with ``state_dict`` / ``load_state_dict`` (the protocol Lightning looks
for to restore a loader's position; without it a resumed epoch starts again from its first batch). It counts the
batches it has handed to the training loop in the current epoch; after a resume it skips exactly those in the
restored epoch. It also gets its own generator, so creating its iterator (which draws a base seed for worker
processes) does not consume the global random state either.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

__all__ = ["BucketBatchSampler", "ResumableLoader"]


class BucketBatchSampler(Sampler[list[int]]):
    """Yield lists of sample indices; every list comes from one bucket.

    Args:
        buckets: the bucket id of each sample (e.g. its latent shape's index).
        batch_size: samples per batch (per rank).
        seed: base seed of the shuffles; epoch ``e`` uses ``seed + e``.
        shuffle: shuffle samples within buckets and the order of batches.
        drop_last: drop each bucket's last incomplete batch.
        num_replicas: number of ranks sharing the data.
        rank: this rank.
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
    ) -> None:
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        self.buckets = list(buckets)
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.num_replicas = num_replicas
        self.rank = rank
        self.epoch = 0
        self.skip = 0
        self._cached: tuple[int, list[list[int]]] | None = None

    def set_epoch(self, epoch: int) -> None:
        """Called by Lightning at the start of every epoch."""
        self.epoch = epoch

    def global_batches(self, epoch: int) -> list[list[int]]:
        """All batches of ``epoch`` (every rank's), in order; a pure function of (seed, epoch, buckets)."""
        if self._cached is not None and self._cached[0] == epoch:
            return self._cached[1]
        generator = torch.Generator().manual_seed(self.seed + epoch)
        by_bucket: dict[int, list[int]] = {}
        for index, bucket in enumerate(self.buckets):
            by_bucket.setdefault(bucket, []).append(index)
        batches: list[list[int]] = []
        for bucket in sorted(by_bucket):
            indices = by_bucket[bucket]
            if self.shuffle:
                indices = [indices[i] for i in torch.randperm(len(indices), generator=generator).tolist()]
            for start in range(0, len(indices), self.batch_size):
                batch = indices[start : start + self.batch_size]
                if len(batch) == self.batch_size or not self.drop_last:
                    batches.append(batch)
        if self.shuffle:
            batches = [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]
        # Every rank gets the same number of batches (DDP needs it): drop the remainder.
        usable = len(batches) - len(batches) % self.num_replicas if self.num_replicas > 1 else len(batches)
        self._cached = (epoch, batches[:usable])
        return self._cached[1]

    def __iter__(self) -> Iterator[list[int]]:
        mine = self.global_batches(self.epoch)[self.rank :: self.num_replicas]
        skip, self.skip = self.skip, 0
        yield from mine[skip:]

    def __len__(self) -> int:
        return len(self.global_batches(self.epoch)) // self.num_replicas


class ResumableLoader(DataLoader):
    """A DataLoader over a :class:`BucketBatchSampler` whose position in the epoch survives a restart."""

    def __init__(
        self, dataset: Dataset, batch_sampler: BucketBatchSampler, num_workers: int = 0, pin_memory: bool = False
    ) -> None:
        super().__init__(
            dataset,
            batch_sampler=batch_sampler,
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
