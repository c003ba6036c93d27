"""The images a user brings: folders, per-folder options, captions, and what is left out (with the reason).

:func:`scan` lists each folder (not recursively; hidden files such as macOS ``._photo.jpg`` are ignored), finds each
image's caption (:mod:`lightning_lora.data.captions`) and returns the usable :class:`Item` s plus a :class:`Skip`
(file + one-line reason) for every image it cannot use. It reads caption files only, never image pixels, so it is
cheap enough to run when the configuration is parsed.

An image is a file in any format this installation of Pillow reads (:data:`IMAGE_EXTENSIONS`, from
:func:`~lightning_lora.data.images.readable_extensions`: JPEG, PNG, WebP, GIF, TIFF, BMP, AVIF, ...). Listed as
skipped, with what to do: a known image format Pillow cannot read here (HEIC without ``pillow-heif``, camera RAW,
SVG, ...), a broken symbolic link and a symbolic link loop. Other files (captions, ``.json``, videos) are ignored
without a word; a symbolic link to an image is an image.

Some findings do not drop an image; they are *notes* (:data:`NOTE_KINDS`, :attr:`Skip.note`), listed in the cache
summary but never counted as skipped and never fatal under ``data.on_bad_file: error``: a caption read as Windows-1252,
a caption cut to :data:`~lightning_lora.data.captions.MAX_CAPTION_CHARS`, a metadata record that is unusable or names
no image of the folder, a caption file that holds no text (a binary file) where the default caption or the trigger word
stands in for it, and (from the cache build) captions longer than the text encoder reads.

Fatal, because they are configuration mistakes rather than bad files: a folder that does not exist, data in which
no folder holds any image, and a regularization folder without images. Another folder without images among others is
a skip.

**Masks** (a folder entry's ``masks``): a folder of mask images, one per image, with the image's file name (any image
format: ``photo.png`` masks ``photo.jpg``); white trains, black is left out (gray in between). A mask folder that does
not exist, holds no image or no mask named like an image is fatal; a mask that matches no image is a note (so is a
second mask with the same name: the first in file-name order is used). ``masks: alpha`` takes each image's own
transparency instead (opaque trains). An image without a mask trains everywhere, with a note that names it.
:attr:`Item.mask` names the file; the pixels are read when the cache is built (:mod:`lightning_lora.data.cache`).

:func:`split_validation` holds out a deterministic fraction of the images: those whose folder/file name hashes to a
number below the fraction. The choice is made per image from its name only, so editing or adding images never moves
an image between the splits (the count is about the fraction; at least one image is held out). The name's raw bytes
are hashed, so a name that is not UTF-8 (Latin-1 names from old cameras and Windows archives) works too.

**Names that are not UTF-8.** Python keeps such a byte as a "surrogate escape", which cannot be printed under a
UTF-8 locale; every path that goes into a message passes :func:`display`, which shows the byte as ``\\xNN``.
"""

from __future__ import annotations

import errno
import hashlib
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from lightning_lora.data.captions import (
    METADATA_FILES,
    TRIGGER,
    CaptionError,
    MetadataCaption,
    NotText,
    read_caption_file,
    read_metadata,
)
from lightning_lora.data.images import readable_extensions, unreadable_reason
from lightning_lora.errors import ConfigError
from lightning_lora.objectives import SampleRole

__all__ = [
    "ALPHA",
    "IMAGE_EXTENSIONS",
    "NOTE_KINDS",
    "FolderRole",
    "ImageFolder",
    "Item",
    "Skip",
    "display",
    "folder_entry",
    "list_images",
    "scan",
    "split_validation",
]

IMAGE_EXTENSIONS: tuple[str, ...] = tuple(sorted(readable_extensions()))
"""The extensions (lower case, with the dot) of the image files :func:`scan` uses: every format Pillow reads here."""

NOTE_KINDS = frozenset(
    {"metadata", "not UTF-8", "long caption", "over token limit", "not text", "unmatched mask", "mask", "no mask"}
)
"""Kinds of :class:`Skip` that are notes: reported, but the image (if any) is used."""

_COMMON = (".jpg", ".png", ".webp", ".gif", ".tif", ".bmp", ".avif")
FORMATS = ", ".join(e[1:] for e in _COMMON if e in IMAGE_EXTENSIONS) + " or another format Pillow reads"
"""The readable formats in words, for messages."""


def display(path: str | os.PathLike[str]) -> str:
    """``path`` (or any text) as printable text: a byte of a file name that is not UTF-8 (a surrogate escape) is shown
    as ``\\xNN``; valid names are unchanged."""
    text = os.fspath(path)
    try:
        raw = text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a lone surrogate that is no escaped byte (invalid UTF-16 from Windows)
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return raw.decode("utf-8", "backslashreplace")


FolderRole = Literal["train", "regularization"]
"""What a folder's images are for: ``train`` (learn them) or ``regularization`` (class images that keep the base
model's behaviour: ``model.preservation``)."""

ALPHA = "alpha"
"""``masks: alpha``: each image's own transparency is its mask."""


@dataclass
class ImageFolder:
    """A folder of images with its own options.

    Args:
        path: the folder (images directly inside it; subfolders are not searched).
        repeats: how often each image is used per epoch (e.g. 10 images with ``repeats: 5`` weigh like 50 against
            another folder), to balance concepts.
        default_caption: the caption of this folder's images that have none (overrides ``data.default_caption``).
        trigger: this folder's trigger word (overrides ``data.trigger``).
        role: ``train``, or ``regularization``: class images with their own captions (``data.trigger`` is not put in
            them) that keep what the base model draws (``model.preservation.mode``: ``prior`` trains them against
            their own target, ``dop`` against the base model's own prediction).
        loss_weight: the weight of this folder's images in the loss (e.g. 0.5 for regularization images: half as
            much as a training image).
        masks: a folder of masks with the images' file names (white: train there; black: leave out), or ``alpha``:
            each image's own transparency. Images without a mask train everywhere.
        unmasked_weight: with ``masks``, the loss weight outside the mask (0: ignored, no gradient at all; 1: as if
            there were no mask).
    """

    path: str
    repeats: int = 1
    default_caption: str | None = None
    trigger: str | None = None
    role: FolderRole = "train"
    loss_weight: float = 1.0
    masks: str | None = None
    unmasked_weight: float = 0.0


@dataclass(frozen=True)
class Item:
    """One usable image: its file, its caption as written (may be empty), and the trigger word to apply; its folder's
    role and loss weight, and its mask (a file, or :data:`ALPHA`: the image's transparency; None: none) with the weight
    outside it."""

    image: Path
    caption: str
    trigger: str | None = None
    repeats: int = 1
    role: SampleRole = "train"
    loss_weight: float = 1.0
    mask: Path | str | None = None
    unmasked_weight: float = 0.0


@dataclass(frozen=True)
class Skip:
    """A file (or folder) that is left out, or a note about one: a short ``kind`` for counting and a one-line
    ``reason``."""

    path: Path
    kind: str
    reason: str

    @property
    def note(self) -> bool:
        """A note (:data:`NOTE_KINDS`): reported, but nothing is left out for it."""
        return self.kind in NOTE_KINDS

    def line(self) -> str:
        """``path: reason``, printable whatever bytes the file name holds."""
        return f"{display(self.path)}: {display(self.reason)}"


def as_folders(images: str | ImageFolder | Sequence[str | ImageFolder], option: str) -> list[ImageFolder]:
    """Normalise the ``images`` option (a path, a folder, or a list of either) to folders, each field checked
    (:func:`folder_entry`). A list or mapping written as YAML on the command line (``--data.images '[{path: x,
    repeats: 2}]'``) in which an entry does not fit :class:`ImageFolder` reaches here as one string (the parser then
    takes the value as a path, alone or as the one entry of a list): it is read as YAML, so that the message names the
    field, not a missing folder named by the whole value."""
    value: Any = images
    if isinstance(value, list | tuple) and len(value) == 1 and isinstance(value[0], str):
        value = value[0]
    if isinstance(value, str):
        value = _written_as_yaml(value, option)
        if isinstance(value, str):
            value = images  # a path, as given
    if isinstance(value, str | ImageFolder | dict):
        return [folder_entry(value, option)]
    return [folder_entry(entry, f"{option}[{i}]") for i, entry in enumerate(value)]


_FIELDS = ("path", "repeats", "default_caption", "trigger", "role", "loss_weight", "masks", "unmasked_weight")
_EXAMPLE = "{path: photos, repeats: 2}"
_ROLES = {"train": "train", "regularization": "regularization", "regularisation": "regularization"}


def _written_as_yaml(text: str, option: str) -> Any:
    """``text`` read as YAML when it is written as a list or a mapping (``[...]``, ``{...}``) and names no folder, else
    ``text`` (a path)."""
    if not text.lstrip().startswith(("[", "{")) or Path(text).expanduser().is_dir():
        return text
    import yaml

    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as e:
        problem = str(e).splitlines()[0]
        raise ConfigError(
            f"{option}: {text!r} is written as a list of folders but is not valid YAML ({problem}); write e.g. "
            f"'[{_EXAMPLE}]'."
        ) from None
    return value if isinstance(value, list | dict) else text


def folder_entry(entry: Any, where: str) -> ImageFolder:
    """One folder entry of ``data.images`` / ``data.val_images`` (a path, an :class:`ImageFolder`, or a mapping of its
    fields) as an :class:`ImageFolder`; a :class:`ConfigError` naming the field (``data.images[0].repeats``) that is
    unknown, missing or of the wrong type."""
    if isinstance(entry, str):
        return ImageFolder(path=entry)
    if isinstance(entry, ImageFolder):
        fields = {name: getattr(entry, name) for name in _FIELDS}
    elif isinstance(entry, dict):
        fields = dict(entry)
    else:
        raise ConfigError(f"{where}: {entry!r} is not a folder; give a path, or {_EXAMPLE}.")
    unknown = [str(k) for k in fields if k not in _FIELDS]
    if unknown:
        raise ConfigError(f"{where}: unknown field {unknown[0]!r}; a folder entry has {', '.join(_FIELDS)}.")
    path = fields.get("path")
    if path is None:
        raise ConfigError(f"{where}: a folder entry needs path (the folder), e.g. {_EXAMPLE}.")
    if not isinstance(path, str) or not path:
        quote = f" (a folder named {path} is written path: '{path}')" if isinstance(path, int | float) else ""
        raise ConfigError(f"{where}.path must be a folder, got {path!r}{quote}.")
    repeats = fields.get("repeats", 1)
    if isinstance(repeats, bool) or not isinstance(repeats, int):
        raise ConfigError(f"{where}.repeats must be an integer (1 or more), got {repeats!r}.")
    if repeats < 1:
        raise ConfigError(f"{where}: repeats of {path!r} is {repeats}; use 1 or more.")
    for name in ("default_caption", "trigger", "masks"):
        value = fields.get(name)
        if value is not None and not isinstance(value, str):
            raise ConfigError(f"{where}.{name} must be text (or null), got {value!r}.")
    role = fields.get("role", "train")
    if role not in _ROLES:
        raise ConfigError(
            f"{where}.role: {role!r} is not a role; use train (images to learn) or regularization (class images that "
            "keep the base model's behaviour, with model.preservation)."
        )
    loss_weight = _number(fields.get("loss_weight", 1.0), f"{where}.loss_weight", "a positive number (1: as usual)")
    if not loss_weight > 0:
        raise ConfigError(
            f"{where}.loss_weight: {loss_weight} must be positive (1: as usual); to leave a folder out, remove it."
        )
    masks = fields.get("masks")
    if masks is not None and not masks.strip():
        raise ConfigError(f"{where}.masks is empty; give a folder of masks, or alpha, or remove it.")
    unmasked = _number(fields.get("unmasked_weight", 0.0), f"{where}.unmasked_weight", "a number from 0 to 1")
    if not 0.0 <= unmasked <= 1.0:
        raise ConfigError(f"{where}.unmasked_weight: {unmasked} must be from 0 (ignored) to 1 (as the masked area).")
    if unmasked and masks is None:
        raise ConfigError(
            f"{where}.unmasked_weight weighs the area outside the masks, but {path!r} has no masks; set masks (a "
            "folder, or alpha) or remove unmasked_weight."
        )
    return ImageFolder(
        path,
        repeats,
        fields.get("default_caption"),
        fields.get("trigger"),
        _ROLES[role],  # type: ignore[arg-type]  # one of FolderRole
        loss_weight,
        masks,
        unmasked,
    )


def _number(value: Any, where: str, what: str) -> float:
    """``value`` as a finite float; a :class:`ConfigError` naming ``where`` for text, a bool or infinity."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"{where} must be {what}, got {value!r}.")
    return float(value)


def _broken_link(path: Path) -> str | None:
    """Why the symbolic link ``path`` leads to no file, or None when it does."""
    try:
        os.stat(path)
    except FileNotFoundError:
        return f"broken symbolic link (target {os.readlink(path)} does not exist)"
    except OSError as e:
        if e.errno == errno.ELOOP:
            return f"symbolic link loop (following {os.readlink(path)} leads back to it)"
        return f"cannot follow the symbolic link ({e.strerror or e})"
    return None


def list_images(folder: Path) -> tuple[list[Path], list[Skip]]:
    """The image files directly in ``folder`` (by extension, any case; sorted), and a :class:`Skip` for each file
    that looks like an image but cannot be used (a format Pillow cannot read here, a broken link). Hidden files,
    folders and other files are ignored."""
    readable = readable_extensions()
    images: list[Path] = []
    skips: list[Skip] = []
    for p in sorted(folder.iterdir()):
        if p.name.startswith("."):
            continue
        suffix = p.suffix.lower()
        reason = None if suffix in readable else unreadable_reason(suffix)
        if suffix not in readable and reason is None:
            continue  # not an image: a caption, metadata, a video...
        broken = _broken_link(p) if p.is_symlink() else None
        if broken is not None:
            skips.append(Skip(p, "broken link", broken))
        elif not p.is_file():
            continue  # a folder named like an image is not an image
        elif reason is not None:
            skips.append(Skip(p, "unsupported format", reason))
        else:
            images.append(p)
    return images, skips


def _unmatched(root: Path, names: set[str], metadata: dict[str, MetadataCaption]) -> list[Skip]:
    """A note for each metadata record whose file is not an image of the folder."""
    notes = []
    for name, entry in metadata.items():
        if name not in names:
            nested = " (subfolders are not searched)" if "/" in name else ""
            notes.append(
                Skip(root, "metadata", f"{entry.where}: names {name}, which is not an image in this folder{nested}")
            )
    return notes


def scan(
    folders: Sequence[ImageFolder],
    *,
    caption_ext: str = ".txt",
    default_caption: str | None = None,
    trigger: str | None = None,
    option: str = "data.images",
) -> tuple[list[Item], list[Skip]]:
    """Usable images with their captions, and the skipped ones (and notes) with reasons. See the module docstring."""
    items: list[Item] = []
    skips: list[Skip] = []
    found_any = False
    for folder in folders:
        root = Path(folder.path).expanduser()
        if not root.is_dir():
            raise ConfigError(f"{option}: folder {folder.path!r} does not exist. Check the path.")
        images, unusable = list_images(root)
        skips.extend(unusable)
        if not images:
            if folder.role == "regularization":
                raise ConfigError(
                    f"{option}: the regularization folder {folder.path!r} holds no images ({FORMATS}); put the class "
                    "images there, or remove the folder (and model.preservation)."
                )
            if not unusable:
                skips.append(Skip(root, "empty folder", f"holds no images ({FORMATS})"))
            continue
        found_any = True
        masks, mask_notes = _masks(folder, root, images, option)
        skips.extend(mask_notes)
        metadata, notes = read_metadata(root)
        skips.extend(Skip(root, kind, message) for kind, message in notes)
        skips.extend(_unmatched(root, {p.name for p in images} | {s.path.name for s in unusable}, metadata))
        default = folder.default_caption if folder.default_caption is not None else default_caption
        # Class images keep their captions as written: data.trigger is the word of the images to learn.
        word = folder.trigger if folder.trigger is not None or folder.role == "regularization" else trigger
        for image in images:
            caption_file = image.with_suffix(caption_ext)
            binary: str | None = None  # a caption file that holds no text: as if there were none
            try:
                if caption_file.is_file():
                    try:
                        caption, caption_notes = read_caption_file(caption_file)
                    except NotText as e:
                        caption, caption_notes, binary = "", [], str(e)
                    skips.extend(Skip(caption_file, kind, message) for kind, message in caption_notes)
                    origin = binary or f"caption file {caption_file.name} is empty"
                else:
                    entry = metadata.get(image.name)
                    caption = entry.caption if entry is not None else ""
                    origin = f"no caption file {caption_file.name}" + (
                        " and no metadata entry" if any((root / m).is_file() for m in METADATA_FILES) else ""
                    )
            except CaptionError as e:
                skips.append(Skip(image, "caption", str(e)))
                continue
            if not caption:
                if default is not None:
                    caption = default
                    if binary:
                        skips.append(Skip(caption_file, "not text", f"{binary}; the default caption is used"))
                elif word:
                    caption = ""  # the trigger word alone
                    if binary:
                        skips.append(Skip(caption_file, "not text", f"{binary}; the trigger word alone is used"))
                else:
                    fix = "write a caption, or set data.default_caption or data.trigger"
                    skips.append(Skip(image, "caption", f"{origin}; {fix}"))
                    continue
            if TRIGGER in caption and not word:
                skips.append(Skip(image, "caption", f"caption uses {TRIGGER} but data.trigger is not set"))
                continue
            mask: Path | str | None = ALPHA if folder.masks == ALPHA else masks.get(image.stem)
            if folder.masks is not None and mask is None:
                reason = f"no mask named {image.stem} in {folder.masks}: trained everywhere"
                skips.append(Skip(image, "no mask", reason))
            items.append(
                Item(
                    image,
                    caption,
                    word,
                    folder.repeats,
                    role=folder.role,
                    loss_weight=folder.loss_weight,
                    mask=mask,
                    unmasked_weight=folder.unmasked_weight,
                )
            )
    if not found_any:
        names = ", ".join(repr(f.path) for f in folders)
        unusable = [s for s in skips if s.kind in ("unsupported format", "broken link")]
        example = f"; {len(unusable)} file(s) cannot be used, e.g. {unusable[0].line()}" if unusable else ""
        raise ConfigError(
            f"{option}: folder {names} holds no images ({FORMATS}){example}. Put your training images there, or "
            f"point {option} at the right folder."
        )
    return items, skips


def _masks(folder: ImageFolder, root: Path, images: list[Path], option: str) -> tuple[dict[str, Path], list[Skip]]:
    """The folder's masks by file name without extension (the first in file-name order for a name used twice; none
    without a mask folder or for ``masks: alpha``), and a note for each mask that matches no image and each second mask
    of a name. A :class:`ConfigError` for a mask folder that does not exist, is the image folder, holds no image, or
    holds no mask of any of its images."""
    if folder.masks is None or folder.masks == ALPHA:
        return {}, []
    where = f"{option}: the masks of {folder.path!r}, {folder.masks!r},"
    mask_root = Path(folder.masks).expanduser()
    if not mask_root.is_dir():
        raise ConfigError(f"{where} is not a folder. Check the path (or write masks: alpha for the transparency).")
    if mask_root.resolve() == root.resolve():
        raise ConfigError(
            f"{where} is the image folder itself; a mask has its image's file name, so masks go in a folder of their "
            "own."
        )
    found, _ = list_images(mask_root)
    if not found:
        raise ConfigError(
            f"{where} holds no masks ({FORMATS}); put one per image there, named like its image (photo.png masks "
            "photo.jpg), white where the image trains."
        )
    masks: dict[str, Path] = {}
    for mask in found:
        masks.setdefault(mask.stem, mask)
    stems = {image.stem for image in images}
    if not stems & set(masks):
        raise ConfigError(
            f"{where} holds {len(found)} masks, none named like an image of the folder (e.g. {found[0].name}); a mask "
            f"has its image's file name ({images[0].stem}.png masks {images[0].name})."
        )
    notes = [
        Skip(m, "unmatched mask", "matches no image of its folder (a mask has its image's file name)")
        for m in found
        if m.stem not in stems
    ]
    notes += [
        Skip(m, "mask", f"a second mask named {m.stem}; {masks[m.stem].name} is used")
        for m in found
        if m.stem in stems and masks[m.stem] != m
    ]
    return masks, notes


def _name_bytes(name: str) -> bytes:
    """The bytes of a file name as the file system holds them: what ``str.encode()`` gives for every valid name (so
    the hash, and the split, of existing names never changes), and the raw bytes of a name that is not UTF-8."""
    try:
        return name.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a lone surrogate from an invalid UTF-16 name (Windows)
        return name.encode("utf-8", "surrogatepass")


def _name_hash(item: Item) -> float:
    """A number in [0, 1) from the folder and file name."""
    digest = hashlib.sha256(_name_bytes(f"{item.image.parent.name}/{item.image.name}")).digest()
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
