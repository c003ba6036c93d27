"""Edit training's data: control folders matched to their targets by file name stem, in order; what the cache makes of
each pair (a control's latent under its own key, in its target's bucket; a prompt seen with its controls keyed per
pair); the rule for a control that is missing, unreadable or of another aspect ratio (its target left out before any
training step, one line each, counted in the summary); and the batches (one bucket and one number of controls each,
the controls mirrored with their target). On the tiny FLUX.1 Kontext (its prompt does not see the controls) and the
tiny Qwen-Image-Edit-Plus (its prompt does)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from lightning_lora.data.buckets import BucketSpec, cover
from lightning_lora.data.build import CacheReport, DataSpec, build
from lightning_lora.data.cache import LatentCache
from lightning_lora.data.datamodule import CachedDataset, LatentDataModule
from lightning_lora.data.images import decode
from lightning_lora.data.recipe import DataRecipe
from lightning_lora.data.sources import ImageFolder, as_folders, scan
from lightning_lora.errors import ConfigError
from lightning_lora.families import Flux, FluxKontext, QwenImageEdit, QwenImageEditPlus
from lightning_lora.families.base import DiffusionFamily, ModelSource

CPU = torch.device("cpu")


def _image(path: Path, seed: int, size: tuple[int, int] = (48, 48)) -> Path:
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(path)
    return path


def _pairs(root: Path, names: list[str], sizes: dict[str, tuple[int, int]] | None = None) -> tuple[Path, Path]:
    """A folder of targets (captioned with the edit) and one of controls of the same names."""
    targets, controls = root / "after", root / "before"
    targets.mkdir(parents=True)
    controls.mkdir(parents=True)
    for i, name in enumerate(names):
        _image(targets / f"{name}.png", seed=i)
        (targets / f"{name}.txt").write_text(f"make the {name} red")
        _image(controls / f"{name}.jpg", seed=100 + i, size=(sizes or {}).get(name, (48, 48)))
    return targets, controls


@pytest.fixture(scope="module")
def kontext_dir(tiny_pipeline: Callable[[str], Path]) -> Path:
    return tiny_pipeline("flux_kontext")


def _build(cache: LatentCache, folders: list[ImageFolder], flip: bool = False, dropout: bool = False) -> CacheReport:
    items, skips = scan(folders)
    spec = DataSpec(BucketSpec((32,), 16, max_aspect=3.0, min_resolution=16), flip=flip, caption_dropout=dropout)
    return build(cache, items, [], spec, CPU, scan_skips=skips)


# -- the folders ---------------------------------------------------------------------------------------------------


def test_controls_are_matched_by_stem_in_their_folders_order(tmp_path: Path) -> None:
    targets, first = _pairs(tmp_path, ["cat", "dog", "cup"])
    second = tmp_path / "mask"
    second.mkdir()
    _image(second / "cat.png", seed=7)
    _image(second / "cup.png", seed=8)
    _image(second / "cup.webp", seed=9)  # two images of one stem: which one is meant is not known
    plain = tmp_path / "plain"
    plain.mkdir()
    _image(plain / "bird.png", seed=3)
    folders = [ImageFolder(str(targets), controls=[str(first), str(second)]), ImageFolder(str(plain))]
    items, skips = scan(folders, default_caption="a bird")
    assert [(i.image.name, [c.relative_to(tmp_path).as_posix() for c in i.controls]) for i in items] == [
        ("cat.png", ["before/cat.jpg", "mask/cat.png"]),
        ("bird.png", []),  # a folder without controls: a text-to-image item in the same run
    ]
    lines = {s.path.name: (s.kind, s.line()) for s in skips}
    assert (
        lines["dog.png"][0] == "control missing"
        and f"no image named dog.* in control folder {second}" in (lines["dog.png"][1])
    )
    assert "(controls[1])" in lines["dog.png"][1]
    assert lines["cup.png"][0] == "control ambiguous" and "cup.png, cup.webp; keep one" in lines["cup.png"][1]


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"path": "x", "controls": 3}, r"data.images.controls must be a list of folders, e.g. \[data/before\], got 3"),
        ({"path": "x", "controls": ["a", ""]}, r"data.images.controls must be a list of folders"),
        ({"path": "x", "control": ["a"]}, r"unknown field 'control'; a folder entry has .*controls"),
    ],
)
def test_a_bad_controls_field_is_named(entry: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        as_folders(entry, "data.images")  # type: ignore[arg-type]  # a mapping, as a config gives it


def test_one_control_folder_may_be_written_alone_and_a_missing_one_is_named(tmp_path: Path) -> None:
    targets, controls = _pairs(tmp_path, ["cat"])
    entry = {"path": str(targets), "controls": str(controls)}
    assert as_folders(entry, "data.images")[0].controls == [str(controls)]  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"data.images.controls: control folder '.*nowhere' does not exist"):
        scan([ImageFolder(str(targets), controls=[str(tmp_path / "nowhere")])])


@pytest.mark.parametrize(
    ("family", "controls", "flip", "message"),
    [
        (Flux(), 1, False, r"data.images\[0\].controls: the flux family takes no control images"),
        (FluxKontext(), 2, False, r"data.images\[0\].controls: 2 control folders, but flux_kontext takes at most 1"),
        (QwenImageEdit(), 0, False, r"data.images\[0\]: qwenimage_edit needs control images for every target"),
        (QwenImageEditPlus(), 1, True, r"data.random_flip: qwenimage_edit_plus's prompt encoder sees the control"),
    ],
)
def test_the_recipe_refuses_controls_the_family_cannot_take(
    family: DiffusionFamily, controls: int, flip: bool, message: str
) -> None:
    recipe = DataRecipe(folders=(ImageFolder("x", controls=["c"] * controls),), resolutions=(32,), random_flip=flip)
    with pytest.raises(ConfigError, match=message):
        recipe.spec(family)
    assert recipe.controls == controls


# -- the cache -----------------------------------------------------------------------------------------------------


def test_a_control_is_cached_under_its_own_key_in_its_targets_bucket(tmp_path: Path, kontext_dir: Path) -> None:
    """The control's latent is the family's encoding of the control placed in its target's bucket (scaled to cover it,
    center-cropped), under a key of its own bytes and placement: shared by two targets, it is encoded once; edited,
    it alone is encoded again; the targets' latents and captions are reused."""
    targets, controls = _pairs(tmp_path, ["cat", "dog"], sizes={"cat": (50, 50)})
    (controls / "dog.jpg").unlink()
    (controls / "dog.jpg").symlink_to(controls / "cat.jpg")  # one control for both targets
    cache = LatentCache(
        tmp_path / "cache", FluxKontext(max_sequence_length=16), ModelSource(str(kontext_dir), dtype=torch.float32)
    )
    folders = [ImageFolder(str(targets), controls=[str(controls)])]
    report = _build(cache, folders)
    assert (report.latents_encoded, report.images_encoded, report.texts_encoded) == (3, 3, 3)  # 2 targets, 1 control
    entry = report.train[0]
    (control,) = entry.controls
    assert control.placement == cover(50, 50, entry.bucket) and control.placement.bucket == entry.bucket == (32, 32)
    assert control.latent_key not in (entry.latent_key, report.train[1].latent_key)
    assert report.train[1].controls[0].latent_key == control.latent_key
    vae = cache.family.load_vae(cache.source)
    pixels = torch.tensor(decode(control.image, control.placement.source_box(), entry.bucket)).permute(2, 0, 1)[None]
    expected = cache.family.encode_images(vae, pixels.float() / 127.5 - 1.0)[0]
    torch.testing.assert_close(cache.load_latents(control.latent_key)["latents"], expected, atol=1e-5, rtol=1e-5)
    assert "edit pairs:      2 training images with controls (2 with 1 control), 0 without; 2 control images" in (
        report.format()
    )
    _image(controls / "cat.jpg", seed=55, size=(50, 50))  # the control edited (both targets use it)
    again = _build(cache, folders)
    assert (again.latents_encoded, again.latents_reused, again.texts_encoded) == (1, 2, 0)
    assert again.train[0].controls[0].latent_key != control.latent_key
    assert [e.latent_key for e in again.train] == [e.latent_key for e in report.train]


def test_bad_pairs_are_left_out_before_training_one_line_each(
    tmp_path: Path, kontext_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A control that is not an image, one that decodes only half, one of another aspect ratio: each target is left
    out with one line naming its control and why, counted in the summary; a control within 5% of its target's aspect
    ratio is scaled and cropped to its bucket."""
    names = ["cat", "dog", "cup", "car", "sun"]
    targets, controls = _pairs(tmp_path, names, sizes={"cup": (48, 96), "car": (50, 48)})
    (controls / "cat.jpg").write_bytes(b"not an image")
    whole = (controls / "sun.jpg").read_bytes()
    (controls / "dog.jpg").write_bytes(whole[: len(whole) // 2])  # a valid header, truncated pixels
    cache = LatentCache(
        tmp_path / "cache", FluxKontext(max_sequence_length=16), ModelSource(str(kontext_dir), dtype=torch.float32)
    )
    with caplog.at_level(logging.WARNING, logger="lightning_lora.data.build"):
        report = _build(cache, [ImageFolder(str(targets), controls=[str(controls)])])
    assert sorted(e.image.name for e in report.train) == ["car.png", "sun.png"]  # car: 50x48 against 48x48, kept
    left_out = {s.path.name: (s.kind, s.reason) for s in report.skipped if s.path.parent == targets}
    assert left_out["cat.png"][0] == "control unreadable" and "cat.jpg: not an image file" in left_out["cat.png"][1]
    assert (
        left_out["dog.png"][0] == "control unreadable"
        and "dog.jpg cannot be used (cannot decode" in (left_out["dog.png"][1])
    )
    assert left_out["cup.png"] == (
        "control aspect ratio",
        f"48x48, but its control {controls / 'cup.jpg'} is 48x96: another aspect ratio (more than 5% apart); crop "
        "one to the other's shape",
    )
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("skipped ")]
    assert all(any(f"{targets / name}:" in line for line in lines) for name in ("cat.png", "dog.png", "cup.png"))
    assert "control aspect ratio" in report.format() and "2 control unreadable" in report.format()


def test_a_prompt_that_sees_its_controls_is_cached_per_pair(
    tmp_path: Path, tiny_pipeline: Callable[[str], Path]
) -> None:
    """Qwen-Image-Edit-Plus reads a caption with its controls: one embedding per (caption, controls) pair, made by
    the pipeline's own encoder with the control placed in the target's bucket; a changed control re-encodes its pair,
    caption dropout encodes the empty prompt with each pair's controls, and a target without controls is a caption
    alone."""
    from PIL import Image as PILImage

    model = tiny_pipeline("qwenimage_edit_plus")
    targets, controls = _pairs(tmp_path, ["cat", "dog"])
    (targets / "dog.txt").write_text("make the cat red")  # one caption, two pairs
    plain = tmp_path / "plain"
    plain.mkdir()
    _image(plain / "bird.png", seed=4)
    (plain / "bird.txt").write_text("make the cat red")
    family = QwenImageEditPlus()
    cache = LatentCache(tmp_path / "cache", family, ModelSource(str(model), dtype=torch.float32))
    folders = [ImageFolder(str(targets), controls=[str(controls)]), ImageFolder(str(plain))]
    report = _build(cache, folders, dropout=True)
    cat, dog, bird = report.train
    assert len({cat.text_keys[0], dog.text_keys[0], bird.text_keys[0]}) == 3  # the same caption, three embeddings
    assert bird.text_keys[0] == cache.text_key("make the cat red") and bird.empty_text_key is None
    assert cat.empty_text_key == cache.pair_key("", cat.controls, (255, 255, 255))
    assert report.texts_encoded == 6  # 2 pairs, their 2 empty prompts, the plain caption and the run's empty prompt
    encoders = family.load_text_encoders(cache.source)
    image = PILImage.fromarray(decode(cat.controls[0].image, cat.controls[0].placement.source_box(), cat.bucket))
    expected = family.encode_prompts_with_controls(encoders, ["make the cat red"], [[image]])
    stored = cache.load_text(cat.text_keys[0])
    n = int(expected["prompt_embeds_mask"].sum())
    assert stored["prompt_embeds"].shape[0] == n > 20  # the control's vision tokens are part of the prompt
    torch.testing.assert_close(stored["prompt_embeds"], expected["prompt_embeds"][0, :n])
    _image(controls / "dog.jpg", seed=77)
    again = _build(cache, folders, dropout=True)
    assert (again.latents_encoded, again.texts_encoded) == (1, 2)  # the control, its pair and its empty prompt


# -- the batches ---------------------------------------------------------------------------------------------------


def test_batches_hold_one_number_of_controls_mirrored_with_their_target(tmp_path: Path, kontext_dir: Path) -> None:
    """Targets with controls and without train in one run, in batches of their own; ``controls [B, N, C, h, w]`` are
    the cached control latents, mirrored where the target is."""
    targets, controls = _pairs(tmp_path, ["cat", "dog", "cup", "car"])
    plain = tmp_path / "plain"
    plain.mkdir()
    for i in range(2):
        _image(plain / f"bird{i}.png", seed=20 + i)
    dm = LatentDataModule(
        images=[{"path": str(targets), "controls": [str(controls)]}, {"path": str(plain)}],  # type: ignore[list-item]
        resolution=32,
        batch_size=2,
        random_flip=True,
        default_caption="a bird",
        cache_dir=str(tmp_path / "cache"),
    )
    dm.build_cache(
        FluxKontext(max_sequence_length=16), ModelSource(str(kontext_dir), dtype=torch.float32), "cpu", progress=False
    )
    dm.setup("fit")
    loader = dm.train_dataloader()
    dataset = loader.dataset
    assert isinstance(dataset, CachedDataset)
    batches = list(loader)
    assert sorted(b["controls"].shape[:2] if "controls" in b else (len(b["latents"]), 0) for b in batches) == [
        (2, 0),
        (2, 1),
        (2, 1),
    ]
    cache = dm.cache()
    flipped = 0
    for index, entry in enumerate(dataset.entries):
        latent_key, _ = dataset.choose(0, index)
        keys = dataset.control_keys(index, latent_key)
        if entry.controls:
            mirrored = latent_key == entry.flip_key
            flipped += mirrored
            assert keys == [entry.controls[0].flip_key if mirrored else entry.controls[0].latent_key]
            item = dataset[(0, index)]
            torch.testing.assert_close(item["controls"][0], cache.load_latents(keys[0])["latents"])
        else:
            assert keys == [] and "controls" not in dataset[(0, index)]
    assert 0 < flipped < 4  # both kinds seen (seeded)


def test_eval_drift_has_no_prompt_for_a_family_that_reads_prompts_with_controls() -> None:
    """Qwen-Image-Edit reads a prompt only with its control images: no trigger-free drift prompts by default (the run's
    FixedEvalLoss measures eval/loss alone), and drift prompts given anyway are refused in one line naming the fix."""
    from types import SimpleNamespace
    from typing import Any

    from lightning_lora.callbacks import FixedEvalLoss
    from lightning_lora.families import QwenImageEditPlus
    from lightning_lora.module import LoraModule

    module = LoraModule(pretrained="Qwen/Qwen-Image-Edit-2511", family=QwenImageEditPlus())  # nothing loaded
    trainer: Any = SimpleNamespace(datamodule=None, callbacks=[])
    default = FixedEvalLoss()
    default.setup(trainer, module, "fit")
    assert default.watched == "eval/loss" and not QwenImageEditPlus.drift_prompts
    with pytest.raises(ConfigError, match=r"drift_prompts: the qwenimage_edit_plus family .* set drift_prompts: \[\]"):
        FixedEvalLoss(drift_prompts=["a photo of a man in a park"]).setup(trainer, module, "fit")
