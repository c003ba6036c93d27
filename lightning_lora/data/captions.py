"""Captions: where they come from, the trigger word, and shuffled tag variants.

Sources, for an image ``photo.jpg`` in a folder, in this order:

1. ``photo.txt`` beside it (the extension is ``data.caption_ext``); lines are joined with spaces.
2. A ``metadata.jsonl`` (one JSON object per line) or ``metadata.csv`` (with a header) in the folder, as Hugging
   Face's ``imagefolder`` writes them: the file column is ``file_name`` (or ``file``, ``image``), the caption column
   ``text`` (or ``caption``, ``prompt``). A row naming a file outside the folder is noted and ignored.
3. The folder's or the data section's ``default_caption`` (an instance prompt such as ``a photo of sks dog``).

**Encodings** (:func:`decode_text`, for caption and metadata files alike). UTF-8, with or without a byte-order mark,
and UTF-16 with one (LE or BE: Windows' "Unicode") are read as they are. Anything else is read as Windows-1252, the
"ANSI" encoding Notepad and older Windows tools save in (a superset of Latin-1's letters; the five bytes it leaves
undefined are read as Latin-1), with a note naming the file: a caption in the wrong encoding still describes its image
much better than no caption, so the image is kept. A file that holds no text at all (:class:`NotText`: NUL
characters, or mostly control characters, as a PNG or a JPEG saved as ``photo.txt`` reads in any encoding) is no
caption: it is named, and the image takes the folder's default caption (or the trigger word alone), as an image
without a caption file does; without either it is skipped.

**Length.** A caption is cut to :data:`MAX_CAPTION_CHARS` characters when read, with a note: far more than any text
encoder reads (FLUX's T5 reads 512 tokens, CLIP 77), so the encoder sees the same text, but a log pasted into a caption
file by mistake is never tokenized, hashed and printed in full.

**Trigger word.** ``[trigger]`` in a caption is replaced by it; otherwise it is prepended as the first tag
(``sks, a photo of a dog``), unless the caption already contains it as a word.

**Preservation captions** (``model.preservation.every_image``): :func:`without_trigger` takes the trigger word out of
a caption as trained (every whole-word occurrence; the commas and spaces it leaves are tidied), or puts a class word in
its place: ``sks, a photo of a dog`` becomes ``a photo of a dog``, and with the class word ``dog``, ``a photo of sks``
becomes ``a photo of dog``. They are cached like every caption.

**Tag shuffling.** Training reads only the cache, so a caption cannot be re-shuffled and re-encoded at train time.
Instead :func:`tag_variants` makes up to K orderings of the comma-separated tags of each caption (the first
``keep_tokens`` tags stay in place), every one is encoded into the cache, and the data set picks one per (seed,
epoch, sample). Variant 0 is the caption as written; the others depend only on the caption's text (seeded by its
hash), so the cache keys are stable from run to run. The trigger is applied after shuffling, so a prepended trigger
always stays first.
"""

from __future__ import annotations

import codecs
import csv
import hashlib
import io
import json
import posixpath
import random
import re
import unicodedata
from pathlib import Path
from typing import NamedTuple

__all__ = [
    "CaptionError",
    "MAX_CAPTION_CHARS",
    "METADATA_FILES",
    "MetadataCaption",
    "NotText",
    "Note",
    "apply_trigger",
    "decode_text",
    "read_caption_file",
    "read_metadata",
    "split_tags",
    "tag_variants",
    "without_trigger",
]

METADATA_FILES = ("metadata.jsonl", "metadata.csv")
_FILE_COLUMNS = ("file_name", "file", "image")
_CAPTION_COLUMNS = ("text", "caption", "prompt")
TRIGGER = "[trigger]"

MAX_CAPTION_CHARS = 20_000
"""Captions are cut to this many characters when read (512 T5 tokens rarely hold 3,000)."""

_BOMS = ((codecs.BOM_UTF8, "utf-8"), (codecs.BOM_UTF16_LE, "utf-16-le"), (codecs.BOM_UTF16_BE, "utf-16-be"))
_CP1252_UNDEFINED = re.compile("[\udc81\udc8d\udc8f\udc90\udc9d]")  # as cp1252 + surrogateescape decodes them


class CaptionError(Exception):
    """A caption source that cannot be read; the message is a one-line reason."""


class NotText(CaptionError):
    """A caption file that holds no text (a binary file named like a caption); the message is a one-line reason."""


_CONTROL_SHARE = 0.3
"""A decoded caption file whose characters are more than this share control characters is not text."""
_LAYOUT = frozenset("\t\n\r\f\v")


class Note(NamedTuple):
    """Something worth telling about a caption source that does not drop its image: a short ``kind`` (``"not
    UTF-8"``, ``"long caption"``, ``"metadata"``) and a one-line ``message``."""

    kind: str
    message: str


class MetadataCaption(NamedTuple):
    """A caption from a metadata file, and where it was written (``metadata.jsonl:3``), for messages."""

    caption: str
    where: str


def decode_text(data: bytes) -> tuple[str, str | None]:
    """The text of a caption or metadata file, and ``None`` when it was UTF-8 (a byte-order mark allowed) or UTF-16
    with a byte-order mark, else a note saying it was read as Windows-1252 (see the module docstring)."""
    position = 0
    for bom, encoding in _BOMS:
        if data.startswith(bom):
            try:
                return data[len(bom) :].decode(encoding), None
            except UnicodeDecodeError as e:
                position = len(bom) + e.start
                break
    else:
        try:
            return data.decode("utf-8"), None
        except UnicodeDecodeError as e:
            position = e.start
    text = data.decode("cp1252", errors="surrogateescape")
    text = _CP1252_UNDEFINED.sub(lambda m: chr(ord(m.group()) - 0xDC00), text)
    return text, (
        f"not UTF-8 (byte 0x{data[position]:02x} at position {position}); read as Windows-1252. If a character looks "
        "wrong, save it as UTF-8"
    )


def not_text(text: str) -> str | None:
    """Why the decoded text of a caption file is no text (see :class:`NotText`), or None when it is text: it holds a
    NUL character (binary files do; text in any encoding this module reads does not, once decoded), or more than
    :data:`_CONTROL_SHARE` of its characters are control characters other than tabs and line breaks."""
    if "\x00" in text:
        nul = text.count("\x00")
        return f"it holds {nul:,} NUL bytes: a binary file (or UTF-16 without a byte-order mark), not text"
    controls = sum(1 for c in text if c not in _LAYOUT and unicodedata.category(c) == "Cc")
    if text and controls > _CONTROL_SHARE * len(text):
        return f"{controls:,} of its {len(text):,} characters are control characters: a binary file, not text"
    return None


def _cut(caption: str) -> tuple[str, str | None]:
    """The caption cut to :data:`MAX_CAPTION_CHARS`, and a note when it was longer."""
    if len(caption) <= MAX_CAPTION_CHARS:
        return caption, None
    return caption[:MAX_CAPTION_CHARS], (
        f"{len(caption):,} characters long; only the first {MAX_CAPTION_CHARS:,} are kept (far more than a text "
        "encoder reads)"
    )


def read_caption_file(path: Path) -> tuple[str, list[Note]]:
    """The caption in ``path`` (lines joined with spaces, stripped, cut to :data:`MAX_CAPTION_CHARS`), and the notes
    about it (its encoding, its length). Raises :class:`CaptionError` when the file cannot be read, and
    :class:`NotText` when it holds no text."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CaptionError(f"cannot read caption file {path.name} ({e.strerror or e})") from e
    text, encoding = decode_text(data)
    binary = not_text(text)
    if binary is not None:
        raise NotText(f"caption file {path.name} is not a caption ({binary})")
    caption, cut = _cut(" ".join(line.strip() for line in text.splitlines() if line.strip()))
    notes = [Note("not UTF-8", encoding)] if encoding else []
    return caption, notes + ([Note("long caption", cut)] if cut else [])


def _pick(row: dict, columns: tuple[str, ...]) -> str | None:
    for column in columns:
        value = row.get(column)
        if isinstance(value, str):
            return value
    return None


def _inside(file_name: str) -> str | None:
    """A metadata row's file name relative to its folder (``./a.png`` -> ``a.png``), or None when it points outside."""
    name = posixpath.normpath(file_name)
    if posixpath.isabs(name) or name == ".." or name.startswith("../"):
        return None
    return name


def read_metadata(folder: Path) -> tuple[dict[str, MetadataCaption], list[Note]]:
    """Captions by file name from the folder's metadata files, and a note per unusable record or file (messages
    start with the metadata file's name, ``metadata.jsonl:3: ...``). Captions are cut like caption files."""
    captions: dict[str, MetadataCaption] = {}
    notes: list[Note] = []
    for name in METADATA_FILES:
        path = folder / name
        if not path.is_file():
            continue
        try:
            text, encoding = decode_text(path.read_bytes())
        except OSError as e:
            notes.append(Note("metadata", f"{name}: ignored (cannot read it: {e.strerror or e})"))
            continue
        if encoding:
            notes.append(Note("not UTF-8", f"{name}: {encoding}"))
        rows: list[tuple[int, object]] = []
        if name.endswith(".jsonl"):
            for number, line in enumerate(text.splitlines(), start=1):
                if not line.strip():
                    continue
                try:
                    rows.append((number, json.loads(line)))
                except json.JSONDecodeError as e:
                    notes.append(Note("metadata", f"{name}:{number}: ignored (not JSON: {e.msg})"))
        else:
            try:
                rows = [(n, row) for n, row in enumerate(csv.DictReader(io.StringIO(text)), start=2)]
            except csv.Error as e:
                notes.append(Note("metadata", f"{name}: ignored (not CSV: {e})"))
        for number, row in rows:
            file_name = _pick(row, _FILE_COLUMNS) if isinstance(row, dict) else None
            caption = _pick(row, _CAPTION_COLUMNS) if isinstance(row, dict) else None
            where = f"{name}:{number}"
            if file_name is None or caption is None:
                notes.append(
                    Note(
                        "metadata",
                        f"{where}: ignored (needs a {'/'.join(_FILE_COLUMNS)} and a {'/'.join(_CAPTION_COLUMNS)} "
                        "field)",
                    )
                )
                continue
            inside = _inside(file_name)
            if inside is None:
                notes.append(Note("metadata", f"{where}: names {file_name}, which is outside this folder"))
                continue
            caption, cut = _cut(" ".join(caption.split()))
            if cut:
                notes.append(Note("long caption", f"{where}: the caption of {inside} is {cut}"))
            captions.setdefault(inside, MetadataCaption(caption, where))
    return captions, notes


def apply_trigger(caption: str, trigger: str | None) -> str:
    """Put the trigger word into a caption: replace ``[trigger]``, or prepend it as the first tag."""
    if not trigger:
        return caption
    if TRIGGER in caption:
        return caption.replace(TRIGGER, trigger)
    if not caption:
        return trigger
    if re.search(rf"(?<!\w){re.escape(trigger)}(?!\w)", caption):
        return caption
    return f"{trigger}, {caption}"


def without_trigger(caption: str, trigger: str, class_word: str | None = None) -> str:
    """``caption`` (as trained: the trigger applied) with every whole-word ``trigger`` removed, or replaced by
    ``class_word``; the separators left behind tidied (see the module docstring)."""
    text = re.sub(rf"(?<!\w){re.escape(trigger)}(?!\w)", class_word or "", caption)
    text = re.sub(r"\s+", " ", text)
    text = re.sub(r"\s*,(\s*,)*", ",", text)  # a removed tag leaves ", ," behind
    return text.strip(" ,")


def split_tags(caption: str) -> list[str]:
    """Comma-separated tags, stripped, empty ones dropped."""
    return [t.strip() for t in caption.split(",") if t.strip()]


def tag_variants(caption: str, count: int, keep_tokens: int = 0) -> list[str]:
    """Up to ``count`` distinct tag orderings of ``caption``; ``[0]`` is the caption as written."""
    variants = [caption]
    tags = split_tags(caption)
    head, tail = tags[:keep_tokens], tags[keep_tokens:]
    if count <= 1 or len(tail) < 2:
        return variants
    seen = {", ".join(tags)}
    rng = random.Random(int.from_bytes(hashlib.sha256(caption.encode()).digest()[:8], "little"))
    for _ in range(count * 20):
        if len(variants) >= count:
            break
        shuffled = tail[:]
        rng.shuffle(shuffled)
        text = ", ".join(head + shuffled)
        if text not in seen:
            seen.add(text)
            variants.append(text)
    return variants
