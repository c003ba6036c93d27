"""Decode a user's image file into the exact pixels of one bucket, whatever the folder holds.

**Which files are images.** Every format this installation of Pillow opens (:func:`readable_extensions`: JPEG, PNG,
WebP, GIF, TIFF, BMP, AVIF, JPEG 2000, TGA, ... and HEIC or JPEG XL when the ``pillow-heif`` / ``pillow-jxl-plugin``
package is installed; they are registered here). Left out: formats whose pixels need an external program (EPS and
PostScript need Ghostscript), files Pillow only identifies (MPEG video, scientific data stubs) or only writes (PDF).
A file with a known image extension that cannot be read here (HEIC without its plugin, camera RAW, SVG, JPEG XL,
AVIF on an old Pillow, ...) gets :data:`UNREADABLE`'s one-line reason: what it is and how to make it usable. An
animation (GIF, APNG, WebP) or a multi-page TIFF is used for its first frame.

:func:`probe` reads only the header: the size *as viewed* (after the EXIF orientation), so a portrait photo that a
phone stored as landscape pixels plus a "rotate 90" tag gets a portrait bucket. :func:`decode` cuts a box of that
viewed image and resamples it to the bucket size in one Lanczos resize (``Image.resize(size, box=...)``), so the
resized-then-cropped intermediate is never built.

What real folders hold, and what happens to it:

* **EXIF rotation** (all eight orientations): honoured, before the bucket is chosen; the box is resampled in the
  stored orientation and only the bucket-sized result is turned upright.
* **Transparency** (RGBA, LA, a palette with a transparent colour): resampled with premultiplied alpha (Pillow does it
  for RGBA/LA), then composited on a stated background colour (``data.alpha_background``), never on black by accident.
* **Grayscale, palette, CMYK, 1-bit**: converted to RGB. **16-bit and 32-bit integer** grayscale is resized at full
  depth and scaled to 8 bits by its full scale (a naive ``convert("RGB")`` clips everything above 255 to white);
  float grayscale (TIFF) by 1.0 or 255. 16 bits per channel RGB (scanner and raw-converter TIFFs) Pillow reads as
  8-bit RGB.
* **Very large files**: a 12000x8000 photo is 288 MB decoded. JPEGs are decoded at a reduced size by the decoder
  itself (``draft``: DCT scaling by 1/2, 1/4 or 1/8), never smaller than the bucket needs; other formats decode
  once at full size and are reduced directly to the bucket. Pillow's decompression-bomb limit (about 179 MP) still
  applies and is reported as a reason.
* **Not an image, empty, truncated**: :class:`BadImage` with a one-line reason for the summary. Truncated files are
  never "repaired" (``LOAD_TRUNCATED_IMAGES`` stays off): a half-gray photo would be trained on silently.

**Masks** (:func:`decode_mask`): a mask image (or an image's own alpha channel, :func:`has_alpha`) is read as viewed
(EXIF orientation applied), as gray levels in [0, 1] (16-bit masks at full depth), and the same box of it as of its
image is averaged down to the latent grid in one area (``BOX``) resize: a latent cell's weight is the share of its
pixels that are white, exactly 0 where all of them are black. A mask of another size than its image covers the same
image (its box is scaled).

Pure Pillow and numpy (no torch), so it runs cheaply in DataLoader worker processes. The output is ``uint8 [h, w, 3]``
(one byte per value through the worker queue; the conversion to floats happens on the encoding device). :func:`probe`
and :func:`decode` take a path or the file's bytes: the cache decodes the very bytes whose hash made the key.
"""

from __future__ import annotations

import functools
import io
import warnings
from pathlib import Path

import numpy as np
from PIL import Image, ImageColor, ImageFile, UnidentifiedImageError, features

__all__ = [
    "BadImage",
    "DECODE_RULE",
    "MASK_RULE",
    "UNREADABLE",
    "decode",
    "decode_mask",
    "has_alpha",
    "parse_color",
    "probe",
    "readable_extensions",
    "unreadable_reason",
]

DECODE_RULE = "exif+box-lanczos-rg3+jpeg-draft+premultiplied-alpha-v2"
"""Names the decoding rule; part of every latent cache key, so a change here re-encodes."""

MASK_RULE = "exif+box-area-f32-v1"
"""Names the mask rule (:func:`decode_mask`); part of every mask's cache key."""

_ROTATED = {5, 6, 7, 8}  # EXIF orientations that swap width and height
_RESAMPLE = Image.Resampling.LANCZOS
_REDUCING_GAP = 3.0  # Pillow: box-reduce by an integer factor first; "indistinguishable from fair resampling" at 3


_NO_PIXELS = {"EPS", "MPEG", "PDF", "IPTC"}
"""Formats Pillow registers without giving pixels itself: EPS/PostScript are rendered by Ghostscript (an external
program), MPEG is only identified (a video), PDF only written; IPTC files are news metadata records."""

_NEEDS = {"AVIF": "avif", "WEBP": "webp", "JPEG2000": "jpg_2000"}
"""Formats Pillow always registers but reads only when built with the library (``PIL.features`` names)."""

_PLUGINS = (("pillow_heif", "register_heif_opener"), ("pillow_jxl", None), ("pillow_avif", None))
"""Pillow plugins used when installed: module, and the function that registers it (None: importing registers)."""

_CONVERT = "convert it to JPEG or PNG"
_RAW = "a camera RAW file (sensor data, not a finished picture); develop it to JPEG, PNG or TIFF in your photo software"
_RAW_EXTENSIONS = (
    ".cr2 .cr3 .crw .nef .nrw .arw .srf .sr2 .dng .raf .orf .rw2 .pef .srw .x3f .3fr .erf .kdc .mrw .rwl .iiq .raw"
).split()
_VECTOR = "(vector graphics, no pixels); export it as PNG at about the training resolution"
UNREADABLE: dict[str, str] = {
    **dict.fromkeys(
        (".heic", ".heif", ".hif"),
        f"a HEIC/HEIF photo (the iPhone's format), which Pillow reads only with a plugin; {_CONVERT}, or "
        "`pip install pillow-heif` (used when installed)",
    ),
    **dict.fromkeys(
        (".avif", ".avifs"),
        f"an AVIF image, which this installation of Pillow cannot read; {_CONVERT}, or install Pillow 11.2 or newer "
        "(pip wheels read AVIF) or `pip install pillow-avif-plugin`",
    ),
    ".jxl": f"a JPEG XL image, which Pillow reads only with a plugin; {_CONVERT}, or `pip install pillow-jxl-plugin` "
    "(used when installed)",
    ".webp": f"a WebP image, which this installation of Pillow cannot read (built without libwebp); {_CONVERT}, or "
    "install Pillow from a pip wheel (they read WebP)",
    **dict.fromkeys(
        (".jp2", ".j2k", ".jpx", ".jpf", ".jpc", ".j2c"),
        f"a JPEG 2000 image, which this installation of Pillow cannot read (built without OpenJPEG); {_CONVERT}, or "
        "install Pillow from a pip wheel",
    ),
    **dict.fromkeys(_RAW_EXTENSIONS, _RAW),
    **dict.fromkeys((".svg", ".svgz"), f"an SVG drawing {_VECTOR}"),
    **dict.fromkeys((".eps", ".ps", ".ai"), f"a PostScript/EPS/Illustrator drawing {_VECTOR}"),
    **dict.fromkeys((".wmf", ".emf"), f"a Windows metafile {_VECTOR}"),
    ".psb": "a large Photoshop document (PSB), which Pillow cannot read; save a flattened PNG or TIFF",
    ".xcf": "a GIMP document, which Pillow cannot read; export it as PNG",
    **dict.fromkeys(
        (".exr", ".hdr"),
        "a high-dynamic-range image (OpenEXR/Radiance), which Pillow cannot read; tone-map it and save it as PNG or "
        "TIFF",
    ),
}
"""Known image extensions and why a file of that kind cannot be used here (used when Pillow cannot read it)."""


def _register_plugins() -> None:
    import importlib

    for module, register in _PLUGINS:
        try:
            plugin = importlib.import_module(module)
        except (ImportError, OSError):  # not installed, or its native library is missing
            continue
        if register is not None:
            getattr(plugin, register)()


def _readable_formats() -> dict[str, str]:
    """Extension (lower case, with the dot) -> Pillow format, for every format this installation reads pixels of."""
    _register_plugins()
    Image.init()
    readable: dict[str, str] = {}
    for extension, fmt in Image.registered_extensions().items():
        factory = Image.OPEN.get(fmt, (None,))[0]
        if factory is None or fmt in _NO_PIXELS:
            continue
        if isinstance(factory, type) and issubclass(factory, ImageFile.StubImageFile):
            continue  # a stub needs a handler registered by another library (BUFR, GRIB, HDF5, WMF off Windows)
        feature = _NEEDS.get(fmt)
        if feature is not None and (feature in features.modules or feature in features.codecs):
            if not features.check(feature):
                continue
        readable[extension.lower()] = fmt
    return readable


@functools.cache
def readable_extensions() -> frozenset[str]:
    """The extensions (``".jpg"``, lower case) of the formats this installation of Pillow reads; see the module
    docstring. Computed once per process (it also registers the installed Pillow plugins)."""
    return frozenset(_readable_formats())


def unreadable_reason(extension: str) -> str | None:
    """Why a file with this extension cannot be used here (a known image format Pillow cannot read), or ``None``
    when it is readable or not an image extension at all (``.txt``, ``.mp4``)."""
    extension = extension.lower()
    return None if extension in readable_extensions() else UNREADABLE.get(extension)


class BadImage(Exception):
    """An image file that cannot be used; ``kind`` is a short category, ``reason`` a one-line explanation."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind
        self.reason = reason


def parse_color(value: str, option: str = "data.alpha_background") -> tuple[int, int, int]:
    """``"white"``, ``"#808080"``, ``"rgb(0,0,0)"`` -> an RGB triple; a :class:`ValueError` names ``option``."""
    try:
        rgb = ImageColor.getrgb(value)
    except ValueError as e:
        raise ValueError(f"{option}: {value!r} is not a colour; use a name (white, black) or #rrggbb") from e
    return int(rgb[0]), int(rgb[1]), int(rgb[2])


def _open(source: str | Path | bytes) -> Image.Image:
    readable_extensions()  # the installed plugins registered (in a spawned worker process too)
    if isinstance(source, bytes):
        size = len(source)
    else:
        try:
            size = Path(source).stat().st_size
        except OSError as e:
            raise BadImage("unreadable file", f"cannot read the file ({e.strerror or e})") from e
    if size == 0:
        raise BadImage("empty file", "empty file (0 bytes)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            return Image.open(io.BytesIO(source) if isinstance(source, bytes) else Path(source))
    except UnidentifiedImageError as e:
        raise BadImage("not an image", "not an image file (no known image format in its bytes)") from e
    except Image.DecompressionBombError as e:
        raise BadImage("too large", f"too large for Pillow's safety limit ({e})") from e
    except (OSError, ValueError, SyntaxError) as e:
        raise BadImage("cannot decode", f"cannot read the image header ({e})") from e


def _orientation(im: Image.Image) -> int:
    try:
        return int(im.getexif().get(0x0112, 1))
    except Exception:  # a broken EXIF block is not a reason to drop the photo
        return 1


def probe(source: str | Path | bytes) -> tuple[int, int]:
    """The ``(width, height)`` of the image (a path, or the file's bytes) as viewed (EXIF orientation applied), from
    the header only."""
    with _open(source) as im:
        width, height = im.size
        if _orientation(im) in _ROTATED:
            width, height = height, width
    if width < 1 or height < 1:
        raise BadImage("cannot decode", f"the header says {width}x{height} pixels")
    return width, height


def _resamplable(im: Image.Image) -> Image.Image:
    """A mode Pillow resizes correctly: RGB, RGBA, L, LA, or I;16 / I / F kept at full depth."""
    if im.mode in ("RGB", "RGBA", "L", "LA") or im.mode.startswith("I") or im.mode == "F":
        return im
    if im.mode in ("P", "PA"):
        return im.convert("RGBA" if im.mode == "PA" or "transparency" in im.info else "RGB")
    if im.mode == "1":
        return im.convert("L")
    if im.mode in ("RGBa", "La"):
        return im.convert("RGBA" if im.mode == "RGBa" else "LA")
    return im.convert("RGB")  # CMYK, YCbCr, LAB, HSV


def _to_rgb(im: Image.Image, background: tuple[int, int, int]) -> Image.Image:
    """An 8-bit RGB image: deep grayscale scaled, alpha composited on ``background``."""
    if im.mode.startswith("I") or im.mode == "F":
        arr = np.asarray(im, dtype=np.float64)
        if im.mode.startswith("I;16"):
            full_scale = 65535.0
        elif im.mode == "F":
            full_scale = 1.0 if arr.max(initial=0.0) <= 1.0 else 255.0
        else:  # 32-bit integer: 16-bit data stored as I (most PNG/TIFF), else its own maximum
            full_scale = 65535.0 if arr.max(initial=0.0) <= 65535 else float(arr.max())
        im = Image.fromarray(np.clip(arr / full_scale * 255.0, 0, 255).round().astype(np.uint8))
    if im.mode in ("RGBA", "LA"):
        rgba = im.convert("RGBA")
        flat = Image.new("RGBA", rgba.size, (*background, 255))
        return Image.alpha_composite(flat, rgba).convert("RGB")
    return im.convert("RGB")


# EXIF orientation -> the Pillow transpose that makes the stored pixels upright (as ImageOps.exif_transpose does), and
# where a point (u, v) of the upright image, in [0, 1] coordinates, lies in the stored image.
_T = Image.Transpose
_UPRIGHT = {
    2: (_T.FLIP_LEFT_RIGHT, lambda u, v: (1 - u, v)),
    3: (_T.ROTATE_180, lambda u, v: (1 - u, 1 - v)),
    4: (_T.FLIP_TOP_BOTTOM, lambda u, v: (u, 1 - v)),
    5: (_T.TRANSPOSE, lambda u, v: (v, u)),
    6: (_T.ROTATE_270, lambda u, v: (v, 1 - u)),
    7: (_T.TRANSVERSE, lambda u, v: (1 - v, 1 - u)),
    8: (_T.ROTATE_90, lambda u, v: (1 - v, u)),
}


def _load(im: Image.Image) -> None:
    """Decode the pixels of ``im`` (opened by :func:`_open`); :class:`BadImage` with the reason when they cannot be."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            im.load()
    except Image.DecompressionBombError as e:
        raise BadImage("too large", f"too large for Pillow's safety limit ({e})") from e
    except (OSError, ValueError, SyntaxError, EOFError) as e:
        raise BadImage("cannot decode", f"cannot decode the pixels ({e})") from e
    except MemoryError as e:
        raise BadImage("too large", "not enough memory to decode it") from e


def decode(
    source: str | Path | bytes,
    box: tuple[float, float, float, float],
    size: tuple[int, int],
    background: tuple[int, int, int] = (255, 255, 255),
) -> np.ndarray:
    """Pixels ``uint8 [size[1], size[0], 3]`` of the image (a path, or the file's bytes): the ``box`` (left, top,
    right, bottom, in viewed-image pixels of the size :func:`probe` returns) resampled to ``size`` (width, height).
    The first frame of an animation or multi-page file. Raises :class:`BadImage`.

    The box is resampled in the stored orientation and only the small result is rotated, so a full-size copy of the
    image is never made (``ImageOps.exif_transpose`` would make one, even for an upright image)."""
    out_w, out_h = size
    im = _open(source)
    try:
        stored_w, stored_h = im.size
        transpose, to_stored = _UPRIGHT.get(_orientation(im), (None, None))
        swapped = transpose in (_T.TRANSPOSE, _T.TRANSVERSE, _T.ROTATE_90, _T.ROTATE_270)
        viewed_w, viewed_h = (stored_h, stored_w) if swapped else (stored_w, stored_h)
        # The box in [0, 1] coordinates of the stored image, and the output size in the stored orientation.
        u0, v0, u1, v1 = box[0] / viewed_w, box[1] / viewed_h, box[2] / viewed_w, box[3] / viewed_h
        if to_stored is not None:
            (a0, b0), (a1, b1) = to_stored(u0, v0), to_stored(u1, v1)
            u0, u1, v0, v1 = min(a0, a1), max(a0, a1), min(b0, b1), max(b0, b1)
        stored_out = (out_h, out_w) if swapped else (out_w, out_h)
        # The whole image at the scale the box needs; the JPEG decoder can produce (at least) that directly.
        need = (
            max(1, int(stored_out[0] / max(u1 - u0, 1e-9) + 1)),
            max(1, int(stored_out[1] / max(v1 - v0, 1e-9) + 1)),
        )
        if im.format == "JPEG" and need[0] < stored_w and need[1] < stored_h:
            im.draft(None, need)
        _load(im)
        pixels = _resamplable(im)
        w, h = pixels.size  # smaller than stored when the JPEG decoder reduced it
        source_box = (u0 * w, v0 * h, u1 * w, v1 * h)
        if pixels.size == stored_out and source_box == (0.0, 0.0, float(w), float(h)):
            resized = pixels
        else:
            resized = pixels.resize(stored_out, _RESAMPLE, box=source_box, reducing_gap=_REDUCING_GAP)
        del pixels
        if transpose is not None:
            resized = resized.transpose(transpose)
        arr = np.asarray(_to_rgb(resized, background), dtype=np.uint8)
    finally:
        im.close()
    if arr.shape != (out_h, out_w, 3):
        raise BadImage("cannot decode", f"decoded to an unexpected shape {arr.shape}")
    return arr


def _mask_band(im: Image.Image, alpha: bool) -> tuple[Image.Image, float] | None:
    """The band of ``im`` that is the mask, as a float image, and its full scale: its alpha channel (None when it has
    none), or its gray levels (16- and 32-bit integer masks at full depth)."""
    if alpha:
        if im.mode in ("P", "PA") and (im.mode == "PA" or "transparency" in im.info):
            im = im.convert("RGBA")
        elif im.mode in ("RGBa", "La"):
            im = im.convert("RGBA" if im.mode == "RGBa" else "LA")
        if im.mode not in ("RGBA", "LA"):
            return None
        return im.getchannel("A").convert("F"), 255.0
    if im.mode.startswith("I"):
        band = im.convert("F")
        top = float(np.asarray(band).max(initial=0.0))
        return band, (65535.0 if top <= 65535 else top)
    if im.mode == "F":
        return im, 1.0 if float(np.asarray(im).max(initial=0.0)) <= 1.0 else 255.0
    return im.convert("L").convert("F"), 255.0


def has_alpha(source: str | Path | bytes) -> bool:
    """Whether the image has an alpha channel (or a transparent palette colour), from its header."""
    with _open(source) as im:
        return im.mode in ("RGBA", "LA", "PA", "RGBa", "La") or (im.mode == "P" and "transparency" in im.info)


def decode_mask(
    source: str | Path | bytes, box: tuple[float, float, float, float], size: tuple[int, int], alpha: bool = False
) -> np.ndarray:
    """A mask ``float32 [size[1], size[0]]`` in [0, 1]: the ``box`` (left, top, right, bottom, in viewed pixels of the
    mask image) of the mask's gray levels, or of the image's alpha channel with ``alpha``, averaged down to ``size``
    (width, height): see the module docstring. Raises :class:`BadImage` (also for ``alpha`` of an image without one)."""
    from PIL import ImageOps

    im = _open(source)
    try:
        _load(im)
        viewed = ImageOps.exif_transpose(im) if _orientation(im) != 1 else im
        band = _mask_band(viewed, alpha)
        if band is None:
            raise BadImage("no alpha", "has no transparency to take a mask from (masks: alpha)")
        pixels, scale = band
        resized = pixels.resize(size, Image.Resampling.BOX, box=box)
        arr = np.clip(np.asarray(resized, dtype=np.float32) / np.float32(scale), 0.0, 1.0)
    finally:
        im.close()
    if arr.shape != (size[1], size[0]):
        raise BadImage("cannot decode", f"the mask decoded to an unexpected shape {arr.shape}")
    return arr
