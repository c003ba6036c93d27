"""Finding images and captions: caption files, metadata files, defaults, trigger words, tag variants, bad captions,
empty and missing folders, per-folder options, and the validation split."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_lora.data.captions import apply_trigger, tag_variants
from lightning_lora.data.sources import ImageFolder, Item, as_folders, scan, split_validation
from lightning_lora.errors import ConfigError


def _touch(folder: Path, *names: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        (folder / name).write_bytes(b"")


def _scan(*folders: Path | ImageFolder, **kwargs) -> tuple[list[Item], dict[str, str]]:
    items, skips = scan([f if isinstance(f, ImageFolder) else ImageFolder(str(f)) for f in folders], **kwargs)
    return items, {s.path.name: s.reason for s in skips}


def test_caption_files_sorted_any_case_hidden_ignored(tmp_path: Path) -> None:
    _touch(tmp_path, "b.png", "a.jpg", "c.JPEG", "d.webp", "e.bmp", "notes.md", "x.webp.txt", "._a.jpg")
    (tmp_path / "sub.png").mkdir()  # a folder named like an image is not an image
    for name, text in {"a": "  caption a \n", "b": "caption b", "c": "line one\nline two", "d": "d", "e": "e"}.items():
        (tmp_path / f"{name}.txt").write_text(text)
    items, skips = _scan(tmp_path)
    assert [i.image.name for i in items] == ["a.jpg", "b.png", "c.JPEG", "d.webp", "e.bmp"]
    assert [i.caption for i in items][:3] == ["caption a", "caption b", "line one line two"]
    assert not skips


def test_metadata_jsonl_and_csv(tmp_path: Path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    _touch(one, "a.png", "b.png", "c.png")
    (one / "metadata.jsonl").write_text(
        '{"file_name": "a.png", "text": "from jsonl"}\nnot json\n{"file_name": "b.png", "caption": "second"}\n'
    )
    (one / "c.txt").write_text("a caption file wins")
    _touch(two, "x.jpg")
    (two / "metadata.csv").write_text('file_name,prompt\nx.jpg,"from csv, with a comma"\n')
    items, skips = _scan(one, two)
    assert [(i.image.name, i.caption) for i in items] == [
        ("a.png", "from jsonl"),
        ("b.png", "second"),
        ("c.png", "a caption file wins"),
        ("x.jpg", "from csv, with a comma"),
    ]
    assert "metadata.jsonl:2: ignored (not JSON" in skips["one"]


def test_default_caption_folder_options_and_repeats(tmp_path: Path) -> None:
    _touch(tmp_path / "me", "a.png", "b.png")
    (tmp_path / "me" / "b.txt").write_text("own caption")
    _touch(tmp_path / "style", "s.png")
    items, _ = _scan(
        ImageFolder(str(tmp_path / "me"), repeats=3),
        ImageFolder(str(tmp_path / "style"), default_caption="in [trigger] style", trigger="xyz"),
        default_caption="a photo",
        trigger="sks",
    )
    assert [(i.caption, i.trigger, i.repeats) for i in items] == [
        ("a photo", "sks", 3),
        ("own caption", "sks", 3),
        ("in [trigger] style", "xyz", 1),
    ]
    folders = as_folders([str(tmp_path / "me"), ImageFolder("x", repeats=2)], "data.images")
    assert folders == [ImageFolder(str(tmp_path / "me")), ImageFolder("x", repeats=2)]
    with pytest.raises(ConfigError, match="repeats"):
        as_folders([ImageFolder("x", repeats=0)], "data.images")


def test_bad_captions_are_skipped_with_a_reason(tmp_path: Path) -> None:
    _touch(tmp_path, "latin1.png", "empty.png", "none.png", "tag.png", "ok.png")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    (tmp_path / "empty.txt").write_text("  \n")
    (tmp_path / "tag.txt").write_text("[trigger] on a beach")
    (tmp_path / "ok.txt").write_bytes("\ufeffcaf\u00e9".encode())  # UTF-8 with a byte-order mark is fine
    items, skips = _scan(tmp_path)
    assert [(i.image.name, i.caption) for i in items] == [("ok.png", "caf\u00e9")]
    assert "latin1.txt is not UTF-8" in skips["latin1.png"] and "0xe9 at position 3" in skips["latin1.png"]
    assert "empty.txt is empty" in skips["empty.png"] and "data.default_caption" in skips["empty.png"]
    assert "no caption file none.txt" in skips["none.png"]
    assert "[trigger] but data.trigger is not set" in skips["tag.png"]
    # With a default caption, empty and missing captions use it; with only a trigger word, it is the caption.
    items, skips = _scan(tmp_path, default_caption="a photo")
    assert {i.image.name: i.caption for i in items}["empty.png"] == "a photo"
    items, _ = _scan(tmp_path, trigger="sks")
    assert {i.image.name: apply_trigger(i.caption, i.trigger) for i in items} == {
        "empty.png": "sks",
        "none.png": "sks",
        "tag.png": "sks on a beach",
        "ok.png": "sks, caf\u00e9",
    }


def test_empty_and_missing_folders(tmp_path: Path) -> None:
    _touch(tmp_path / "good", "a.png")
    (tmp_path / "good" / "a.txt").write_text("x")
    _touch(tmp_path / "empty", "readme.txt")
    items, skips = _scan(tmp_path / "good", tmp_path / "empty")
    assert len(items) == 1 and "holds no images" in skips["empty"]
    with pytest.raises(ConfigError, match=r"data\.images.*holds no images"):
        _scan(tmp_path / "empty")
    with pytest.raises(ConfigError, match=r"data\.images.*missing.*does not exist"):
        _scan(tmp_path / "good", tmp_path / "missing")


def test_trigger_word() -> None:
    assert apply_trigger("a photo of a man", "sks") == "sks, a photo of a man"
    assert apply_trigger("a photo of [trigger] man", "sks") == "a photo of sks man"
    assert apply_trigger("sks man, smiling", "sks") == "sks man, smiling"  # already there: not doubled
    assert apply_trigger("asks a question", "sks") == "sks, asks a question"  # a word, not a substring
    assert apply_trigger("", "sks") == "sks"
    assert apply_trigger("a photo", None) == "a photo"


def test_tag_variants_are_deterministic_distinct_and_keep_leading_tags() -> None:
    caption = "sks woman, red hat, smiling, outdoors, bokeh, 35mm"
    variants = tag_variants(caption, 6, keep_tokens=1)
    assert variants[0] == caption and len(variants) == len(set(variants)) == 6
    assert all(v.startswith("sks woman, ") for v in variants)
    assert all(sorted(v.split(", ")) == sorted(caption.split(", ")) for v in variants)
    assert tag_variants(caption, 6, keep_tokens=1) == variants  # a pure function of the text
    assert tag_variants("one, two", 8) == ["one, two", "two, one"]  # no more than exist
    assert tag_variants("no tags here", 8) == ["no tags here"]
    assert tag_variants(caption, 1) == [caption]


def test_validation_split_is_deterministic_and_stable(tmp_path: Path) -> None:
    items = [Item(tmp_path / "set" / f"img{i:03d}.png", "c") for i in range(200)]
    train, val = split_validation(items, 0.1)
    assert 10 <= len(val) <= 30 and len(train) + len(val) == 200
    assert not {v.image for v in val} & {t.image for t in train}
    assert split_validation(items, 0.1) == (train, val)
    # Adding images never moves an image between the splits; the held-out set depends on names, not contents.
    extra = [Item(tmp_path / "set" / f"new{i}.png", "c") for i in range(50)]
    more_train, more_val = split_validation([*items, *extra], 0.1)
    assert {v.image for v in val} <= {v.image for v in more_val}
    assert {t.image for t in train} <= {t.image for t in more_train}
    moved = [Item(tmp_path / "elsewhere" / "set" / i.image.name, "other caption") for i in items]
    assert [v.image.name for v in split_validation(moved, 0.1)[1]] == [v.image.name for v in val]
    # At least one image is held out, never the last training image.
    assert len(split_validation(items[:3], 0.01)[1]) == 1
    assert split_validation(items[:1], 0.5) == (items[:1], [])
    assert split_validation(items, 0.0) == (items, [])
