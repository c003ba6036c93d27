"""Decoding what users' folders hold: odd modes, EXIF rotation, bad files, and very large images in bounded memory."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import REPO
from PIL import Image

from lightning_lora.data.buckets import cover
from lightning_lora.data.images import BadImage, decode, decode_mask, has_alpha, parse_color, probe

RES = 32


def _decode(path: Path, bucket: tuple[int, int] = (RES, RES), background=(255, 255, 255)) -> np.ndarray:
    """Decode the way the cache does: probe, cover the bucket, center-crop."""
    p = cover(*probe(path), bucket)
    return decode(path, p.source_box(), p.bucket, background)


def _file(path: Path) -> tuple[str, int]:
    """The mode and frame count Pillow reads from a file (closed again)."""
    with Image.open(path) as im:
        return im.mode, getattr(im, "n_frames", 1)


def _signed(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float32) / 127.5 - 1.0


def test_cover_and_center_crop_geometry(tmp_path: Path) -> None:
    # 144 wide x 48 tall: left third red, middle green, right third blue. Covering 32x32 resizes to 96x32 and the
    # center crop is exactly the green third.
    arr = np.zeros((48, 144, 3), dtype=np.uint8)
    arr[:, :48, 0] = 255
    arr[:, 48:96, 1] = 255
    arr[:, 96:, 2] = 255
    Image.fromarray(arr).save(tmp_path / "wide.png")
    p = cover(144, 48, (RES, RES))
    assert (p.resized, p.crop, p.crop_top_left(), p.crop_top_left(flipped=True)) == (
        (96, 32),
        (32, 0),
        (0, 32),
        (0, 32),
    )
    x = _decode(tmp_path / "wide.png")
    assert x.shape == (RES, RES, 3) and x.dtype == np.uint8
    center = x[4:-4, 4:-4]
    assert center[..., 1].min() > 240 and center[..., 0].max() < 15 and center[..., 2].max() < 15
    Image.new("RGB", (RES, RES), (0, 255, 0)).save(tmp_path / "flat.png")
    flat = _signed(_decode(tmp_path / "flat.png"))
    assert (flat[..., 0] == -1).all() and (flat[..., 1] == 1).all()  # full range maps to [-1, 1] exactly


def test_small_image_can_be_enlarged(tmp_path: Path) -> None:
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (20, 10, 3), dtype=np.uint8)).save(tmp_path / "s.png")
    assert _decode(tmp_path / "s.png", (64, 64)).shape == (64, 64, 3)


def test_transparency_is_composited_on_the_stated_background(tmp_path: Path) -> None:
    Image.new("RGBA", (RES, RES), (0, 0, 0, 0)).save(tmp_path / "clear.png")  # fully transparent black
    assert (_decode(tmp_path / "clear.png") == 255).all()  # white by default, not black
    assert (_decode(tmp_path / "clear.png", background=(0, 0, 0)) == 0).all()
    assert (_decode(tmp_path / "clear.png", background=parse_color("#ff8000")) == [255, 128, 0]).all()
    Image.new("RGBA", (RES, RES), (255, 0, 0, 255)).save(tmp_path / "opaque.png")
    assert (_decode(tmp_path / "opaque.png") == [255, 0, 0]).all()
    # Half transparent red over the left half, resized 2x down: no dark fringe from the transparent pixels' colour.
    half = Image.new("RGBA", (2 * RES, 2 * RES), (0, 0, 0, 0))
    half.paste((255, 0, 0, 255), (0, 0, RES, 2 * RES))
    half.save(tmp_path / "half.png")
    x = _decode(tmp_path / "half.png")
    left, right = x[:, : RES // 2 - 3].astype(int), x[:, RES // 2 + 3 :].astype(int)
    assert np.abs(left - [255, 0, 0]).max() <= 2 and right.min() >= 253  # (Lanczos rings by a level or two)
    assert x[..., 0].min() >= 254  # the red channel never darkens at the edge (premultiplied resampling)
    with pytest.raises(ValueError, match="data.alpha_background"):
        parse_color("not-a-colour")


def test_grayscale_palette_and_la(tmp_path: Path) -> None:
    Image.fromarray(np.tile(np.arange(0, 256, 8, dtype=np.uint8), (32, 1)), "L").save(tmp_path / "gray.png")
    x = _decode(tmp_path / "gray.png")
    assert (x[..., 0] == x[..., 1]).all() and (x[..., 1] == x[..., 2]).all()
    assert x[:, -1, 0].mean() > x[:, 0, 0].mean() + 100  # the ramp survives
    Image.new("LA", (RES, RES), (0, 0)).save(tmp_path / "la.png")
    assert (_decode(tmp_path / "la.png") == 255).all()
    Image.new("RGB", (RES, RES), (0, 0, 255)).convert("P").save(tmp_path / "pal.png")
    p = _decode(tmp_path / "pal.png")
    assert p[..., 2].min() > 240 and p[..., 0].max() < 15
    pal = Image.new("P", (RES, RES), 1)
    pal.putpalette([0, 0, 0, 255, 0, 0] + [0] * 762)
    pal.save(tmp_path / "palt.png", transparency=1)  # palette index 1 (red) is transparent
    assert (_decode(tmp_path / "palt.png") == 255).all()
    Image.new("1", (RES, RES), 1).save(tmp_path / "bw.bmp")
    assert (_decode(tmp_path / "bw.bmp") == 255).all()


def test_16bit_grayscale_keeps_its_ramp_and_brightness(tmp_path: Path) -> None:
    ramp = np.tile(np.linspace(0, 65535, 64).astype(np.uint16), (64, 1))
    Image.fromarray(ramp).save(tmp_path / "deep.png")
    assert _file(tmp_path / "deep.png")[0].startswith("I")
    row = _signed(_decode(tmp_path / "deep.png", (64, 64)))[32, :, 0]
    # A naive convert("RGB") clips everything above 255 to white; the ramp must survive as a ramp.
    assert row[0] < -0.9 and row[-1] > 0.9 and (np.diff(row) >= -1e-6).all()
    Image.fromarray(np.full((RES, RES), 1000, dtype=np.uint16)).save(tmp_path / "dark.png")  # ~1.5% grey
    assert _decode(tmp_path / "dark.png").max() < 10  # near black, not stretched to white


def test_cmyk_jpeg(tmp_path: Path) -> None:
    Image.new("CMYK", (40, 40), (0, 255, 255, 0)).save(tmp_path / "cmyk.jpg")
    assert _file(tmp_path / "cmyk.jpg")[0] == "CMYK"
    x = _decode(tmp_path / "cmyk.jpg").astype(int)
    assert x[..., 0].mean() > 230 and x[..., 1].mean() < 25 and x[..., 2].mean() < 25  # red


def test_exif_rotation_is_honoured_in_size_and_pixels(tmp_path: Path) -> None:
    # Stored 64 wide x 32 tall, left half red, right half blue; orientation 6 = "rotate 90 degrees clockwise to view".
    arr = np.zeros((32, 64, 3), dtype=np.uint8)
    arr[:, :32, 0] = 255
    arr[:, 32:, 2] = 255
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.fromarray(arr).save(tmp_path / "rotated.jpg", quality=95, exif=exif)
    assert probe(tmp_path / "rotated.jpg") == (32, 64)  # a portrait image: it gets a portrait bucket
    rotated = _decode(tmp_path / "rotated.jpg", (16, 32)).astype(int)
    assert rotated.shape == (32, 16, 3)
    # Viewed upright: red on top, blue below.
    assert rotated[2:12, :, 0].mean() > 220 and rotated[2:12, :, 2].mean() < 35
    assert rotated[-12:-2, :, 2].mean() > 220 and rotated[-12:-2, :, 0].mean() < 35


@pytest.mark.parametrize("orientation", range(1, 9))
def test_every_exif_orientation_gives_the_upright_crop(tmp_path: Path, orientation: int) -> None:
    """Stored pixels + orientation tag decode to the same crop as the upright image stored plainly."""
    rng = np.random.default_rng(orientation)
    coarse = rng.integers(0, 256, (3, 5, 3), dtype=np.uint8)
    upright = Image.fromarray(coarse).resize((50, 30), Image.Resampling.BICUBIC)  # 50 wide, 30 tall, asymmetric
    upright.save(tmp_path / "upright.png")
    undo = {2: 0, 3: 3, 4: 1, 5: 5, 6: 2, 7: 6, 8: 4}  # the inverse of each orientation's transpose
    stored = upright.transpose(Image.Transpose(undo[orientation])) if orientation > 1 else upright
    exif = Image.Exif()
    exif[0x0112] = orientation
    stored.save(tmp_path / "stored.png", exif=exif)
    assert probe(tmp_path / "stored.png") == (50, 30)
    box, size = (7.0, 3.5, 39.0, 27.5), (16, 12)
    expected = decode(tmp_path / "upright.png", box, size).astype(int)
    got = decode(tmp_path / "stored.png", box, size).astype(int)
    assert np.abs(got - expected).max() <= 3  # resampling passes run in the other order when the axes swap


@pytest.mark.parametrize(
    ("content", "kind", "message"),
    [
        (b"", "empty file", "0 bytes"),
        (b"this is a text file, not a picture\n" * 10, "not an image", "not an image"),
        (bytes(np.random.default_rng(0).integers(0, 256, 500, dtype=np.uint8)), "not an image", "not an image"),
    ],
    ids=["zero-bytes", "text-named-jpg", "random-bytes"],
)
def test_files_that_are_not_images(tmp_path: Path, content: bytes, kind: str, message: str) -> None:
    path = tmp_path / "bad.jpg"
    path.write_bytes(content)
    with pytest.raises(BadImage, match=message) as info:
        probe(path)
    assert info.value.kind == kind
    with pytest.raises(BadImage):
        decode(path, (0, 0, 8, 8), (8, 8))


@pytest.mark.parametrize("fmt", ["png", "jpg"])
def test_truncated_image_is_reported_not_repaired(tmp_path: Path, fmt: str) -> None:
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(tmp_path / f"full.{fmt}")
    good = (tmp_path / f"full.{fmt}").read_bytes()
    (tmp_path / f"half.{fmt}").write_bytes(good[: len(good) // 2])
    assert probe(tmp_path / f"half.{fmt}") == (64, 64)  # the header is intact...
    with pytest.raises(BadImage, match="cannot decode") as info:  # ...the pixels are not
        _decode(tmp_path / f"half.{fmt}")
    assert info.value.kind == "cannot decode"


_MEMORY_PROBE = """
import json, sys
from lightning_lora.data.images import decode, probe

def peak_mb():  # VmHWM: this address space's peak RSS (ru_maxrss would carry over the parent's across fork/exec)
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024

assert "torch" not in sys.modules  # the decoder is light enough for worker processes
before = peak_mb()
width, height = probe(sys.argv[1])
x = decode(sys.argv[1], (0.0, 0.0, float(width), float(height)), (1200, 800))
print(json.dumps({"size": [width, height], "shape": list(x.shape), "mean": x.mean(axis=(0, 1)).tolist(),
                  "before_mb": before, "peak_increase_mb": peak_mb() - before}))
"""


@pytest.mark.subprocess
@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads the peak RSS from /proc (Linux)")
def test_very_large_images_decode_in_bounded_memory(tmp_path: Path) -> None:
    """12000x8000 (288 MB as RGB): a JPEG is decoded at reduced size by the decoder itself; a PNG once, then reduced."""
    big = Image.new("RGB", (12000, 8000), (200, 100, 50))
    big.save(tmp_path / "big.jpg", quality=80)
    big.save(tmp_path / "big.png", compress_level=1)
    del big
    results = {}
    for name in ("big.jpg", "big.png"):
        out = subprocess.run(
            [sys.executable, "-c", _MEMORY_PROBE, str(tmp_path / name)],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=REPO,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        results[name] = json.loads(out.stdout)
    for r in results.values():
        assert r["size"] == [12000, 8000] and r["shape"] == [800, 1200, 3]
        assert np.allclose(r["mean"], [200, 100, 50], atol=3)
    print({k: round(v["peak_increase_mb"]) for k, v in results.items()})
    assert results["big.jpg"]["peak_increase_mb"] < 60  # vs 288 MB for a full decode
    # A PNG has no reduced decode: one full-size decode (Pillow keeps RGB in 4 bytes a pixel: 384 MB), and no
    # copy of it (no full-size rotation, conversion or float array). The lower bound shows the measurement is real.
    assert 300 < results["big.png"]["peak_increase_mb"] < 1.5 * 384


def test_gif_tiff_and_animations_decode_their_first_frame(tmp_path: Path) -> None:
    """Formats a folder may hold beside JPEG and PNG, written by Pillow: GIF (a palette with a transparent index,
    grayscale, animated), TIFF (multi-page, 16-bit, float), APNG and animated WebP. An animation or a multi-page file
    is used for its first frame."""
    red, blue, green = (255, 0, 0), (0, 0, 255), (0, 255, 0)
    # A palette GIF: index 2 (blue) on the left, index 1 transparent on the right.
    pal = Image.new("P", (RES, RES), 1)
    pal.putpalette([0, 0, 0, *red, *blue] + [0] * 759)
    pal.paste(2, (0, 0, RES // 2, RES))
    pal.save(tmp_path / "half.gif", transparency=1)
    x = _decode(tmp_path / "half.gif").astype(int)
    assert np.abs(x[:, : RES // 2 - 3] - blue).max() <= 3 and x[:, RES // 2 + 3 :].min() >= 252
    # A grayscale GIF (Pillow opens it as "L") whose transparent index is its only colour.
    Image.new("L", (RES, RES), 7).save(tmp_path / "gray.gif", transparency=7)
    assert (_decode(tmp_path / "gray.gif") == 255).all()
    assert (_decode(tmp_path / "gray.gif", background=(0, 0, 0)) == 0).all()
    frames = [Image.new("RGB", (RES, RES), c) for c in (red, blue, green)]
    frames[0].save(tmp_path / "anim.gif", save_all=True, append_images=frames[1:], duration=100, loop=0)
    frames[0].save(tmp_path / "anim.png", save_all=True, append_images=frames[1:], duration=100)  # APNG
    frames[0].save(tmp_path / "anim.webp", save_all=True, append_images=frames[1:], duration=100, lossless=True)
    for name in ("anim.gif", "anim.png", "anim.webp"):
        assert _file(tmp_path / name)[1] == 3, name
        assert np.abs(_decode(tmp_path / name).astype(int) - red).max() <= 3, name
    # A multi-page TIFF: green page first, then red and blue.
    pages = [Image.new("RGB", (RES, RES), c) for c in (green, red, blue)]
    pages[0].save(tmp_path / "pages.tif", save_all=True, append_images=pages[1:])
    assert _file(tmp_path / "pages.tif")[1] == 3
    assert (_decode(tmp_path / "pages.tif") == green).all()
    # 16-bit grayscale TIFF (little- and big-endian) keeps its ramp; a float TIFF in [0, 1] too.
    ramp = np.tile(np.linspace(0, 65535, 64).astype(np.uint16), (64, 1))
    Image.fromarray(ramp).save(tmp_path / "deep.tif")
    Image.frombytes("I;16B", (64, 64), ramp.astype(">u2").tobytes()).save(tmp_path / "deep_be.tif")
    Image.fromarray((ramp / 65535.0).astype(np.float32)).save(tmp_path / "float.tif")
    for name in ("deep.tif", "deep_be.tif", "float.tif"):
        mode = _file(tmp_path / name)[0]
        assert mode.startswith("I;16") or mode == "F", (name, mode)
        row = _signed(_decode(tmp_path / name, (64, 64)))[32, :, 0]
        assert row[0] < -0.9 and row[-1] > 0.9 and (np.diff(row) >= -1e-6).all(), name
    # CMYK and RGBA TIFFs.
    Image.new("CMYK", (RES, RES), (0, 255, 255, 0)).save(tmp_path / "cmyk.tif")
    assert np.abs(_decode(tmp_path / "cmyk.tif").astype(int) - red).max() <= 3
    Image.new("RGBA", (RES, RES), (0, 0, 0, 0)).save(tmp_path / "clear.tif")
    assert (_decode(tmp_path / "clear.tif") == 255).all()
    # 16 bits per channel RGB (48-bit, as scanners and raw converters write it; Pillow cannot write it).
    tifffile = pytest.importorskip("tifffile")  # ships with scikit-image
    deep_rgb = np.zeros((RES, RES, 3), dtype=np.uint16)
    deep_rgb[..., 0], deep_rgb[..., 2] = 65535, 32896  # full red, half blue
    tifffile.imwrite(tmp_path / "rgb48.tif", deep_rgb)
    assert np.abs(_decode(tmp_path / "rgb48.tif").astype(int) - [255, 0, 128]).max() <= 1


@pytest.mark.parametrize("fmt", ["jpg", "png", "webp", "gif"])
def test_decoding_bytes_gives_the_pixels_decoding_the_file_gives(tmp_path: Path, fmt: str) -> None:
    """The cache decodes the very bytes it hashed (io.BytesIO), so a file replaced meanwhile cannot put other pixels
    under its key; the result is identical to decoding the file, including the JPEG decoder's reduced-size draft."""
    rng = np.random.default_rng(1)
    coarse = Image.fromarray(rng.integers(0, 256, (6, 8, 3), dtype=np.uint8))
    coarse.resize((400, 300), Image.Resampling.BICUBIC).save(tmp_path / f"photo.{fmt}")
    path = tmp_path / f"photo.{fmt}"
    p = cover(*probe(path), (RES, RES))  # 400x300 -> 32 px: the JPEG decoder reduces by 1/8 first
    from_file = decode(path, p.source_box(), p.bucket)
    from_bytes = decode(path.read_bytes(), p.source_box(), p.bucket)
    assert from_bytes.dtype == np.uint8 and np.array_equal(from_bytes, from_file)
    assert probe(path.read_bytes()) == probe(path) == (400, 300)
    with pytest.raises(BadImage, match="0 bytes"):
        decode(b"", p.source_box(), p.bucket)


def test_a_mask_is_averaged_down_to_the_latent_grid_exactly_zero_where_all_black(tmp_path: Path) -> None:
    """A 64x48 mask, white from column 20 on, at a 8x6 grid (8 pixels a cell): the cells wholly left of it are exactly
    0, those wholly right exactly 1, the one it cuts the white share of its pixels (4 of 8 columns). A mask of twice
    the size with the box scaled gives the same grid; a 16-bit mask is read at full depth; a box inside the image
    (a crop) averages only that part."""
    mask = np.zeros((48, 64), np.uint8)
    mask[:, 20:] = 255
    Image.fromarray(mask).save(tmp_path / "mask.png")
    grid = decode_mask(tmp_path / "mask.png", (0, 0, 64, 48), (8, 6))
    assert grid.shape == (6, 8) and grid.dtype == np.float32
    assert np.all(grid[:, :2] == 0.0) and np.allclose(grid[:, 3:], 1.0) and np.allclose(grid[:, 2], 0.5)
    Image.fromarray(np.kron(mask, np.ones((2, 2), np.uint8))).save(tmp_path / "big.png")
    assert np.allclose(decode_mask(tmp_path / "big.png", (0, 0, 128, 96), (8, 6)), grid)
    Image.fromarray(mask.astype(np.uint16) * 257).save(tmp_path / "deep.png")  # 16-bit gray
    assert _file(tmp_path / "deep.png")[0].startswith("I")
    assert np.allclose(decode_mask(tmp_path / "deep.png", (0, 0, 64, 48), (8, 6)), grid)
    crop = decode_mask(tmp_path / "mask.png", (16, 0, 48, 48), (4, 6))  # columns 16..48: a half cell black
    assert np.allclose(crop[:, 0], 0.5) and np.allclose(crop[:, 1:], 1.0)


def test_an_alpha_mask_and_an_exif_rotated_mask_are_read_as_viewed(tmp_path: Path) -> None:
    rgba = np.full((48, 64, 4), 200, np.uint8)
    rgba[..., 3] = 255
    rgba[:, :32, 3] = 0  # transparent left half
    Image.fromarray(rgba, "RGBA").save(tmp_path / "cutout.png")
    assert has_alpha(tmp_path / "cutout.png") and not has_alpha(_rgb(tmp_path))
    alpha = decode_mask(tmp_path / "cutout.png", (0, 0, 64, 48), (8, 6), alpha=True)
    assert np.all(alpha[:, :4] == 0.0) and np.allclose(alpha[:, 4:], 1.0)
    with pytest.raises(BadImage, match="has no transparency"):
        decode_mask(_rgb(tmp_path), (0, 0, 64, 48), (8, 6), alpha=True)
    stored = np.zeros((64, 48), np.uint8)  # stored portrait, viewed landscape (EXIF 6: rotate 90 clockwise)
    stored[:32, :] = 255  # the top half stored is the right half viewed
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.fromarray(stored).save(tmp_path / "rotated.png", exif=exif)
    viewed = decode_mask(tmp_path / "rotated.png", (0, 0, 64, 48), (8, 6))
    assert np.all(viewed[:, :4] == 0.0) and np.allclose(viewed[:, 4:], 1.0)


def _rgb(folder: Path) -> Path:
    Image.new("RGB", (64, 48), "white").save(folder / "plain.png")
    return folder / "plain.png"
