"""The latent cache: finding captioned images, decoding them robustly, and content-keyed incremental encoding."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from lightning_lora.data.cache import LatentCache, Sample, find_samples, load_image
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
        _noise_image(folder / f"img{i}.png", seed=i)
        (folder / f"img{i}.txt").write_text(f"a photo of sks {['cat', 'dog', 'cup', 'car', 'bird'][i]}\n")
    return folder


# -- find_samples --------------------------------------------------------------------------------------------------


def test_find_samples_sorted_with_captions(tmp_path: Path) -> None:
    for name in ["b.png", "a.jpg", "c.JPEG", "notes.md", "d.webp.txt"]:
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "sub.png").mkdir()  # a folder named like an image is not an image
    (tmp_path / "a.txt").write_text("  caption a \n")
    (tmp_path / "b.txt").write_text("caption b")
    (tmp_path / "c.txt").write_text("caption c")
    samples = find_samples([str(tmp_path)])
    assert [s.image.name for s in samples] == ["a.jpg", "b.png", "c.JPEG"]
    assert [s.caption for s in samples] == ["caption a", "caption b", "caption c"]


def test_find_samples_several_folders_and_caption_ext(tmp_path: Path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    (one / "x.png").write_bytes(b"")
    (one / "x.caption").write_text("from one")
    (two / "y.png").write_bytes(b"")
    (two / "y.caption").write_text("from two")
    samples = find_samples([str(one), str(two)], caption_ext=".caption")
    assert samples == [Sample(one / "x.png", "from one"), Sample(two / "y.png", "from two")]


def test_find_samples_default_caption(tmp_path: Path) -> None:
    (tmp_path / "a.png").write_bytes(b"")
    (tmp_path / "b.png").write_bytes(b"")
    (tmp_path / "b.txt").write_text("own caption")
    samples = find_samples([str(tmp_path)], default_caption="sks style")
    assert [s.caption for s in samples] == ["sks style", "own caption"]


def test_find_samples_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"data\.images.*does not exist"):
        find_samples([str(tmp_path / "missing")])
    (tmp_path / "readme.txt").write_text("no images here")
    with pytest.raises(ConfigError, match=r"data\.images.*holds no images"):
        find_samples([str(tmp_path)])
    (tmp_path / "lonely.png").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"lonely\.png.*lonely\.txt.*data\.default_caption"):
        find_samples([str(tmp_path)])


# -- load_image ----------------------------------------------------------------------------------------------------


def _check_pixels(x: torch.Tensor, res: int = RES) -> None:
    assert x.shape == (3, res, res) and x.dtype == torch.float32
    assert x.min() >= -1.0 and x.max() <= 1.0


def test_load_image_shape_range_and_crop(tmp_path: Path) -> None:
    # 144 wide x 48 tall: left third red, middle green, right third blue. Short side -> 32 (96 x 32), and the
    # center crop is exactly the green third.
    arr = np.zeros((48, 144, 3), dtype=np.uint8)
    arr[:, :48, 0] = 255
    arr[:, 48:96, 1] = 255
    arr[:, 96:, 2] = 255
    Image.fromarray(arr).save(tmp_path / "wide.png")
    x = load_image(tmp_path / "wide.png", RES)
    _check_pixels(x)
    center = x[:, 4:-4, 4:-4]
    torch.testing.assert_close(center[1], torch.ones_like(center[1]), atol=0.05, rtol=0)
    torch.testing.assert_close(center[0], -torch.ones_like(center[0]), atol=0.05, rtol=0)
    # Full range maps to [-1, 1] exactly.
    Image.new("RGB", (RES, RES), (0, 255, 0)).save(tmp_path / "flat.png")
    flat = load_image(tmp_path / "flat.png", RES)
    assert flat[0].eq(-1).all() and flat[1].eq(1).all()


def test_load_image_upscales_small_images(tmp_path: Path) -> None:
    _noise_image(tmp_path / "small.png", seed=0, size=(10, 20))
    _check_pixels(load_image(tmp_path / "small.png", 64), 64)


def test_load_image_rgba_composited_on_white(tmp_path: Path) -> None:
    Image.new("RGBA", (RES, RES), (0, 0, 0, 0)).save(tmp_path / "clear.png")  # fully transparent black
    x = load_image(tmp_path / "clear.png", RES)
    _check_pixels(x)
    assert x.eq(1).all()  # white, not black
    Image.new("RGBA", (RES, RES), (255, 0, 0, 255)).save(tmp_path / "opaque.png")
    y = load_image(tmp_path / "opaque.png", RES)
    assert y[0].eq(1).all() and y[1].eq(-1).all()


def test_load_image_grayscale_and_palette(tmp_path: Path) -> None:
    Image.fromarray(np.tile(np.arange(0, 256, 8, dtype=np.uint8), (32, 1)), "L").save(tmp_path / "gray.png")
    x = load_image(tmp_path / "gray.png", RES)
    _check_pixels(x)
    assert torch.equal(x[0], x[1]) and torch.equal(x[1], x[2])
    assert x[0, :, -1].mean() > x[0, :, 0].mean()  # the ramp survives
    la = Image.new("LA", (RES, RES), (0, 0))
    la.save(tmp_path / "la.png")
    assert load_image(tmp_path / "la.png", RES).eq(1).all()
    pal = Image.new("RGB", (RES, RES), (0, 0, 255)).convert("P")
    pal.save(tmp_path / "pal.png")
    p = load_image(tmp_path / "pal.png", RES)
    _check_pixels(p)
    assert p[2].gt(0.9).all() and p[0].lt(-0.9).all()


def test_load_image_16bit(tmp_path: Path) -> None:
    ramp = np.tile(np.linspace(0, 65535, 64).astype(np.uint16), (64, 1))
    Image.fromarray(ramp).save(tmp_path / "deep.png")
    assert Image.open(tmp_path / "deep.png").mode.startswith("I")
    x = load_image(tmp_path / "deep.png", 64)
    _check_pixels(x, 64)
    # A naive convert("RGB") clips everything above 255 to white; the ramp must survive as a ramp.
    row = x[0, 32]
    assert row[0] < -0.9 and row[-1] > 0.9
    assert (row.diff() >= -1e-6).all()
    assert torch.equal(x[0], x[1]) and torch.equal(x[1], x[2])


def test_load_image_16bit_keeps_absolute_brightness(tmp_path: Path) -> None:
    Image.fromarray(np.full((RES, RES), 1000, dtype=np.uint16)).save(tmp_path / "dark.png")  # ~1.5% grey
    x = load_image(tmp_path / "dark.png", RES)
    assert x.max() < -0.9  # near black, not stretched to white


def test_load_image_cmyk(tmp_path: Path) -> None:
    Image.new("CMYK", (40, 40), (0, 255, 255, 0)).save(tmp_path / "cmyk.jpg")
    assert Image.open(tmp_path / "cmyk.jpg").mode == "CMYK"
    x = load_image(tmp_path / "cmyk.jpg", RES)
    _check_pixels(x)
    assert x[0].mean() > 0.8 and x[1].mean() < -0.8 and x[2].mean() < -0.8  # red


def test_load_image_respects_exif_rotation(tmp_path: Path) -> None:
    # Stored 64 wide x 32 tall, left half red, right half blue; orientation 6 = "rotate 90 degrees clockwise to view".
    arr = np.zeros((32, 64, 3), dtype=np.uint8)
    arr[:, :32, 0] = 255
    arr[:, 32:, 2] = 255
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.fromarray(arr).save(tmp_path / "rotated.jpg", quality=95, exif=exif)
    Image.fromarray(arr).save(tmp_path / "plain.jpg", quality=95)
    rotated = load_image(tmp_path / "rotated.jpg", RES)
    plain = load_image(tmp_path / "plain.jpg", RES)
    _check_pixels(rotated)
    # Viewed upright the image is 32 x 64 with red on top and blue below.
    assert rotated[0, 4:12].mean() > 0.8 and rotated[2, 4:12].mean() < -0.8
    assert rotated[2, -12:-4].mean() > 0.8 and rotated[0, -12:-4].mean() < -0.8
    # Without the tag: red on the left, blue on the right.
    assert plain[0, :, 4:12].mean() > 0.8 and plain[2, :, -12:-4].mean() > 0.8


def test_load_image_real_photo(photos_dir: Path) -> None:
    path = sorted(photos_dir.glob("*.png"))[0]
    x = load_image(path, 64)
    _check_pixels(x, 64)
    assert x.std() > 0.1


# -- LatentCache ---------------------------------------------------------------------------------------------------


def _cache(root: Path, model: Path, res: int = RES, t5_len: int = 16) -> LatentCache:
    return LatentCache(root, Flux(max_sequence_length=t5_len), ModelSource(str(model), dtype=torch.float32), res)


def test_cache_build_then_reuse(tmp_path: Path, tiny_flux_dir: Path) -> None:
    data = _dataset(tmp_path / "data", n=3)
    (data / "img2.txt").write_text((data / "img0.txt").read_text())  # two images share one caption
    samples = find_samples([str(data)])
    cache = _cache(tmp_path / "cache", tiny_flux_dir)

    entries, stats = cache.build(samples, CPU, batch_size=2)
    assert [e.sample for e in entries] == samples
    assert (stats["images"], stats["encoded"], stats["reused"], stats["skipped"]) == (3, 3, 0, 0)
    assert stats["captions_encoded"] == 2
    assert len(list((tmp_path / "cache" / "latents").glob("*.safetensors"))) == 3
    assert len(list((tmp_path / "cache" / "text").glob("*.safetensors"))) == 2
    assert not list((tmp_path / "cache").rglob("*.tmp"))

    # What is cached is what the family computes (center-cropped image -> normalized VAE mean).
    lat = cache.load_latents(entries[1].latent_key)
    assert lat.shape == (4, RES // 8, RES // 8) and lat.dtype == torch.float32
    vae = cache.family.load_vae(cache.source)
    direct = cache.family.encode_images(vae, load_image(samples[1].image, RES)[None])[0]
    torch.testing.assert_close(lat, direct, atol=1e-5, rtol=1e-5)
    text = cache.load_text(entries[0].text_key)
    assert set(text) == {"prompt_embeds", "pooled_prompt_embeds"}
    assert text["prompt_embeds"].shape == (16, 32) and text["pooled_prompt_embeds"].shape == (32,)

    again, stats2 = _cache(tmp_path / "cache", tiny_flux_dir).build(samples, CPU)
    assert again == entries
    assert (stats2["encoded"], stats2["reused"], stats2["captions_encoded"], stats2["skipped"]) == (0, 3, 0, 0)


def test_cache_edit_caption_reencodes_only_that_caption(tmp_path: Path, tiny_flux_dir: Path) -> None:
    data = _dataset(tmp_path / "data", n=3)
    cache = _cache(tmp_path / "cache", tiny_flux_dir)
    before, _ = cache.build(find_samples([str(data)]), CPU)
    (data / "img1.txt").write_text("a painting of sks dog")
    after, stats = cache.build(find_samples([str(data)]), CPU)
    assert (stats["captions_encoded"], stats["encoded"], stats["reused"]) == (1, 0, 3)
    assert after[1].text_key != before[1].text_key
    assert [a.text_key for a in after[::2]] == [b.text_key for b in before[::2]]
    assert not torch.equal(
        cache.load_text(after[1].text_key)["prompt_embeds"], cache.load_text(before[1].text_key)["prompt_embeds"]
    )


def test_cache_changed_image_reencodes_one_latent(tmp_path: Path, tiny_flux_dir: Path) -> None:
    data = _dataset(tmp_path / "data", n=3)
    cache = _cache(tmp_path / "cache", tiny_flux_dir)
    before, _ = cache.build(find_samples([str(data)]), CPU)
    _noise_image(data / "img0.png", seed=99)  # same name, new bytes
    after, stats = cache.build(find_samples([str(data)]), CPU)
    assert (stats["encoded"], stats["reused"], stats["captions_encoded"]) == (1, 2, 0)
    assert after[0].latent_key != before[0].latent_key
    assert not torch.equal(cache.load_latents(after[0].latent_key), cache.load_latents(before[0].latent_key))


def test_cache_keys_depend_on_resolution_and_text_options(tmp_path: Path, tiny_flux_dir: Path) -> None:
    data = _dataset(tmp_path / "data", n=2)
    samples = find_samples([str(data)])
    _cache(tmp_path / "cache", tiny_flux_dir).build(samples, CPU)
    _, stats = _cache(tmp_path / "cache", tiny_flux_dir, res=48).build(samples, CPU)
    assert (stats["encoded"], stats["captions_encoded"]) == (2, 0)
    _, stats = _cache(tmp_path / "cache", tiny_flux_dir, t5_len=8).build(samples, CPU)
    assert (stats["encoded"], stats["captions_encoded"]) == (0, 2)


def test_cache_rebuilds_truncated_files(tmp_path: Path, tiny_flux_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    data = _dataset(tmp_path / "data", n=3)
    samples = find_samples([str(data)])
    cache = _cache(tmp_path / "cache", tiny_flux_dir)
    entries, _ = cache.build(samples, CPU)
    good = cache.load_latents(entries[2].latent_key).clone()  # load_file memory-maps: copy before truncating
    for path in (cache.latent_path(entries[2].latent_key), cache.text_path(entries[0].text_key)):
        raw = path.read_bytes()
        path.write_bytes(raw[: len(raw) // 2])
    with caplog.at_level(logging.WARNING, logger="lightning_lora.data.cache"):
        _, stats = cache.build(samples, CPU)
    assert (stats["encoded"], stats["reused"], stats["captions_encoded"]) == (1, 2, 1)
    assert "unreadable" in caplog.text
    torch.testing.assert_close(cache.load_latents(entries[2].latent_key), good)
    assert load_file(cache.text_path(entries[0].text_key))  # readable again


def test_cache_skips_corrupt_images(tmp_path: Path, tiny_flux_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    data = _dataset(tmp_path / "data", n=2)
    (data / "noise.png").write_bytes(np.random.default_rng(0).integers(0, 256, 500, dtype=np.uint8).tobytes())
    (data / "empty.jpg").write_bytes(b"")
    good = (data / "img0.png").read_bytes()
    (data / "half.png").write_bytes(good[: len(good) // 2])  # a valid header, truncated pixel data
    samples = find_samples([str(data)], default_caption="a photo")
    assert len(samples) == 5
    cache = _cache(tmp_path / "cache", tiny_flux_dir)
    with caplog.at_level(logging.WARNING, logger="lightning_lora.data.cache"):
        entries, stats = cache.build(samples, CPU, batch_size=2)
    assert [e.sample.image.name for e in entries] == ["img0.png", "img1.png"]
    assert (stats["images"], stats["encoded"], stats["skipped"]) == (5, 2, 3)
    for name in ("noise.png", "empty.jpg", "half.png"):
        assert name in caplog.text
    assert len(list((tmp_path / "cache" / "latents").glob("*.safetensors"))) == 2


def test_cache_all_images_bad(tmp_path: Path, tiny_flux_dir: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.png").write_bytes(b"not a png at all")
    (data / "b.jpg").write_bytes(b"")
    cache = _cache(tmp_path / "cache", tiny_flux_dir)
    with pytest.raises(ConfigError, match=r"data\.images"):
        cache.build(find_samples([str(data)], default_caption="x"), CPU)


def test_cache_real_photos(tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path) -> None:
    data = tmp_path / "photos"
    shutil.copytree(photos_dir, data)
    samples = find_samples([str(data)])
    entries, stats = _cache(tmp_path / "cache", tiny_flux_dir, res=64).build(samples, CPU)
    assert stats["encoded"] == len(samples) == len(entries) and stats["skipped"] == 0
    keys = {e.latent_key for e in entries}
    assert len(keys) == len(samples)
