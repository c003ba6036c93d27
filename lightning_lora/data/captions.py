"""Captions: where they come from, the trigger word, and shuffled tag variants.

Sources, for an image ``photo.jpg`` in a folder, in this order:

1. ``photo.txt`` beside it (the extension is ``data.caption_ext``), read as UTF-8 (a byte-order mark is allowed);
   lines are joined with spaces. A file that is not UTF-8 is a reason to skip the image, never guessed at.
2. A ``metadata.jsonl`` (one JSON object per line) or ``metadata.csv`` (with a header) in the folder, as Hugging
   Face's ``imagefolder`` writes them: the file column is ``file_name`` (or ``file``, ``image``), the caption column
   ``text`` (or ``caption``, ``prompt``).
3. The folder's or the data section's ``default_caption`` (an instance prompt such as ``a photo of sks dog``).

**Trigger word.** ``[trigger]`` in a caption is replaced by it; otherwise it is prepended as the first tag
(``sks, a photo of a dog``), unless the caption already contains it as a word.

**Tag shuffling.** Training reads only the cache, so a caption cannot be re-shuffled and re-encoded at train time.
Instead :func:`tag_variants` makes up to K orderings of the comma-separated tags of each caption (the first
``keep_tokens`` tags stay in place), every one is encoded into the cache, and the data set picks one per (seed,
epoch, sample). Variant 0 is the caption as written; the others depend only on the caption's text (seeded by its
hash), so the cache keys are stable from run to run. The trigger is applied after shuffling, so a prepended trigger
always stays first.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import random
import re
from pathlib import Path

__all__ = [
    "CaptionError",
    "METADATA_FILES",
    "apply_trigger",
    "read_caption_file",
    "read_metadata",
    "split_tags",
    "tag_variants",
]

METADATA_FILES = ("metadata.jsonl", "metadata.csv")
_FILE_COLUMNS = ("file_name", "file", "image")
_CAPTION_COLUMNS = ("text", "caption", "prompt")
TRIGGER = "[trigger]"


class CaptionError(Exception):
    """A caption source that cannot be read; the message is a one-line reason."""


def _decode(data: bytes, name: str) -> str:
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise CaptionError(
            f"caption file {name} is not UTF-8 text (byte 0x{data[e.start]:02x} at position {e.start}); "
            "save it as UTF-8"
        ) from e


def read_caption_file(path: Path) -> str:
    """The caption in ``path``: UTF-8, lines joined with spaces, stripped."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CaptionError(f"cannot read caption file {path.name} ({e.strerror or e})") from e
    return " ".join(line.strip() for line in _decode(data, path.name).splitlines() if line.strip())


def _pick(row: dict, columns: tuple[str, ...]) -> str | None:
    for column in columns:
        value = row.get(column)
        if isinstance(value, str):
            return value
    return None


def read_metadata(folder: Path) -> tuple[dict[str, str], list[str]]:
    """Captions by file name from the folder's metadata files, and one warning line per unusable record."""
    captions: dict[str, str] = {}
    problems: list[str] = []
    for name in METADATA_FILES:
        path = folder / name
        if not path.is_file():
            continue
        try:
            text = _decode(path.read_bytes(), name)
        except (OSError, CaptionError) as e:
            problems.append(f"{path}: ignored ({e})")
            continue
        rows: list[tuple[int, object]] = []
        if name.endswith(".jsonl"):
            for number, line in enumerate(text.splitlines(), start=1):
                if not line.strip():
                    continue
                try:
                    rows.append((number, json.loads(line)))
                except json.JSONDecodeError as e:
                    problems.append(f"{path}:{number}: ignored (not JSON: {e.msg})")
        else:
            try:
                rows = [(n, row) for n, row in enumerate(csv.DictReader(io.StringIO(text)), start=2)]
            except csv.Error as e:
                problems.append(f"{path}: ignored (not CSV: {e})")
        for number, row in rows:
            file_name = _pick(row, _FILE_COLUMNS) if isinstance(row, dict) else None
            caption = _pick(row, _CAPTION_COLUMNS) if isinstance(row, dict) else None
            if file_name is None or caption is None:
                problems.append(
                    f"{path}:{number}: ignored (needs a {'/'.join(_FILE_COLUMNS)} and a {'/'.join(_CAPTION_COLUMNS)} "
                    "field)"
                )
                continue
            captions.setdefault(Path(file_name).as_posix(), " ".join(caption.split()))
    return captions, problems


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
