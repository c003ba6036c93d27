"""The data module on a tiny FLUX: batches (one bucket each, SDXL size records), random choices that are a pure
function of (seed, epoch, index) in worker processes too, repeats, validation data, and exact resume of a run with
flips, caption dropout and shuffled captions (the ``cache`` verb is in tests/cli/test_cache_verb.py)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import assert_same_run, run_cli, write_config
from PIL import Image

from lightning_lora.data.datamodule import LatentDataModule, uniform
from lightning_lora.errors import ConfigError
from lightning_lora.families.base import ModelSource
from lightning_lora.families.flux import Flux

SIZES = [(40, 48), (64, 32), (48, 48), (32, 64), (50, 40), (96, 32)]
TAGS = ["cat", "red hat", "smiling", "outdoors", "bokeh", "35mm"]


def _folder(folder: Path, n: int, seed: int = 0) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i in range(n):
        w, h = SIZES[i % len(SIZES)]
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(folder / f"img{i}.png")
        (folder / f"img{i}.txt").write_text(", ".join(TAGS[i % 3 :] + TAGS[: i % 3]))
    return folder


def _module(tmp_path: Path, images, **options) -> LatentDataModule:
    defaults = {"resolution": 32, "batch_size": 2, "max_aspect_ratio": 3.0, "cache_dir": str(tmp_path / "cache")}
    return LatentDataModule(images=images, **{**defaults, **options})


def _built(dm: LatentDataModule, model: Path) -> LatentDataModule:
    dm.build_cache(Flux(max_sequence_length=16), ModelSource(str(model), dtype=torch.float32), "cpu", progress=False)
    dm.setup("fit")
    return dm


def _epoch(loader, epoch: int) -> list[dict[str, torch.Tensor]]:
    loader.batch_sampler.set_epoch(epoch)
    return list(loader)


def test_batches_one_bucket_each_with_size_records(tmp_path: Path, tiny_flux_dir: Path) -> None:
    dm = _built(_module(tmp_path, str(_folder(tmp_path / "data", 6)), batch_size=3), tiny_flux_dir)
    batches = _epoch(dm.train_dataloader(), 0)
    keys = {"latents", "prompt_embeds", "pooled_prompt_embeds", "original_size", "crop_top_left", "target_size"}
    assert all(set(b) == keys | {"noise", "timesteps"} for b in batches)  # training noise drawn per sample
    assert sum(len(b["latents"]) for b in batches) == 6
    for b in batches:
        n, c, h, w = b["latents"].shape
        assert c == 4 and b["prompt_embeds"].shape == (n, 16, 32) and b["pooled_prompt_embeds"].shape == (n, 32)
        for key in ("original_size", "crop_top_left", "target_size"):
            assert b[key].dtype == torch.int64 and b[key].shape == (n, 2)
        assert (b["target_size"] == torch.tensor([h * 8, w * 8])).all()  # (height, width) of the bucket
        assert b["noise"].shape == b["latents"].shape and b["noise"].dtype == torch.float32
        assert b["timesteps"].shape == (n,) and ((b["timesteps"] > 0) & (b["timesteps"] < 1)).all()
    sizes = Counter(tuple(b["target_size"][0].tolist()) for b in batches)
    assert set(sizes) == {(32, 32), (16, 48), (48, 16)}
    originals = sorted(tuple(row) for b in batches for row in b["original_size"].tolist())
    assert originals == sorted((h, w) for w, h in SIZES)


def test_random_choices_depend_only_on_seed_epoch_and_index(tmp_path: Path, tiny_flux_dir: Path) -> None:
    options = {"random_flip": True, "caption_dropout": 0.3, "shuffle_tags": True, "caption_variants": 3, "seed": 5}
    dm = _built(_module(tmp_path, str(_folder(tmp_path / "data", 6)), **options), tiny_flux_dir)
    dataset = dm.train_dataloader().dataset
    # The rates are what was asked for, and the draws do not touch the global random state.
    rng = torch.get_rng_state()
    choices = [dataset.choose(epoch, i) for epoch in range(400) for i in range(6)]
    assert torch.equal(torch.get_rng_state(), rng)
    empty = dm.cache().text_key("")
    dropped = sum(t == empty for _, t in choices) / len(choices)
    flipped = sum(lat == dm.train_entries[i % 6].flip_key for i, (lat, _) in enumerate(choices)) / len(choices)
    assert abs(dropped - 0.3) < 0.03 and abs(flipped - 0.5) < 0.03
    variants = Counter(t for (_, t) in choices[::6] if t != empty)  # sample 0: three cached orderings
    assert set(variants) == set(dm.train_entries[0].text_keys) and len(variants) == 3
    assert min(variants.values()) > 0.25 * sum(variants.values())
    assert dataset.choose(7, 3) == dataset.choose(7, 3) and uniform(5, 7, 3, "flip") == uniform(5, 7, 3, "flip")
    # The training noise and timestep too: a function of (seed, epoch, index), not of the global random state.
    rng = torch.get_rng_state()
    again, other_epoch, other_index = dataset[(7, 3)], dataset[(8, 3)], dataset[(7, 4)]
    assert torch.equal(torch.get_rng_state(), rng)
    first = dataset[(7, 3)]
    assert torch.equal(first["noise"], again["noise"]) and torch.equal(first["timesteps"], again["timesteps"])
    assert not torch.equal(first["noise"], other_epoch["noise"]) and first["timesteps"] != other_index["timesteps"]
    # The dropped caption is the cached empty-prompt embedding, which is what the family computes for "".
    encoders = dm.cache().family.load_text_encoders(dm.cache().source)
    direct = dm.cache().family.encode_prompts(encoders, [""])
    torch.testing.assert_close(dm.cache().load_text(empty)["prompt_embeds"], direct["prompt_embeds"][0])
    # Same batches in the main process and in persistent worker processes, epoch after epoch; epochs differ.
    main_process = dm.train_dataloader()
    reference = [_epoch(main_process, e) for e in (0, 1, 2)]
    dm.recipe = dm.recipe.replace(num_workers=2)
    workers = dm.train_dataloader()
    for e in (0, 1, 2):
        got = _epoch(workers, e)
        assert len(got) == len(reference[e])
        for a, b in zip(got, reference[e], strict=True):
            assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a["latents"], b["latents"]) for a, b in zip(reference[0], reference[1], strict=True))


def test_repeats_validation_and_evaluation_loaders(tmp_path: Path, tiny_flux_dir: Path) -> None:
    a, b, v = _folder(tmp_path / "a", 4), _folder(tmp_path / "b", 6, seed=1), _folder(tmp_path / "val", 2, seed=2)
    images = [str(a), {"path": str(b), "repeats": 3}]
    from lightning_lora.data.sources import ImageFolder

    images[1] = ImageFolder(**images[1])
    dm = _built(
        _module(tmp_path, images, val_images=str(v), val_fraction=0.25, random_flip=True, eval_samples=3),
        tiny_flux_dir,
    )
    held = {e.image for e in dm.val_entries} - {e.image for e in dm.report.validation if e.image.parent == v}
    assert 1 <= len(held) and not held & {e.image for e in dm.train_entries}  # held out of training
    assert {e.image.parent for e in dm.val_entries} >= {v}
    assert all(e.flip_key is None for e in dm.val_entries)  # no mirrored latents for validation
    expected = sum(3 if e.image.parent == b else 1 for e in dm.train_entries)
    assert len(dm.expanded_entries()) == expected and len(dm.train_dataloader().dataset) == expected
    assert dm.report.validation_images == len({e.image for e in dm.val_entries})
    assert "held out for validation" in dm.report.format()

    val = dm.val_dataloader_fixed()
    first, second = list(val), list(val)
    assert sum(len(x["latents"]) for x in first) == len(dm.val_entries)
    for x, y in zip(first, second, strict=True):
        assert all(torch.equal(x[k], y[k]) for k in x)
        assert len({tuple(t) for t in x["target_size"].tolist()}) == 1  # one bucket per batch
    # Fixed means unaugmented: the latent as written (not mirrored) and the caption as written.
    cache = dm.cache()
    rows = [row for batch in first for row in batch["latents"]]
    for x, e in zip(rows, _fixed_order(dm.val_entries), strict=True):
        torch.testing.assert_close(x, cache.load_latents(e.latent_key)["latents"])
    evaluation = list(dm.eval_dataloader())
    assert sum(len(x["latents"]) for x in evaluation) == 3
    no_val = _built(_module(tmp_path, str(a)), tiny_flux_dir)
    assert no_val.val_dataloader_fixed() is None


def _fixed_order(entries):
    by_bucket: dict = {}
    for e in entries:
        by_bucket.setdefault(e.bucket, []).append(e)
    return [e for group in by_bucket.values() for e in group]


def test_options_are_validated_early(tmp_path: Path, tiny_flux_dir: Path) -> None:
    data = str(_folder(tmp_path / "data", 2))
    for option, value, message in [
        ("caption_dropout", 1.0, "data.caption_dropout"),
        ("val_fraction", 1.5, "data.val_fraction"),
        ("max_upscale", 0.5, "data.max_upscale"),
        ("alpha_background", "nope", "data.alpha_background"),
        ("batch_size", 0, "data.batch_size"),
    ]:
        with pytest.raises(ConfigError, match=message):
            _module(tmp_path, data, **{option: value})
    flux = Flux()
    for option, value, message in [
        ("resolution", [512, 40], "data.resolution"),
        ("bucket_step", 24, "data.bucket_step"),
        ("min_resolution", 1024, "data.min_resolution"),
    ]:
        with pytest.raises(ConfigError, match=message):
            _module(tmp_path, data, **{option: value}).recipe.spec(flux)
    spec = _module(tmp_path, data, resolution=[1024, 512]).recipe.spec(flux)
    assert spec.buckets.step == 64 and spec.buckets.min_resolution == 256 and spec.buckets.resolutions == (1024, 512)


def test_exact_resume_with_flips_dropout_shuffled_captions_and_buckets(
    tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path
) -> None:
    """Every random choice of the data pipeline is replayed exactly after a resume (in worker processes too)."""
    data = _folder(tmp_path / "data", 6)
    options = {
        "data.images": str(data),
        "data.random_flip": True,
        "data.caption_dropout": 0.3,
        "data.shuffle_tags": True,
        "data.caption_variants": 3,
        "data.max_aspect_ratio": 3.0,
        "data.num_workers": 2,
        "data.cache_dir": str(tmp_path / "cache"),
        "trainer.max_steps": 6,
        "trainer.callbacks": [
            {
                "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                "init_args": {"every_n_train_steps": 1, "save_last": True, "save_top_k": -1},
            }
        ],
    }
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = write_config(tmp_path / "a", tiny_flux_dir, photos_dir, **options)
    b = write_config(tmp_path / "b", tiny_flux_dir, photos_dir, **options)
    run_cli(["fit", "--config", str(a)])
    run_cli(["fit", "--config", str(b), "--trainer.max_steps", "4"])  # ends inside the second epoch
    cli = run_cli(["fit", "--config", str(b), "--ckpt_path", "last"])
    assert cli.trainer.global_step == 6
    assert_same_run(a, b, after_step=4)


def test_every_epoch_of_a_fit_draws_anew(
    tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through Lightning's own loop (which sets the epoch on ``batch_sampler.sampler``), epoch 1 does not replay
    epoch 0: another order, other noise and timesteps."""
    from lightning_lora.module import LoraModule

    seen: dict[int, list[tuple[float, ...]]] = {}
    original = LoraModule.training_step

    def record(self: LoraModule, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        seen.setdefault(self.current_epoch, []).append(tuple(batch["timesteps"].tolist()))
        return original(self, batch, batch_idx)

    monkeypatch.setattr(LoraModule, "training_step", record)
    config = write_config(tmp_path, tiny_flux_dir, photos_dir, **{"trainer.max_steps": 4, "data.batch_size": 2})
    run_cli(["fit", "--config", str(config)])
    assert len(seen[0]) == len(seen[1]) == 2  # 4 photos, batch 2
    assert seen[0] != seen[1]


def test_text_encoder_quantization_reaches_the_cache(tmp_path: Path, tiny_flux_dir: Path) -> None:
    plain = _built(_module(tmp_path / "a", str(_folder(tmp_path / "data", 2))), tiny_flux_dir)
    fp8 = _built(
        _module(tmp_path / "b", str(_folder(tmp_path / "data", 2)), text_encoder_quantization="fp8"), tiny_flux_dir
    )
    a, b = plain.train_dataloader().dataset[0], fp8.train_dataloader().dataset[0]
    assert torch.equal(a["latents"], b["latents"])  # the images are encoded the same way
    assert not torch.equal(a["prompt_embeds"], b["prompt_embeds"])  # the captions by FP8 text encoders
    assert set(plain.train_entries[0].text_keys).isdisjoint(fp8.train_entries[0].text_keys)


@pytest.mark.parametrize(
    ("stage", "option"),
    [("encode_images", "data.encode_batch_size"), ("encode_prompts", "data.text_encoder_quantization: nf4")],
)
def test_caching_out_of_memory_names_the_option(
    tmp_path: Path, tiny_flux_dir: Path, monkeypatch: pytest.MonkeyPatch, stage: str, option: str
) -> None:
    def out_of_memory(*args: object, **kwargs: object) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.50 GiB")

    monkeypatch.setattr(Flux, stage, out_of_memory)
    with pytest.raises(ConfigError, match=f"out of GPU memory.*{option}"):
        _built(_module(tmp_path, str(_folder(tmp_path / "data", 2))), tiny_flux_dir)


def test_batches_carry_masks_weights_and_roles_and_the_evaluation_only_the_images_to_learn(
    tmp_path: Path, tiny_flux_dir: Path
) -> None:
    """With masks, a regularization folder and DOP on every image, each batch holds ``loss_mask`` (the mask's weights,
    mirrored with a mirrored latent; ones for an image without a mask), ``loss_weight`` and ``role`` (host strings);
    the fixed evaluation takes the images to learn only. Without any of it, the batches are as before."""
    from lightning_lora.objectives import Preservation

    data = _folder(tmp_path / "data", 2)
    for i in range(2):  # a trigger to take out of the captions
        (data / f"img{i}.txt").write_text("sks, " + (data / f"img{i}.txt").read_text())
    regularization = _folder(tmp_path / "class", 1, seed=1)
    masks = tmp_path / "masks"
    masks.mkdir()
    mask = np.zeros((48, 40), np.uint8)  # img0 is 40x48
    mask[:, 20:] = 255
    Image.fromarray(mask).save(masks / "img0.png")
    images = [
        {"path": str(data), "masks": str(masks), "unmasked_weight": 0.5},
        {"path": str(regularization), "role": "regularization", "loss_weight": 0.25},
    ]
    dm = _module(tmp_path, images, trigger="sks", random_flip=True, batch_size=1)
    preservation = Preservation(mode="dop", every_image=True)
    family, source = Flux(max_sequence_length=16), ModelSource(str(tiny_flux_dir), dtype=torch.float32)
    dm.build_cache(family, source, "cpu", preservation=preservation, progress=False)
    dm.train_entries = dm.report.train if dm.report else []
    dataset = dm.train_dataloader().dataset
    seen = {}
    for epoch in range(6):
        for index, entry in enumerate(dataset.entries):
            item = dataset[(epoch, index)]
            flipped = dataset.flipped(epoch, index)
            assert item["role"] == entry.role and item["loss_weight"].item() == entry.loss_weight
            assert item["loss_mask"].shape == (1, *item["latents"].shape[-2:])
            if entry.mask is None:
                assert torch.all(item["loss_mask"] == 1)
            else:
                weights = item["loss_mask"][0]
                left, right = weights[:, 0], weights[:, -1]
                assert torch.all((left if not flipped else right) == 0.5), (epoch, index, flipped)
                seen[flipped] = True
    assert seen == {False: True, True: True}  # the mask followed both orientations of its latent
    roles = sorted(e.role for e in dataset.entries)
    assert roles == ["preservation", "preservation", "regularization", "train", "train"]
    batch = next(iter(dm.train_dataloader()))
    assert isinstance(batch["role"], list) and isinstance(batch["role"][0], str)
    evaluated = [b["latents"].shape[0] for b in dm.eval_dataloader()]
    assert sum(evaluated) == 2  # the two images to learn, not their preservation twins or the class image
    plain = _module(tmp_path / "plain", str(data))
    plain.build_cache(family, source, "cpu", progress=False)
    plain.train_entries = plain.report.train if plain.report else []
    assert not {"loss_mask", "loss_weight", "role"} & set(plain.train_dataloader().dataset[(0, 0)])


def test_val_fraction_holds_out_images_to_learn_never_class_images(tmp_path: Path) -> None:
    data, regularization = _folder(tmp_path / "data", 4), _folder(tmp_path / "class", 4, seed=1)
    images = [str(data), {"path": str(regularization), "role": "regularization"}]
    dm = _module(tmp_path, images, val_fraction=0.9)
    assert dm.val_items and all(i.role == "train" for i in dm.val_items)
    assert sum(i.role == "regularization" for i in dm.items) == 4 and sum(i.role == "train" for i in dm.items) == 1
