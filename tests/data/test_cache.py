"""The latent cache on a tiny FLUX: correct (content keys, never stale, atomic, corrupt files rebuilt), incremental
(one edit -> one re-encode; a killed build resumes to the same result), robust to bad input, and fast (pipelined)."""

from __future__ import annotations

import gc
import json
import logging
import os
import shutil
import subprocess
import sys
import time
import weakref
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import REPO, other_weights, tree_digest
from PIL import Image
from safetensors.torch import load_file

from lightning_lora.data.buckets import BucketSpec
from lightning_lora.data.build import CacheReport, DataSpec, build
from lightning_lora.data.cache import LatentCache
from lightning_lora.data.images import decode
from lightning_lora.data.sources import ImageFolder, scan
from lightning_lora.errors import ConfigError
from lightning_lora.families.base import ModelSource
from lightning_lora.families.flux import Flux

RES = 32
CPU = torch.device("cpu")


def _noise_image(path: Path, seed: int, size: tuple[int, int] = (40, 48), mode: str = "RGB") -> Path:
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4}[mode]
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], channels), dtype=np.uint8), mode).save(path)
    return path


def _dataset(folder: Path, n: int = 3) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        _noise_image(folder / f"img{i}.png", seed=i, size=[(40, 48), (64, 32), (48, 48), (32, 64), (50, 40)][i % 5])
        (folder / f"img{i}.txt").write_text(f"a photo of sks {['cat', 'dog', 'cup', 'car', 'bird'][i % 5]}\n")
    return folder


def _cache(root: Path, model: Path, t5_len: int = 16, dtype: torch.dtype = torch.float32) -> LatentCache:
    return LatentCache(root, Flux(max_sequence_length=t5_len), ModelSource(str(model), dtype=dtype))


def _spec(res: int = RES, **kwargs) -> DataSpec:
    bucket_options = {k: kwargs.pop(k) for k in ("max_upscale", "min_resolution", "small_images") if k in kwargs}
    bucket_options.setdefault("min_resolution", 16)
    # Max aspect 3 gives a 32 px resolution three buckets: 16x48, 32x32 and 48x16.
    return DataSpec(BucketSpec((res,), 16, max_aspect=3.0, **bucket_options), **kwargs)


def _build(cache: LatentCache, *folders: Path, spec: DataSpec | None = None, **kwargs) -> CacheReport:
    scan_options = {k: kwargs.pop(k) for k in ("default_caption", "trigger") if k in kwargs}
    items, skips = scan([ImageFolder(str(f)) for f in folders], **scan_options)
    return build(cache, items, [], spec or _spec(), CPU, scan_skips=skips, **kwargs)


def _files(root: Path) -> dict[str, dict[str, torch.Tensor]]:
    return {p.relative_to(root).as_posix(): load_file(p) for p in sorted(root.rglob("*.safetensors"))}


def test_build_then_reuse(tmp_path: Path, tiny_flux_dir: Path) -> None:
    data = _dataset(tmp_path / "data", n=3)
    (data / "img2.txt").write_text((data / "img0.txt").read_text())  # two images share one caption
    cache = _cache(tmp_path / "cache", tiny_flux_dir)
    report = _build(cache, data, batch_size=2)
    assert [e.image.name for e in report.train] == ["img0.png", "img1.png", "img2.png"]
    assert (report.images, report.latents_encoded, report.latents_reused, len(report.skipped)) == (3, 3, 0, 0)
    assert report.texts_encoded == 3  # two captions and the empty prompt (for caption dropout)
    assert len(list((tmp_path / "cache" / "latents").glob("*.safetensors"))) == 3
    assert not list((tmp_path / "cache").rglob("*.tmp"))
    # Buckets by aspect ratio: 40x48 and 48x48 -> 32x32; 64x32 (2:1) -> 48x16 (3:1 is nearer than 1:1 in log space).
    assert {e.image.name: e.bucket for e in report.train} == {
        "img0.png": (32, 32),
        "img1.png": (48, 16),
        "img2.png": (32, 32),
    }

    # What is cached is what the family computes from the decoded bucket pixels, plus the SDXL size records.
    e = report.train[1]
    stored = cache.load_latents(e.latent_key)
    assert stored["latents"].shape == (4, 16 // 8, 48 // 8) and stored["latents"].dtype == torch.float32
    vae = cache.family.load_vae(cache.source)
    pixels = torch.tensor(decode(e.image, e.placement.source_box(), e.bucket)).permute(2, 0, 1)[None]
    direct = cache.family.encode_images(vae, pixels.float() / 127.5 - 1.0)[0]
    torch.testing.assert_close(stored["latents"], direct, atol=1e-5, rtol=1e-5)
    assert stored["original_size"].tolist() == [32, 64] and stored["target_size"].tolist() == [16, 48]
    assert e.placement.resized == (48, 24) and stored["crop_top_left"].tolist() == [4, 0]  # (top, left)
    assert all(stored[k].dtype == torch.int64 for k in ("original_size", "crop_top_left", "target_size"))
    text = cache.load_text(e.text_keys[0])
    assert set(text) == {"prompt_embeds", "pooled_prompt_embeds"} and text["prompt_embeds"].shape == (16, 32)

    again = _build(_cache(tmp_path / "cache", tiny_flux_dir), data)
    assert again.train == report.train
    assert (again.latents_encoded, again.latents_reused, again.texts_encoded, again.texts_reused) == (0, 3, 0, 3)
    summary = again.format()
    assert "images found:    3" in summary and "0 encoded, 3 reused" in summary and "32x32: 2" in summary


def test_edit_one_image_reencodes_exactly_that_entry(tmp_path: Path, tiny_flux_dir: Path) -> None:
    data = _dataset(tmp_path / "data", n=4)
    cache = _cache(tmp_path / "cache", tiny_flux_dir)
    spec = _spec(flip=True)
    before = _build(cache, data, spec=spec)
    assert before.latents_encoded == 8  # each image and its mirror
    _noise_image(data / "img2.png", seed=99, size=(48, 48))  # same name and size, new bytes
    after = _build(cache, data, spec=spec)
    assert (after.latents_encoded, after.latents_reused, after.texts_encoded) == (2, 6, 0)  # img2 and its mirror
    changed = [
        (a.latent_key, a.flip_key) != (b.latent_key, b.flip_key) for a, b in zip(after.train, before.train, strict=True)
    ]
    assert changed == [False, False, True, False]
    new = cache.load_latents(after.train[2].latent_key)["latents"]
    assert not torch.equal(new, cache.load_latents(before.train[2].latent_key)["latents"])


def test_edit_with_the_same_size_and_a_restored_mtime_is_still_seen(tmp_path: Path, tiny_flux_dir: Path) -> None:
    """The hash memo keys on size, mtime, ctime and inode: a tool that restores the modification time cannot hide
    an edit (ctime cannot be set back)."""
    data = tmp_path / "data"
    data.mkdir()
    for i in range(2):
        Image.new("RGB", (32, 32), (10 * i, 0, 0)).save(data / f"img{i}.bmp")  # BMP: same size, same file size
    cache = _cache(tmp_path / "cache", tiny_flux_dir)
    first = _build(cache, data, default_caption="x")
    memo = json.loads((tmp_path / "cache" / "images.json").read_text())
    memo["written_ns"] = time.time_ns() + 10**10  # as if written long after the files: its records are trusted
    (tmp_path / "cache" / "images.json").write_text(json.dumps(memo))
    path = data / "img0.bmp"
    stat = path.stat()
    Image.new("RGB", (32, 32), (0, 200, 0)).save(path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert (path.stat().st_size, path.stat().st_mtime_ns, path.stat().st_ino) == (
        stat.st_size,
        stat.st_mtime_ns,
        stat.st_ino,
    )
    second = _build(cache, data, default_caption="x")
    assert (second.latents_encoded, second.latents_reused) == (1, 1)
    assert second.train[0].latent_key != first.train[0].latent_key and second.train[1] == first.train[1]


def test_edit_caption_reencodes_only_that_caption(tmp_path: Path, tiny_flux_dir: Path) -> None:
    data = _dataset(tmp_path / "data", n=3)
    cache = _cache(tmp_path / "cache", tiny_flux_dir)
    before = _build(cache, data)
    (data / "img1.txt").write_text("a painting of sks dog")
    after = _build(cache, data)
    assert (after.texts_encoded, after.latents_encoded, after.latents_reused) == (1, 0, 3)
    assert after.train[1].text_keys != before.train[1].text_keys
    assert [a.text_keys for a in after.train[::2]] == [b.text_keys for b in before.train[::2]]


def test_keys_follow_resolution_model_and_text_options(tmp_path: Path, tiny_flux_dir: Path) -> None:
    data = _dataset(tmp_path / "data", n=2)
    _build(_cache(tmp_path / "cache", tiny_flux_dir), data)
    report = _build(_cache(tmp_path / "cache", tiny_flux_dir), data, spec=_spec(res=16))
    assert (report.latents_encoded, report.texts_encoded) == (2, 0)
    # At 48 px the 64x32 image gets a new bucket (64x32); the 40x48 one is too small for 48x48 and steps down to
    # the same 32x32 placement as before: its entry is reused.
    report = _build(_cache(tmp_path / "cache", tiny_flux_dir), data, spec=_spec(res=48))
    assert (report.latents_encoded, report.latents_reused) == (1, 1)
    assert [e.bucket for e in report.train] == [(32, 32), (64, 32)]
    report = _build(_cache(tmp_path / "cache", tiny_flux_dir, t5_len=8), data)
    assert (report.latents_encoded, report.texts_encoded) == (0, 3)
    report = _build(_cache(tmp_path / "cache", tiny_flux_dir, dtype=torch.bfloat16), data)
    assert (report.latents_encoded, report.texts_encoded) == (2, 3)  # another dtype is another model
    # A copy of the model in another folder is the same model (a model moved to another disk keeps its cache); other
    # VAE weights in it are another VAE: new latents, the same text embeddings.
    other = tmp_path / "other-model"
    shutil.copytree(tiny_flux_dir, other, copy_function=shutil.copyfile)  # new files: new mtimes, inodes
    report = _build(_cache(tmp_path / "cache", other), data)
    assert (report.latents_encoded, report.texts_encoded) == (0, 0)
    other_weights(other, "vae")
    report = _build(_cache(tmp_path / "cache", other), data)
    assert (report.latents_encoded, report.texts_encoded) == (2, 0)
    report = _build(_cache(tmp_path / "cache", tiny_flux_dir), data, spec=_spec(background=(0, 0, 0)))
    assert report.latents_encoded == 2 and report.texts_encoded == 0
    # A folder whose T5 tokenizer changed (another vocabulary or chat template, the same encoder weights): new text
    # embeddings, the same latents.
    retokenized = tmp_path / "retokenized"
    shutil.copytree(tiny_flux_dir, retokenized)
    config = retokenized / "tokenizer_2" / "tokenizer_config.json"
    config.write_text(config.read_text().replace("{", '{"model_max_length": 77, ', 1))
    report = _build(_cache(tmp_path / "cache", retokenized), data)
    assert (report.latents_encoded, report.texts_encoded) == (0, 3)


def test_truncated_cache_files_are_detected_and_rebuilt(
    tmp_path: Path, tiny_flux_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    data = _dataset(tmp_path / "data", n=3)
    cache = _cache(tmp_path / "cache", tiny_flux_dir)
    entries = _build(cache, data).train
    good = cache.load_latents(entries[2].latent_key)["latents"].clone()
    for path in (cache.latent_path(entries[2].latent_key), cache.text_path(entries[0].text_keys[0])):
        raw = path.read_bytes()
        path.write_bytes(raw[: len(raw) // 2])
    with caplog.at_level(logging.WARNING, logger="lightning_lora.data.cache"):
        report = _build(cache, data)
    assert (report.latents_encoded, report.latents_reused, report.texts_encoded) == (1, 2, 1)
    assert "unreadable" in caplog.text
    torch.testing.assert_close(cache.load_latents(entries[2].latent_key)["latents"], good)


def test_bad_inputs_are_skipped_counted_and_named(
    tmp_path: Path, tiny_flux_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    data = _dataset(tmp_path / "data", n=2)
    (data / "noise.png").write_bytes(np.random.default_rng(0).integers(0, 256, 500, dtype=np.uint8).tobytes())
    (data / "empty.jpg").write_bytes(b"")
    (data / "notes.webp").write_text("I am a text file with an image extension")
    good = (data / "img0.png").read_bytes()
    (data / "half.png").write_bytes(good[: len(good) // 2])  # a valid header, truncated pixel data
    _noise_image(data / "tiny.png", seed=5, size=(12, 12))  # smaller than the smallest bucket (16 px)
    _noise_image(data / "latin1.png", seed=6)
    (data / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    _noise_image(data / "blank.png", seed=7)
    (data / "blank.txt").write_text("")
    empty_folder = tmp_path / "empty"
    empty_folder.mkdir()
    for name in ("noise", "empty", "notes", "half", "tiny"):
        (data / f"{name}.txt").write_text("a photo")
    before = tree_digest(data), tree_digest(empty_folder)
    with caplog.at_level(logging.WARNING, logger="lightning_lora.data.build"):
        report = _build(_cache(tmp_path / "cache", tiny_flux_dir), data, empty_folder, batch_size=2)
    assert [e.image.name for e in report.train] == ["img0.png", "img1.png", "latin1.png"]  # a cp1252 caption is read
    reasons = {s.path.name: (s.kind, s.reason) for s in report.skipped}
    assert reasons["noise.png"][0] == "not an image" and reasons["notes.webp"][0] == "not an image"
    assert reasons["empty.jpg"] == ("empty file", "empty file (0 bytes)")
    assert reasons["half.png"][0] == "cannot decode"
    assert reasons["tiny.png"][0] == "too small" and "data.small_images: upscale" in reasons["tiny.png"][1]
    assert reasons["latin1.txt"][0] == "not UTF-8" and "Windows-1252" in reasons["latin1.txt"][1]  # a note
    assert reasons["blank.png"][0] == "caption" and "is empty" in reasons["blank.png"][1]
    assert reasons["empty"][0] == "empty folder"
    # One warning line per skipped file, naming it and the reason; the summary counts them by kind.
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("skipped ")]
    assert len(lines) == 7 and all("\n" not in line for line in lines)
    assert any(str(data / "half.png") in line and "cannot decode" in line for line in lines)
    summary = report.format()
    assert "skipped:         7 (1 cannot decode, 1 caption, 1 empty file, 1 empty folder, 2 not an image" in summary
    assert "notes:           1 (1 not UTF-8)" in summary
    assert "images found:    9" in summary
    # Nothing in the user's folders was created or modified.
    assert (tree_digest(data), tree_digest(empty_folder)) == before
    # The option that upscales small images brings tiny.png back, and says nothing about it.
    upscaled = _build(_cache(tmp_path / "cache", tiny_flux_dir), data, spec=_spec(small_images="upscale"))
    assert "tiny.png" in {e.image.name for e in upscaled.train}


def test_on_bad_file_error_stops_before_any_model_loads(tmp_path: Path, tiny_flux_dir: Path, monkeypatch) -> None:
    data = _dataset(tmp_path / "data", n=2)
    (data / "broken.png").write_bytes(b"not a png")
    (data / "broken.txt").write_text("x")
    cache = _cache(tmp_path / "cache", tiny_flux_dir)
    monkeypatch.setattr(Flux, "load_vae", lambda *a: pytest.fail("the VAE was loaded"))
    with pytest.raises(ConfigError, match=r"(?s)on_bad_file is 'error'.*broken\.png: not an image.*on_bad_file: skip"):
        _build(cache, data, on_bad_file="error")
    # A file that only fails when its pixels are decoded is fatal too (after the others are cached).
    monkeypatch.undo()
    (data / "broken.png").unlink()
    good = (data / "img0.png").read_bytes()
    (data / "broken.png").write_bytes(good[: len(good) // 2])
    with pytest.raises(ConfigError, match=r"broken\.png: cannot decode"):
        _build(cache, data, on_bad_file="error")


def test_all_bad_is_a_clear_error(tmp_path: Path, tiny_flux_dir: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.png").write_bytes(b"not a png at all")
    (data / "b.jpg").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"data\.images: none of the images can be used.*1 empty file, 1 not an"):
        _build(_cache(tmp_path / "cache", tiny_flux_dir), data, default_caption="x")


def test_odd_valid_images_are_all_cached(tmp_path: Path, tiny_flux_dir: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    Image.new("CMYK", (40, 40), (0, 255, 255, 0)).save(data / "cmyk.jpg")
    Image.fromarray(np.tile(np.linspace(0, 65535, 40).astype(np.uint16), (40, 1))).save(data / "deep.png")
    Image.new("RGB", (40, 40), (0, 0, 255)).convert("P").save(data / "palette.png")
    _noise_image(data / "alpha.png", seed=1, mode="RGBA")
    Image.new("L", (40, 40), 128).save(data / "gray.webp")
    Image.new("RGB", (40, 40), (1, 2, 3)).save(data / "plain.bmp")
    exif = Image.Exif()
    exif[0x0112] = 6  # stored landscape, viewed portrait
    Image.fromarray(np.zeros((32, 64, 3), dtype=np.uint8)).save(data / "rotated.jpg", exif=exif)
    report = _build(_cache(tmp_path / "cache", tiny_flux_dir), data, default_caption="a photo")
    assert not report.skipped and report.latents_encoded == 7
    assert {e.image.name: e.bucket for e in report.train}["rotated.jpg"] == (16, 48)  # portrait bucket


def test_flipped_entry_is_the_mirrored_image(tmp_path: Path, tiny_flux_dir: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    _noise_image(data / "wide.png", seed=3, size=(110, 32))  # resized to 55x16, cropped to 48x16 at left 3
    cache = _cache(tmp_path / "cache", tiny_flux_dir)
    e = _build(cache, data, spec=_spec(flip=True), default_caption="x").train[0]
    plain, mirrored = cache.load_latents(e.latent_key), cache.load_latents(e.flip_key)
    vae = cache.family.load_vae(cache.source)
    pixels = torch.tensor(decode(e.image, e.placement.source_box(), e.bucket)).permute(2, 0, 1)[None]
    expected = cache.family.encode_images(vae, pixels.flip(-1).float() / 127.5 - 1.0)[0]
    torch.testing.assert_close(mirrored["latents"], expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(plain["latents"], mirrored["latents"])
    assert (e.placement.resized, e.placement.crop) == ((55, 16), (3, 0))
    assert plain["crop_top_left"].tolist() == [0, 3]
    assert mirrored["crop_top_left"].tolist() == [0, 55 - 3 - 48]  # the crop's left edge in the mirrored image


_KILLED_BUILD = """
import json, os, signal, sys
import torch
torch.set_num_threads(1)
from lightning_lora.data.build import DataSpec, build
from lightning_lora.data.buckets import BucketSpec
from lightning_lora.data.cache import LatentCache
from lightning_lora.data.sources import ImageFolder, scan
from lightning_lora.families.base import ModelSource
from lightning_lora.families.flux import Flux

model, data, root, kill_at = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
replace, count = os.replace, [0]

def dying_replace(src, dst):  # the power goes after a temporary file is written, before its rename
    if str(dst).endswith(".safetensors"):
        count[0] += 1
        if count[0] >= kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
    replace(src, dst)

os.replace = dying_replace
cache = LatentCache(root, Flux(max_sequence_length=16), ModelSource(model, dtype=torch.float32))
items, _ = scan([ImageFolder(data)])
spec = DataSpec(BucketSpec((32,), 16, max_aspect=3.0, min_resolution=16), flip=True)
build(cache, items, [], spec, torch.device("cpu"), batch_size=3)
"""


@pytest.mark.subprocess
def test_killed_build_resumes_to_the_same_result_as_a_clean_build(tmp_path: Path, tiny_flux_dir: Path) -> None:
    data = _dataset(tmp_path / "data", n=5)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    killed = subprocess.run(
        [sys.executable, "-c", _KILLED_BUILD, str(tiny_flux_dir), str(data), str(tmp_path / "a"), "5"],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert killed.returncode == -9, killed.stderr[-2000:]
    written = list((tmp_path / "a" / "latents").glob("*.safetensors"))
    assert len(written) == 4 and list((tmp_path / "a" / "latents").glob(".*.tmp"))  # a temporary file was left
    resumed = _build(_cache(tmp_path / "a", tiny_flux_dir), data, spec=_spec(flip=True), batch_size=2)
    assert (resumed.latents_encoded, resumed.latents_reused) == (6, 4)
    _build(_cache(tmp_path / "b", tiny_flux_dir), data, spec=_spec(flip=True), batch_size=3)
    a, b = _files(tmp_path / "a"), _files(tmp_path / "b")
    assert a.keys() == b.keys() and len(a) == 10 + 6  # 5 images x 2, 5 captions + the empty prompt
    for name in a:
        for key in a[name]:
            assert torch.equal(a[name][key], b[name][key]), (name, key)


def test_pipeline_workers_rng_and_freed_encoders(tmp_path: Path, tiny_flux_dir: Path, monkeypatch) -> None:
    """Decoding in worker processes gives the same cache as in-process; building draws nothing from the global
    random state; the VAE and text encoders are gone afterwards."""
    data = _dataset(tmp_path / "data", n=5)
    in_process = _build(_cache(tmp_path / "a", tiny_flux_dir), data, spec=_spec(flip=True), workers=0)

    loaded: list[weakref.ref] = []
    real_vae, real_text = Flux.load_vae, Flux.load_text_encoders

    def track(load):
        def wrapper(self, source):
            model = load(self, source)
            loaded.append(weakref.ref(model))
            return model

        return wrapper

    monkeypatch.setattr(Flux, "load_vae", track(real_vae))
    monkeypatch.setattr(Flux, "load_text_encoders", track(real_text))
    torch.manual_seed(123)
    rng = torch.get_rng_state()
    in_workers = _build(_cache(tmp_path / "b", tiny_flux_dir), data, spec=_spec(flip=True), workers=2)
    assert torch.equal(torch.get_rng_state(), rng), "building the cache changed the global random state"
    gc.collect()
    assert len(loaded) == 2 and all(ref() is None for ref in loaded), "an encoder is still referenced"
    assert in_workers.latents_encoded == in_process.latents_encoded == 10
    a, b = _files(tmp_path / "a"), _files(tmp_path / "b")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[n][k], b[n][k]) for n in a for k in a[n])


def test_stale_temporaries_are_removed(tmp_path: Path, tiny_flux_dir: Path) -> None:
    cache = _cache(tmp_path / "cache", tiny_flux_dir)
    (tmp_path / "cache" / "latents").mkdir(parents=True)
    old, new = tmp_path / "cache" / "latents" / ".x.safetensors.old.tmp", tmp_path / "cache" / "latents" / ".y.tmp"
    old.write_bytes(b"half")
    new.write_bytes(b"half")
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    assert cache.remove_stale_temporaries() == 1
    assert not old.exists() and new.exists()  # a recent one may belong to a build running right now


def test_caching_throughput_on_cpu(tmp_path: Path, tiny_flux_dir: Path) -> None:
    """Images per second through the whole pipeline on CPU with the tiny VAE (printed; not asserted)."""
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    for i in range(32):
        small = rng.integers(0, 256, (12, 16, 3), dtype=np.uint8)
        Image.fromarray(small).resize((640, 480), Image.Resampling.BICUBIC).save(data / f"{i:02d}.jpg", quality=90)
    report = _build(
        _cache(tmp_path / "cache", tiny_flux_dir),
        data,
        default_caption="a photo",
        workers=2,
        batch_size=8,
        spec=_spec(res=64),
    )
    assert report.images_encoded == 32
    print(
        f"\nCPU caching throughput (tiny VAE, 640x480 JPEG -> 64 px buckets, 2 workers): "
        f"{report.images_per_second:.1f} images/s"
    )


def test_text_encoders_in_fp8_for_caching(tmp_path: Path, tiny_flux_dir: Path) -> None:
    """``data.text_encoder_quantization``: the encoders' linear layers in FP8 (T5's float32 ``wo`` kept), embeddings
    close to the plain ones and cached under their own keys."""
    from torch import nn

    from lightning_lora.data.cache import quantize_text_encoders
    from lightning_lora.precision.fp8 import FP8Linear

    plain = _cache(tmp_path / "c", tiny_flux_dir)
    fp8 = LatentCache(tmp_path / "c", plain.family, plain.source, text_encoder_quantization="fp8")
    text = "a photo of sks cat"
    assert plain.text_key(text) != fp8.text_key(text)  # both can live in one cache folder
    encoders = plain.family.load_text_encoders(plain.source)
    swapped = quantize_text_encoders(
        encoders, Flux.architecture.text_encoders, "fp8", torch.device("cpu"), torch.float32
    )
    t5 = encoders.text_encoder_2
    layers = {n: type(m) for n, m in t5.named_modules() if isinstance(m, nn.Linear)}
    both = [*encoders.text_encoder.modules(), *t5.modules()]
    assert swapped == sum(isinstance(m, FP8Linear) for m in both) > 0
    assert all(t is nn.Linear for n, t in layers.items() if n.endswith(".wo"))  # kept as the model wants
    assert any(t is FP8Linear for n, t in layers.items() if n.endswith((".q", ".wi_0")))
    assert any(isinstance(m, FP8Linear) for m in encoders.text_encoder.modules())  # CLIP too
    assert (
        quantize_text_encoders(encoders, Flux.architecture.text_encoders, "none", torch.device("cpu"), torch.float32)
        == 0
    )
    plain.encode_texts([text], torch.device("cpu"))
    fp8.encode_texts([text], torch.device("cpu"))
    a, b = plain.load_text(plain.text_key(text)), fp8.load_text(fp8.text_key(text))
    for key in ("prompt_embeds", "pooled_prompt_embeds"):
        assert not torch.equal(a[key], b[key])
        assert (a[key] - b[key]).norm() < 0.1 * a[key].norm()  # FP8 e4m3 with per-channel scales: close


def test_image_replaced_during_the_build_is_not_cached_under_its_old_key(
    tmp_path: Path, tiny_flux_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The key of an image is made from the hash of its bytes when the build is planned; its pixels are decoded
    later. A file replaced in between (a sync tool, an editor saving) must not leave a latent of other pixels under
    the old key: the decoder hashes the bytes it decodes and skips the image when they differ."""
    from lightning_lora.data import build as build_module

    data = _dataset(tmp_path / "data", n=2)
    original = (data / "img1.png").read_bytes()
    clean = _build(_cache(tmp_path / "clean", tiny_flux_dir), data)  # the same data, never replaced
    planned: list = []

    def replace_after_planning(*args, **kwargs):
        jobs, reused = real_missing_jobs(*args, **kwargs)
        planned.extend(jobs)
        _noise_image(data / "img1.png", seed=99, size=(64, 32))  # other pixels, same name and size
        return jobs, reused

    real_missing_jobs = build_module.missing_jobs
    monkeypatch.setattr(build_module, "missing_jobs", replace_after_planning)
    cache = _cache(tmp_path / "cache", tiny_flux_dir)
    report = _build(cache, data)
    monkeypatch.undo()

    (job,) = [j for j in planned if j.image.name == "img1.png"]
    assert job.plain_key == clean.train[1].latent_key  # planned from the original bytes
    assert not cache.latent_path(job.plain_key).exists()  # never a latent of the new pixels under that key
    assert [e.image.name for e in report.train] == ["img0.png"]
    (skip,) = report.skipped
    assert skip.path.name == "img1.png" and skip.kind == "changed"
    assert "changed while the cache was built" in skip.reason and "encoded on the next run" in skip.reason
    # The image that did not change is encoded exactly as in the clean build.
    key = report.train[0].latent_key
    assert key == clean.train[0].latent_key
    assert torch.equal(
        cache.load_latents(key)["latents"], _cache(tmp_path / "clean", tiny_flux_dir).load_latents(key)["latents"]
    )

    # Put back: the next build encodes it, and the entry is the one a clean build made.
    (data / "img1.png").write_bytes(original)
    again = _build(cache, data)
    assert (again.latents_encoded, again.latents_reused, len(again.skipped)) == (1, 1, 0)
    assert again.train == clean.train
    for e in clean.train:
        expected = _cache(tmp_path / "clean", tiny_flux_dir).load_latents(e.latent_key)
        assert torch.equal(cache.load_latents(e.latent_key)["latents"], expected["latents"])


def test_long_captions_do_not_flood_the_output_and_are_reported_once(
    tmp_path: Path, tiny_flux_dir: Path, capfd: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture
) -> None:
    """diffusers prints the whole cut-off text of every truncated caption (for a 10 MB caption: minutes and hundreds
    of MB of output). A caption is cut to 20,000 characters when read (one note), the encoders' truncation warnings
    are silenced while caching (and the loggers restored), and the summary says once how many were truncated."""
    data = _dataset(tmp_path / "data", n=3)
    (data / "img0.txt").write_text("a photo of sks cat, on a mat; " * 20_000)  # 600 KB, cut when read
    (data / "img1.txt").write_text(" ".join(f"tag{i}" for i in range(60)))  # an ordinary long caption
    watched = ["diffusers.pipelines.flux.pipeline_flux", "transformers.tokenization_utils_base"]
    levels = [logging.getLogger(name).level for name in watched]
    capfd.readouterr()
    with caplog.at_level(logging.WARNING):
        report = _build(_cache(tmp_path / "cache", tiny_flux_dir), data)
    out, err = capfd.readouterr()
    assert len(out) + len(err) < 4000, err[-2000:]
    assert len(caplog.text) < 4000, caplog.text[-2000:]
    assert [logging.getLogger(name).level for name in watched] == levels
    assert len(report.train) == 3 and report.train[0].caption.startswith("a photo of sks cat, on a mat; ")
    assert len(report.train[0].caption) == 20_000
    summary = report.format()
    assert "skipped:         0" in summary
    assert "img0.txt: 599,999 characters long; only the first 20,000 are kept" in summary
    # The tiny pipeline's T5 reads 16 tokens: both long captions are cut, the short one is not.
    (tokens,) = [s for s in report.skipped if s.kind == "over token limit"]
    assert tokens.path.name == "img0.png"
    assert "2 captions are longer than the text encoder reads (16 T5 tokens)" in tokens.reason
    assert '"a photo of sks cat, on a mat; a photo' in tokens.reason and len(tokens.reason) < 300
    assert sum("longer than the text encoder reads" in r.getMessage() for r in caplog.records) == 1


def test_notes_are_listed_and_do_not_stop_on_bad_file_error(tmp_path: Path, tiny_flux_dir: Path) -> None:
    """A caption read as Windows-1252 and a metadata row that names no image are notes: the images are trained on,
    the summary lists each note, and data.on_bad_file: error (which stops on a file that cannot be used) goes on."""
    data = _dataset(tmp_path / "data", n=2)
    (data / "img0.txt").write_bytes("caf\u00e9 \u201cx\u201d".encode("cp1252"))
    (data / "metadata.jsonl").write_text('{"file_name": "../x.png", "text": "outside"}\n')
    report = _build(_cache(tmp_path / "cache", tiny_flux_dir), data, on_bad_file="error")
    assert [(e.image.name, e.caption) for e in report.train] == [
        ("img0.png", "caf\u00e9 \u201cx\u201d"),
        ("img1.png", "a photo of sks dog"),
    ]
    summary = report.format()
    assert "images found:    2" in summary and "skipped:         0" in summary
    assert "notes:           2 (1 metadata, 1 not UTF-8)" in summary
    assert f"{data / 'img0.txt'}: not UTF-8" in summary
    assert f"{data}: metadata.jsonl:1: names ../x.png, which is outside this folder" in summary


def test_unreadable_formats_and_broken_links_are_skipped_and_counted(tmp_path: Path, tiny_flux_dir: Path) -> None:
    data = _dataset(tmp_path / "data", n=2)
    Image.new("P", (40, 40), 3).save(data / "anim.gif")  # found now, and cached
    (data / "phone.heic").write_bytes(b"\x00\x00\x00\x18ftypheic")
    (data / "gone.png").symlink_to("nowhere.png")
    (data / "link.png").symlink_to("img0.png")
    report = _build(_cache(tmp_path / "cache", tiny_flux_dir), data, default_caption="x")
    assert [e.image.name for e in report.train] == ["anim.gif", "img0.png", "img1.png", "link.png"]
    reasons = {s.path.name: (s.kind, s.reason) for s in report.skipped}
    assert reasons["gone.png"] == ("broken link", "broken symbolic link (target nowhere.png does not exist)")
    assert reasons["phone.heic"][0] == "unsupported format" and "pillow-heif" in reasons["phone.heic"][1]
    summary = report.format()
    assert "images found:    6" in summary and "skipped:         2 (1 broken link, 1 unsupported format)" in summary
    with pytest.raises(ConfigError, match=r"gone\.png: broken symbolic link"):
        _build(_cache(tmp_path / "cache", tiny_flux_dir), data, default_caption="x", on_bad_file="error")


def test_file_names_that_are_not_utf8_build_and_print(tmp_path: Path, tiny_flux_dir: Path) -> None:
    """A name with a Latin-1 byte: the validation split, the build, the memo and the summary all work, and the
    summary and the log lines encode as strict UTF-8 (how they are printed under a UTF-8 locale)."""
    from lightning_lora.data.sources import split_validation

    data = _dataset(tmp_path / "data", n=3)
    (data / "img1.png").rename(data / os.fsdecode(b"caf\xe9.png"))
    (data / "img1.txt").rename(data / os.fsdecode(b"caf\xe9.txt"))
    (data / os.fsdecode(b"\xff.png")).write_bytes(b"not a png")  # a bad file with such a name
    (data / os.fsdecode(b"\xff.txt")).write_text("x")
    items, skips = scan([ImageFolder(str(data))])
    train, val = split_validation(items, 0.4)  # used to raise UnicodeEncodeError
    assert val
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("lightning_lora.data.build").addHandler(handler)
    try:
        report = build(_cache(tmp_path / "cache", tiny_flux_dir), train, val, _spec(), CPU, scan_skips=skips)
    finally:
        logging.getLogger("lightning_lora.data.build").removeHandler(handler)
    summary = report.format()
    summary.encode("utf-8")  # strict
    assert f"{data}/\\xff.png: not an image" in summary
    assert records and all(r.getMessage().encode("utf-8") for r in records)
    assert len(report.train) + len(report.validation) == 3
    again = build(_cache(tmp_path / "cache", tiny_flux_dir), train, val, _spec(), CPU, scan_skips=skips)
    assert again.latents_encoded == 0 and again.latents_reused == 3


@pytest.mark.parametrize("name", ["sd15", "sdxl"])
def test_clip_families_count_captions_longer_than_77_tokens(
    tmp_path: Path, request: pytest.FixtureRequest, name: str, capfd: pytest.CaptureFixture
) -> None:
    """The default :meth:`DiffusionFamily.prompt_limit` (CLIP's 77 tokens) counts the captions the SD families cut,
    and their pipelines' truncation warnings are silenced too."""
    from lightning_lora.families.sd15 import SD15
    from lightning_lora.families.sdxl import SDXL

    family = {"sd15": SD15(), "sdxl": SDXL()}[name]
    model = request.getfixturevalue(f"tiny_{name}_dir")
    cache = LatentCache(tmp_path / "cache", family, ModelSource(str(model), dtype=torch.float32))
    long = " ".join(f"tag{i}" for i in range(200))
    capfd.readouterr()
    result = cache.encode_texts(["a photo", long, ""], CPU)
    out, err = capfd.readouterr()
    assert (result.encoded, result.truncated, result.limit) == (3, [long], "77 CLIP tokens")
    assert len(out) + len(err) < 2000, err[-2000:]


def _encoder_folders(root: Path, *names: str) -> Path:
    """A model folder with one weight file per text encoder (what :meth:`ModelSource.identity` looks at)."""
    for name in names:
        (root / name).mkdir(parents=True, exist_ok=True)
        (root / name / "model.safetensors").write_bytes(b"weights of " + name.encode())
    return root


def test_text_keys_are_made_of_the_family_text_encoders(tmp_path: Path) -> None:
    """FLUX and SDXL keys are made of both encoders, in order, and (a local folder) their tokenizers; SD1.5's of its
    one encoder and tokenizer. A hub id's keys are what they were: its id and revision pin the tokenizers too."""
    from lightning_lora.data.cache import _hash
    from lightning_lora.families.sd15 import SD15
    from lightning_lora.families.sdxl import SDXL

    folder = _encoder_folders(tmp_path / "model", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2")
    source = ModelSource(str(folder))
    te, te2 = source.identity("text_encoder"), source.identity("text_encoder_2")
    tok, tok2 = source.identity("tokenizer"), source.identity("tokenizer_2")
    text = "a photo of sks cat"
    for family in (Flux(max_sequence_length=16), SDXL(clip_skip=1)):
        key = LatentCache(tmp_path / "cache", family, source).text_key(text)
        assert key == _hash(text, te + te2 + tok + tok2, family.text_cache_tag()), family.name
        fp8 = LatentCache(tmp_path / "cache", family, source, text_encoder_quantization="fp8").text_key(text)
        assert fp8 == _hash(text, f"{te + te2 + tok + tok2}|fp8", family.text_cache_tag())
    sd15 = SD15()
    key = LatentCache(tmp_path / "cache", sd15, source).text_key(text)
    assert key == _hash(text, te + tok, sd15.text_cache_tag())
    hub = ModelSource("black-forest-labs/FLUX.1-dev")
    flux = Flux()
    identity = hub.identity("text_encoder") + hub.identity("text_encoder_2")
    assert LatentCache(tmp_path / "cache", flux, hub).text_key(text) == _hash(text, identity, flux.text_cache_tag())


def test_a_third_text_encoder_is_part_of_the_text_key(tmp_path: Path) -> None:
    """A family that encodes prompts with a third encoder declares it, and a new version of that encoder's weights
    gives new keys (a key made of the first two would serve the old encoder's embeddings)."""

    class ThreeEncoders(Flux):  # not registered: no `name` of its own
        architecture = replace(Flux.architecture, text_encoders=("text_encoder", "text_encoder_2", "text_encoder_3"))

    model = _encoder_folders(tmp_path / "model", "text_encoder", "text_encoder_2", "text_encoder_3")
    source = ModelSource(str(model))

    def keys() -> tuple[str, str]:  # a new cache object each time: identities are read once per cache
        return tuple(LatentCache(tmp_path / "cache", f, source).text_key("a cat") for f in (ThreeEncoders(), Flux()))

    three, two = keys()
    assert three != two
    (model / "text_encoder_3" / "model.safetensors").write_bytes(b"retrained weights of text_encoder_3")
    three_after, two_after = keys()
    assert three_after != three
    assert two_after == two  # FLUX's own encoders did not change


def test_nf4_text_encoders_keep_their_other_weights_in_the_load_dtype(tmp_path: Path) -> None:
    """Inference only: what NF4 leaves unquantized (T5's ``wo``, embeddings, norms) stays bf16; an fp32 upcast, right
    for a trained base, would make T5-XXL's ``wo`` alone 4 GB."""
    import bitsandbytes as bnb

    from lightning_lora.data.cache import quantize_text_encoders
    from lightning_lora.families.base import ModelSource
    from lightning_lora.tiny.flux import save_tiny_flux

    folder = save_tiny_flux(tmp_path / "flux64", seed=0, dim64=True)  # NF4 needs widths that are multiples of 64
    encoders = Flux().load_text_encoders(ModelSource(str(folder), dtype=torch.bfloat16))
    swapped = quantize_text_encoders(
        encoders, Flux.architecture.text_encoders, "nf4", torch.device("cpu"), torch.bfloat16
    )
    t5 = encoders.text_encoder_2
    assert swapped > 0 and any(isinstance(m, bnb.nn.Linear4bit) for m in t5.modules())
    others = {n: p.dtype for n, p in t5.named_parameters() if p.is_floating_point() and p.dtype != torch.uint8}
    assert others and set(others.values()) == {torch.bfloat16}, {n: d for n, d in others.items() if d != torch.bfloat16}


def _masked_dataset(root: Path) -> tuple[Path, Path]:
    """Three noise images (``_dataset``) and masks for two of them (white right of column 20), one more mask of no
    image."""
    data, masks = _dataset(root / "data", n=3), root / "masks"
    masks.mkdir()
    for i, (width, height) in enumerate([(40, 48), (64, 32)]):
        mask = np.zeros((height, width), np.uint8)
        mask[:, 20:] = 255
        Image.fromarray(mask).save(masks / f"img{i}.png")
    Image.fromarray(np.zeros((8, 8), np.uint8)).save(masks / "stray.png")
    return data, masks


def _masked_build(cache: LatentCache, data: Path, masks: str | Path, **kwargs) -> CacheReport:
    items, skips = scan([ImageFolder(str(data), masks=str(masks), unmasked_weight=0.25)])
    return build(cache, items, [], _spec(**kwargs), CPU, scan_skips=skips)


def test_masks_are_small_entries_of_their_own_at_the_latents_grid(tmp_path: Path, tiny_flux_dir: Path) -> None:
    """Each mask is computed once per latent (the mirrored one mirrored) at that latent's grid, keyed apart from it:
    editing a mask recomputes that mask only, every latent reused. The summary counts the images with a mask, without
    one, and the masks that matched no image."""
    from lightning_lora.data.images import decode_mask

    data, masks = _masked_dataset(tmp_path)
    cache = _cache(tmp_path / "cache", tiny_flux_dir)
    report = _masked_build(cache, data, masks, flip=True)
    masked = {e.image.name: e for e in report.train if e.mask is not None}
    assert sorted(masked) == ["img0.png", "img1.png"] and report.masks_encoded == 4 and report.masks_reused == 0
    e = masked["img1.png"]
    assert e.mask is not None
    plain, mirrored = (load_file(cache.mask_path(k))["mask"] for k in e.mask.keys())
    latents = cache.load_latents(e.latent_key)["latents"]
    assert plain.shape == (1, *latents.shape[-2:]) and plain.dtype == torch.float32
    expected = decode_mask(masks / "img1.png", e.placement.source_box(), latents.shape[:-3:-1])
    assert torch.equal(plain[0], torch.from_numpy(expected)) and torch.equal(mirrored, plain.flip(-1))
    assert e.mask.unmasked_weight == 0.25 and plain.min() == 0 and plain.max() > 0.99
    summary = report.format()
    assert "masks:           2 images with a mask, 1 without (trained everywhere), 1 mask matched no image" in summary
    assert "4 computed, 0 reused" in summary

    edited = np.asarray(Image.open(masks / "img0.png")).copy()
    edited[:, :] = 255
    Image.fromarray(edited).save(masks / "img0.png")
    again = _masked_build(_cache(tmp_path / "cache", tiny_flux_dir), data, masks, flip=True)
    assert (again.latents_encoded, again.masks_encoded, again.masks_reused) == (0, 2, 2)
    new = next(x for x in again.train if x.image.name == "img0.png")
    assert new.mask is not None
    assert load_file(cache.mask_path(new.mask.key))["mask"].min() > 0.99


def test_a_mask_that_cannot_be_read_leaves_its_image_out_naming_the_mask(tmp_path: Path, tiny_flux_dir: Path) -> None:
    data, masks = _masked_dataset(tmp_path)
    (masks / "img0.png").write_bytes(b"not a png")
    report = _masked_build(_cache(tmp_path / "cache", tiny_flux_dir), data, masks)
    assert sorted(e.image.name for e in report.train) == ["img1.png", "img2.png"]
    (skip,) = [s for s in report.skipped if not s.note]
    assert skip.path.name == "img0.png" and skip.kind.startswith("mask: ")
    assert "its mask img0.png" in skip.reason and "fix the mask or remove it" in skip.reason
    with pytest.raises(ConfigError, match="cannot be used"):
        items, _ = scan([ImageFolder(str(data), masks=str(masks))])
        build(_cache(tmp_path / "cache", tiny_flux_dir), items, [], _spec(), CPU, on_bad_file="error")


def test_alpha_masks_and_an_image_without_transparency(tmp_path: Path, tiny_flux_dir: Path) -> None:
    folder = tmp_path / "data"
    folder.mkdir()
    rgba = np.full((32, 32, 4), 255, np.uint8)
    rgba[:, :16, 3] = 0
    Image.fromarray(rgba, "RGBA").save(folder / "cutout.png")
    _noise_image(folder / "opaque.png", seed=1, size=(32, 32))
    items, skips = scan([ImageFolder(str(folder), masks="alpha")], default_caption="a thing")
    report = build(_cache(tmp_path / "cache", tiny_flux_dir), items, [], _spec(), CPU, scan_skips=skips)
    by_name = {e.image.name: e for e in report.train}
    assert by_name["cutout.png"].mask is not None and by_name["cutout.png"].mask.alpha
    assert by_name["opaque.png"].mask is None
    assert "has no transparency (masks: alpha): trained everywhere" in report.format()
    assert "masks:           1 images with a mask, 1 without" in report.format()


def test_preservation_captions_are_cached_like_every_caption(tmp_path: Path, tiny_flux_dir: Path) -> None:
    """With ``every_image``, each training image is also an entry of role ``preservation`` (the same latents) whose
    captions have the trigger replaced by the class word, cached with the rest; a regularization image keeps its own
    role and weight; the summary counts both."""
    from lightning_lora.objectives import Preservation

    data, regularization = _dataset(tmp_path / "data", n=2), _dataset(tmp_path / "class", n=1)
    (regularization / "img0.txt").write_text("a photo of a cat")
    folders = [ImageFolder(str(data)), ImageFolder(str(regularization), role="regularization", loss_weight=0.5)]
    items, skips = scan(folders, trigger="sks")
    cache = _cache(tmp_path / "cache", tiny_flux_dir)
    preservation = Preservation(mode="dop", every_image=True, class_word="animal", weight=0.8)
    report = build(cache, items, [], _spec(preservation=preservation), CPU, scan_skips=skips)
    roles = [(e.image.parent.name, e.role, e.caption, e.loss_weight) for e in report.train]
    assert roles == [
        ("data", "train", "a photo of sks cat", 1.0),
        ("data", "preservation", "a photo of animal cat", 0.8),
        ("data", "train", "a photo of sks dog", 1.0),
        ("data", "preservation", "a photo of animal dog", 0.8),
        ("class", "regularization", "a photo of a cat", 0.5),
    ]
    train, twin = report.train[:2]
    assert twin.latent_key == train.latent_key and twin.mask is None
    assert all(cache.text_path(k).is_file() for e in report.train for k in e.text_keys)
    assert report.texts_encoded == 6  # 2 captions, their 2 preservation captions, the class image's, the empty prompt
    summary = report.format()
    assert "training:        2 images, 2 entries" in summary
    assert "regularization:  1 images, 1 samples per epoch (loss weight 0.5)" in summary
    assert "preservation:    2 entries with the trigger taken out of the caption, 2 samples per epoch" in summary


def test_regularization_images_that_all_fail_stop_the_build(tmp_path: Path, tiny_flux_dir: Path) -> None:
    data, regularization = _dataset(tmp_path / "data", n=1), tmp_path / "class"
    regularization.mkdir()
    (regularization / "broken.png").write_bytes(b"not a png")
    (regularization / "broken.txt").write_text("a photo of a cat")
    items, skips = scan([ImageFolder(str(data)), ImageFolder(str(regularization), role="regularization")])
    with pytest.raises(ConfigError, match=r"data.images: none of the regularization images can be used") as e:
        build(_cache(tmp_path / "cache", tiny_flux_dir), items, [], _spec(), CPU, scan_skips=skips)
    assert "\n" not in str(e.value)
