"""Aspect-ratio buckets (pure geometry) and the bucket batch sampler (determinism, ranks, mid-epoch resume)."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from lightning_lora.data.buckets import BucketBatchSampler, BucketSpec, ResumableLoader, bucket_sizes, cover


@pytest.mark.parametrize(("resolution", "step"), [(512, 64), (1024, 64), (768, 64), (1024, 16), (32, 16)])
def test_bucket_sizes_are_multiples_of_the_step_and_about_the_target_area(resolution: int, step: int) -> None:
    sizes = bucket_sizes(resolution, step, 2.0)
    assert (resolution, resolution) in sizes
    for w, h in sizes:
        assert w % step == 0 and h % step == 0
        assert w * h <= resolution**2
        assert max(w / h, h / w) <= 2.0
        assert w * h >= resolution**2 * (1 - 2 * step / min(w, h)) - 1  # the largest height that fits per width
    assert {(h, w) for w, h in sizes} == set(sizes)  # portrait and landscape alike
    assert bucket_sizes(512, 64, 2.0) == ((384, 640), (448, 576), (512, 512), (576, 448), (640, 384))


def test_nearest_bucket_cover_and_crop() -> None:
    spec = BucketSpec((1024,), 64)
    [(res, p)], reason = spec.place(4000, 3000)  # a 4:3 photo
    assert res == 1024 and reason is None
    assert p.bucket == (1152, 896) and p.original == (4000, 3000)
    assert p.resized[0] >= 1152 and p.resized[1] == 896 and p.crop == ((p.resized[0] - 1152) // 2, 0)
    left, top, right, bottom = p.source_box()
    assert top == 0 and bottom == pytest.approx(3000) and right - left == pytest.approx(1152 * 3000 / 896, rel=1e-3)
    assert spec.place(3000, 4000)[0][0][1].bucket == (896, 1152)  # portrait gets portrait
    assert spec.place(2000, 2000)[0][0][1].bucket == (1024, 1024)
    assert spec.place(9000, 1000)[0][0][1].bucket == (1408, 704)  # beyond the widest: the widest, cropped
    # Mirrored: the crop's left offset measured in the mirrored image.
    q = cover(300, 100, (64, 64))
    assert q.crop_top_left() == (0, q.crop[0]) and q.crop_top_left(flipped=True) == (0, q.resized[0] - q.crop[0] - 64)


def test_small_images_step_down_and_then_are_skipped_or_upscaled() -> None:
    spec = BucketSpec((1024,), 64, min_resolution=512)
    [(_, p)], _ = spec.place(1000, 1000)  # a little too small for 1024x1024: the next bucket down, not enlarged
    assert p.bucket == (960, 960) and p.scale <= 1.0
    [(_, p)], _ = spec.place(700, 500)
    assert p.scale <= 1.0 and math.isclose(p.bucket[0] / p.bucket[1], 700 / 500, rel_tol=0.15)
    placements, reason = spec.place(300, 300)
    assert placements == [] and "300x300 is smaller than the smallest bucket" in reason
    assert "data.small_images: upscale" in reason
    upscale = BucketSpec((1024,), 64, min_resolution=512, small_images="upscale")
    [(_, p)], reason = upscale.place(300, 300)
    assert reason is None and p.bucket == (512, 512) and p.scale > 1.7
    # max_upscale lets a slightly small image fill the full-size bucket.
    assert BucketSpec((1024,), 64, max_upscale=1.1).place(1000, 1000)[0][0][1].bucket == (1024, 1024)


def test_several_resolutions() -> None:
    spec = BucketSpec((1024, 512), 64, min_resolution=256)
    big = spec.place(3000, 2000)[0]
    assert [r for r, _ in big] == [1024, 512]
    medium = spec.place(700, 700)[0]  # too small for 1024: used at 512 only
    assert [(r, p.bucket) for r, p in medium] == [(512, (512, 512))]
    assert spec.place(300, 300)[0][0][1].bucket == (256, 256)  # steps down from 512 to the ladder's 256


# -- sampler -------------------------------------------------------------------------------------------------------


def _buckets(n: int = 23) -> list[int]:
    return [i % 3 for i in range(n)]  # three buckets of 8, 8, 7 samples


def test_batches_hold_one_bucket_and_cover_the_epoch() -> None:
    buckets = _buckets()
    sampler = BucketBatchSampler(buckets, batch_size=3, seed=1)
    batches = list(sampler)
    assert len(batches) == len(sampler) == 3 + 3 + 3  # 8 -> 3+3+2, 8 -> 3+3+2, 7 -> 3+3+1
    assert all(len({buckets[i] for i in b}) == 1 for b in batches)
    assert sorted(i for b in batches for i in b) == list(range(len(buckets)))
    drop = BucketBatchSampler(buckets, batch_size=3, seed=1, drop_last=True)
    assert all(len(b) == 3 for b in drop) and len(drop) == 6


def test_order_is_a_function_of_seed_and_epoch_only() -> None:
    before = torch.get_rng_state()
    a = BucketBatchSampler(_buckets(), 2, seed=5)
    b = BucketBatchSampler(_buckets(), 2, seed=5)
    first = list(a)
    assert list(b) == first
    a.set_epoch(1)
    assert list(a) != first
    b.set_epoch(1)
    assert list(b) == list(a)
    assert list(BucketBatchSampler(_buckets(), 2, seed=6)) != first
    assert torch.equal(torch.get_rng_state(), before)  # the global random state is never touched


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_every_rank_gets_the_same_number_of_batches(ranks: int) -> None:
    buckets = _buckets(29)
    samplers = [BucketBatchSampler(buckets, 2, seed=3, num_replicas=ranks, rank=r) for r in range(ranks)]
    per_rank = [list(s) for s in samplers]
    assert len({len(p) for p in per_rank}) == 1 and all(
        len(p) == len(s) for p, s in zip(per_rank, samplers, strict=True)
    )
    seen = [i for p in per_rank for b in p for i in b]
    assert len(seen) == len(set(seen))  # no sample on two ranks
    # One bucket per global batch: the ranks' i-th batches share a bucket, and together they are exactly the i-th
    # batch of one rank with a ranks-times larger batch (so 2 GPUs x batch b train on what 1 GPU x 2b would).
    single = list(BucketBatchSampler(buckets, 2 * ranks, seed=3, drop_last=True))
    assert len(single) == len(per_rank[0])
    for step, together in enumerate(single):
        parts = [p[step] for p in per_rank]
        assert len({buckets[i] for part in parts for i in part}) == 1
        assert [i for part in parts for i in part] == together
    with pytest.raises(ValueError):
        BucketBatchSampler(buckets, 2, num_replicas=2, rank=2)


def test_tag_epoch_pairs() -> None:
    sampler = BucketBatchSampler(_buckets(), 4, seed=0, tag_epoch=True)
    sampler.set_epoch(3)
    batches = list(sampler)
    assert all(epoch == 3 for b in batches for epoch, _ in b)
    plain = BucketBatchSampler(_buckets(), 4, seed=0)
    plain.set_epoch(3)
    assert [[i for _, i in b] for b in batches] == list(plain)


class _Echo(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 23

    def __getitem__(self, key):
        epoch, index = key
        return torch.tensor([epoch, index])


@pytest.mark.parametrize("workers", [0, 2])
def test_resumable_loader_continues_mid_epoch(workers: int) -> None:
    def loader() -> ResumableLoader:
        return ResumableLoader(_Echo(), BucketBatchSampler(_buckets(), 2, seed=9, tag_epoch=True), num_workers=workers)

    full = loader()
    full.sampler_state.set_epoch(2)
    reference = [b.tolist() for b in full]
    interrupted = loader()
    interrupted.sampler_state.set_epoch(2)
    taken = []
    for i, b in enumerate(interrupted):
        taken.append(b.tolist())
        if i == 4:
            break
    state = interrupted.state_dict()
    assert state == {"epoch": 2, "consumed": 5}
    resumed = loader()
    resumed.load_state_dict(state)
    resumed.sampler_state.set_epoch(2)
    assert taken + [b.tolist() for b in resumed] == reference
    assert Counter(len(b) for b in reference)  # batches were served through the workers, epoch tags intact
    assert all(row[0] == 2 for b in reference for row in b)
