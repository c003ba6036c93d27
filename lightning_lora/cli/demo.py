"""Prepare the CPU demo: a tiny random pipeline of every model family and a folder of real captioned photos.

``python -m lightning_lora.cli.demo [--out .demo]`` writes::

    .demo/tiny-<family>/  for each registered family (``tiny-flux``, ``tiny-sdxl``, ...): a complete diffusers
                          pipeline folder with random weights (1-6 MB, :meth:`DiffusionFamily.save_tiny
                          <lightning_lora.families.base.DiffusionFamily.save_tiny>`), loaded back by the trainer
                          through the real ``from_pretrained`` path
    .demo/photos/         photos that ship inside scikit-image (no download) as PNG, each with a .txt caption
    .demo/edits/          edit pairs for the edit families: each photo's negative (inverted colours) as the target,
                          captioned with the edit instruction (:data:`EDIT`); the control is the photo of the same
                          name in photos/ (``data.images: [{path: .demo/edits, controls: [.demo/photos]}]``)
    .demo/masks/          a mask per photo (an ellipse in the middle: white trains), for ``masks: .demo/masks``
    .demo/regularization/ two more photos captioned without the trigger: class images for ``model.preservation``

``configs/tiny_cpu.yaml`` (FLUX, what ``make demo`` trains) and the other ``configs/tiny_*_cpu.yaml`` train on exactly
these photos; the masks and class images are there to try preservation and masks on (``--data.images '[{path:
.demo/photos, masks: .demo/masks}, {path: .demo/regularization, role: regularization}]' --model.preservation.mode
dop``). Existing files are left as they are (the step is idempotent).
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from lightning_lora.families import DiffusionFamily

__all__ = ["EDIT", "PHOTOS", "prepare", "tiny_models", "write_edits"]

DEMO_FAMILY = "flux"
"""The family ``make demo`` trains (``configs/tiny_cpu.yaml``): its folder is the one the demo names first."""


DEMO_DIR = Path(".demo")
"""Where the demo writes its models and photos (``--out``; the Makefile's ``DEMO_DIR``): configs/tiny_cpu.yaml reads
them there."""


def tiny_models() -> dict[str, type[DiffusionFamily]]:
    """Folder name under the demo folder -> the family whose tiny pipeline it holds: every registered family."""
    from lightning_lora.families import FAMILIES

    return {f"tiny-{name}": cls for name, cls in FAMILIES.items()}


# scikit-image sample name -> caption. "sks" is the usual rare trigger token of DreamBooth-style LoRAs.
PHOTOS: dict[str, str] = {
    "astronaut": "a photo of sks astronaut in a white space suit with a flag",
    "chelsea": "a photo of sks cat, a tabby cat looking to the side",
    "coffee": "a photo of sks coffee cup on a saucer, top view",
    "rocket": "a photo of sks rocket on the launch pad under a blue sky",
    "hubble_deep_field": "a photo of sks galaxies in deep space",
    "colorwheel": "a sks color wheel with all the hues of the rainbow",
    "camera": "a black and white photo of sks man with a camera on a tripod",
    "coins": "a black and white photo of sks coins on a table",
}


EDIT = "turn the photo into its sks negative"
"""The edit instruction of the demo's edit pairs (:func:`write_edits`)."""


REGULARIZATION: dict[str, str] = {
    "moon": "a black and white photo of the moon",
    "clock": "a black and white photo of a wall clock",
}
"""Class images (scikit-image sample name -> caption, without the trigger) for ``.demo/regularization``."""


def _mask(height: int, width: int) -> np.ndarray:
    """A demo mask: white inside the ellipse that fills the middle 80% of the image, black outside."""
    y, x = np.ogrid[:height, :width]
    inside = ((x - width / 2) / (0.4 * width)) ** 2 + ((y - height / 2) / (0.4 * height)) ** 2 <= 1
    return np.where(inside, 255, 0).astype(np.uint8)


def _photo(name: str) -> np.ndarray:
    try:
        from skimage import data
    except ImportError as e:  # pragma: no cover - the demo extra is part of `make demo`
        raise SystemExit("the demo needs scikit-image: pip install 'lightning-lora[demo]'") from e
    return np.asarray(getattr(data, name)())


def prepare(out: Path) -> tuple[Path, Path]:
    """Write the tiny pipelines (:func:`tiny_models`) and the photos under ``out``; return the demo family's tiny
    pipeline (tiny-flux/) and photos/."""
    from PIL import Image

    from lightning_lora.io import atomic_write, atomic_write_bytes

    models = {name: family.save_tiny(out / name, seed=0) for name, family in tiny_models().items()}
    model = models[f"tiny-{DEMO_FAMILY}"]
    photos, masks = out / "photos", out / "masks"

    def write(path: Path, pixels: Any) -> None:
        if not path.exists():
            image = Image.fromarray(pixels() if callable(pixels) else pixels)
            atomic_write(path, functools.partial(image.save, format="PNG"))

    for folder, captions in ((photos, PHOTOS), (out / "regularization", REGULARIZATION)):
        folder.mkdir(parents=True, exist_ok=True)
        for name, caption in captions.items():
            write(folder / f"{name}.png", functools.partial(_photo, name))
            caption_path = folder / f"{name}.txt"
            if not caption_path.exists():
                atomic_write_bytes(caption_path, (caption + "\n").encode())
    masks.mkdir(parents=True, exist_ok=True)
    for name in PHOTOS:
        write(masks / f"{name}.png", lambda name=name: _mask(*_photo(name).shape[:2]))
    write_edits(photos, out / "edits")
    return model, photos


def write_edits(photos: Path, out: Path, names: list[str] | None = None) -> Path:
    """Edit pairs for the edit families in ``out``: the negative (inverted colours) of each photo of ``photos``
    (``names``: some of them; default all) as the target, captioned :data:`EDIT`; the control is the photo itself,
    matched by its name (``controls: [<photos>]``). Existing files are left as they are."""
    from PIL import Image, ImageOps

    from lightning_lora.io import atomic_write, atomic_write_bytes

    out.mkdir(parents=True, exist_ok=True)
    for photo in sorted(photos.glob("*.png")):
        if names is not None and photo.stem not in names:
            continue
        target = out / photo.name
        if not target.exists():
            negative = ImageOps.invert(Image.open(photo).convert("RGB"))
            atomic_write(target, functools.partial(negative.save, format="PNG"))
        caption = out / f"{photo.stem}.txt"
        if not caption.exists():
            atomic_write_bytes(caption, (EDIT + "\n").encode())
    return out


def _quiet() -> None:
    """The demo prints its two lines: the libraries' notes (no torchvision here) and their save progress bars are not
    for the user (set before transformers / diffusers are imported, so their import-time notes are quiet too)."""
    import os

    from lightning_lora.cli.console import quiet_library_loggers

    quiet_library_loggers()  # bitsandbytes' CPU kernel note (AVX-512 BF16 CPUs), the ``kernels`` package's notes
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    diffusers_logging.disable_progress_bar()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEMO_DIR, help="folder for the model and photos")
    args = parser.parse_args()
    _quiet()
    model, photos = prepare(args.out)
    others = ", ".join(str(args.out / name) for name in tiny_models() if name != model.name)
    extras = f"; masks in {args.out / 'masks'}, class images in {args.out / 'regularization'}"
    print(f"demo model:  {model} (also {others})\ndemo photos: {photos} ({len(PHOTOS)} images with captions{extras})")


if __name__ == "__main__":
    main()
