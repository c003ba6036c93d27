"""The images a user brings: folders, per-folder options, captions, and what is left out (with the reason).

:func:`scan` lists each folder (not recursively; hidden files such as macOS ``._photo.jpg`` are ignored), finds each
image's caption (:mod:`lightning_lora.data.captions`) and returns the usable :class:`Item` s plus a :class:`Skip`
(file + one-line reason) for every image it cannot use. It reads caption files only, never image pixels, so it is
cheap enough to run when the configuration is parsed.

Fatal, because they are configuration mistakes rather than bad files: a folder that does not exist, and data in
which no folder holds any image. A folder without images among others is a skip.

:func:`split_validation` holds out a deterministic fraction of the images: those whose folder/file name hashes to a
number below the fraction. The choice is made per image from its name only, so editing or adding images never moves
an image between the splits (the count is about the fraction; at least one image is held out).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from lightning_lora.data.captions import METADATA_FILES, TRIGGER, CaptionError, read_caption_file, read_metadata
from lightning_lora.errors import ConfigError

__all__ = ["IMAGE_EXTENSIONS", "ImageFolder", "Item", "Skip", "list_images", "scan", "split_validation"]

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp")


@dataclass
class ImageFolder:
    """A folder of images with its own options.

    Args:
        path: the folder (images directly inside it; subfolders are not searched).
        repeats: how often each image is used per epoch (e.g. 10 images with ``repeats: 5`` weigh like 50 against
            another folder), to balance concepts.
        default_caption: the caption of this folder's images that have none (overrides ``data.default_caption``).
        trigger: this folder's trigger word (overrides ``data.trigger``).
    """

    path: str
    repeats: int = 1
    default_caption: str | None = None
    trigger: str | None = None


@dataclass(frozen=True)
class Item:
    """One usable image: its file, its caption as written (may be empty), and the trigger word to apply."""

    image: Path
    caption: str
    trigger: str | None = None
    repeats: int = 1


@dataclass(frozen=True)
class Skip:
    """A file (or folder) that is left out: a short ``kind`` for counting and a one-line ``reason``."""

    path: Path
    kind: str
    reason: str

    def line(self) -> str:
        return f"{self.path}: {self.reason}"


def as_folders(images: str | ImageFolder | Sequence[str | ImageFolder], option: str) -> list[ImageFolder]:
    """Normalise the ``images`` option (a path, a folder, or a list of either) to folders; validate repeats."""
    entries = [images] if isinstance(images, str | ImageFolder) else list(images)
    folders = [ImageFolder(path=e) if isinstance(e, str) else e for e in entries]
    for f in folders:
        if f.repeats < 1:
            raise ConfigError(f"{option}: repeats of {f.path!r} is {f.repeats}; use 1 or more.")
    return folders


def list_images(folder: Path) -> list[Path]:
    """The image files directly in ``folder`` (by extension, any case), sorted; hidden files are ignored."""
    return sorted(
        p
        for p in folder.iterdir()
        if p.suffix.lower() in IMAGE_EXTENSIONS and not p.name.startswith(".") and p.is_file()
    )


def scan(
    folders: Sequence[ImageFolder],
    *,
    caption_ext: str = ".txt",
    default_caption: str | None = None,
    trigger: str | None = None,
    option: str = "data.images",
) -> tuple[list[Item], list[Skip]]:
    """Usable images with their captions, and the skipped ones with reasons. See the module docstring."""
    items: list[Item] = []
    skips: list[Skip] = []
    found_any = False
    for folder in folders:
        root = Path(folder.path).expanduser()
        if not root.is_dir():
            raise ConfigError(f"{option}: folder {folder.path!r} does not exist. Check the path.")
        images = list_images(root)
        if not images:
            skips.append(Skip(root, "empty folder", f"holds no images ({', '.join(IMAGE_EXTENSIONS)})"))
            continue
        found_any = True
        metadata, problems = read_metadata(root)
        skips.extend(Skip(root, "metadata", p) for p in problems)
        default = folder.default_caption if folder.default_caption is not None else default_caption
        word = folder.trigger if folder.trigger is not None else trigger
        for image in images:
            caption_file = image.with_suffix(caption_ext)
            try:
                if caption_file.is_file():
                    caption: str | None = read_caption_file(caption_file)
                    origin = f"caption file {caption_file.name} is empty"
                else:
                    caption = metadata.get(image.name)
                    origin = f"no caption file {caption_file.name}" + (
                        " and no metadata entry" if any((root / m).is_file() for m in METADATA_FILES) else ""
                    )
            except CaptionError as e:
                skips.append(Skip(image, "caption", str(e)))
                continue
            if not caption:
                if default is not None:
                    caption = default
                elif word:
                    caption = ""  # the trigger word alone
                else:
                    fix = "write a caption, or set data.default_caption or data.trigger"
                    skips.append(Skip(image, "caption", f"{origin}; {fix}"))
                    continue
            if TRIGGER in caption and not word:
                skips.append(Skip(image, "caption", f"caption uses {TRIGGER} but data.trigger is not set"))
                continue
            items.append(Item(image, caption, word, folder.repeats))
    if not found_any:
        names = ", ".join(repr(f.path) for f in folders)
        raise ConfigError(
            f"{option}: folder {names} holds no images ({', '.join(IMAGE_EXTENSIONS)}). Put your training images "
            f"there, or point {option} at the right folder."
        )
    return items, skips


def _name_hash(item: Item) -> float:
    """A number in [0, 1) from the folder and file name."""
    digest = hashlib.sha256(f"{item.image.parent.name}/{item.image.name}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def split_validation(items: list[Item], fraction: float) -> tuple[list[Item], list[Item]]:
    """``(train, validation)``: the images whose name hash is below ``fraction`` (at least one, never all)."""
    if fraction <= 0 or len(items) < 2:
        return items, []
    hashes = [_name_hash(it) for it in items]
    held = {i for i, h in enumerate(hashes) if h < fraction}
    if not held:
        held = {min(range(len(items)), key=hashes.__getitem__)}
    if len(held) == len(items):
        held.discard(max(range(len(items)), key=hashes.__getitem__))
    return [it for i, it in enumerate(items) if i not in held], [it for i, it in enumerate(items) if i in held]
