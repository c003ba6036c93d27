"""Finding images and captions: caption files (encodings, length), metadata files, defaults, trigger words, tag
variants, bad captions, empty and missing folders, per-folder options, every format Pillow reads and the ones it
cannot, symbolic links, file names that are not UTF-8, and the validation split."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from lightning_lora.data.captions import apply_trigger, tag_variants, without_trigger
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


@pytest.mark.parametrize(
    ("value", "named"),
    [
        ("[{path: x, repeats: many}]", "data.images[0].repeats must be an integer (1 or more), got 'many'"),
        ("[{path: x, repeats: 1.5}]", "data.images[0].repeats must be an integer (1 or more), got 1.5"),
        ("[x, {path: y, repeats: 0}]", "data.images[1]: repeats of 'y' is 0"),
        ("[{path: x, repeat: 2}]", "data.images[0]: unknown field 'repeat'; a folder entry has path, repeats"),
        ("[{repeats: 2}]", "data.images[0]: a folder entry needs path"),
        ("[{path: 2024}]", "data.images[0].path must be a folder, got 2024 (a folder named 2024 is written path: "),
        ("[{path: x, default_caption: [a]}]", "data.images[0].default_caption must be text (or null), got ['a']"),
        ("[{path: x, trigger: 3}]", "data.images[0].trigger must be text (or null), got 3"),
        ("{path: x, repeats: many}", "data.images.repeats must be an integer"),
        ("[{path: x, repeats: 2]", "data.images: '[{path: x, repeats: 2]' is written as a list of folders but is not"),
        ("[3]", "data.images[0]: 3 is not a folder"),
        ("[{path: x, role: regularisaton}]", "data.images[0].role: 'regularisaton' is not a role; use train"),
        ("[{path: x, loss_weight: 0}]", "data.images[0].loss_weight: 0.0 must be positive (1: as usual)"),
        ("[{path: x, loss_weight: -1}]", "data.images[0].loss_weight: -1.0 must be positive"),
        ("[{path: x, loss_weight: heavy}]", "data.images[0].loss_weight must be a positive number (1: as usual), got"),
        ("[{path: x, masks: m, unmasked_weight: 1.5}]", "data.images[0].unmasked_weight: 1.5 must be from 0"),
        ("[{path: x, unmasked_weight: 0.2}]", "data.images[0].unmasked_weight weighs the area outside the masks, but"),
        ("[{path: x, masks: ''}]", "data.images[0].masks is empty; give a folder of masks, or alpha"),
        ("[{path: x, masks: 3}]", "data.images[0].masks must be text (or null), got 3"),
    ],
)
def test_a_bad_folder_entry_names_its_field(value: str, named: str) -> None:
    """A list written on the command line (``--data.images '[{path: x, repeats: many}]'``) reaches the data module as
    one string when an entry does not fit: the message names the field, not a missing folder named by the whole
    value."""
    with pytest.raises(ConfigError) as refused:
        as_folders(value, "data.images")
    assert named in str(refused.value)


def test_a_list_the_parser_passes_as_one_string_in_a_list_is_read_too() -> None:
    with pytest.raises(ConfigError, match=r"data.images\[0\].repeats must be an integer"):
        as_folders(["[{path: x, repeats: many}]"], "data.images")


def test_a_folder_whose_name_looks_like_a_list_is_a_folder(tmp_path: Path) -> None:
    folder = tmp_path / "[draft]"
    folder.mkdir()
    assert as_folders(str(folder), "data.images") == [ImageFolder(str(folder))]


def test_bad_captions_are_skipped_with_a_reason(tmp_path: Path) -> None:
    _touch(tmp_path, "latin1.png", "empty.png", "none.png", "tag.png", "ok.png")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    (tmp_path / "empty.txt").write_text("  \n")
    (tmp_path / "tag.txt").write_text("[trigger] on a beach")
    (tmp_path / "ok.txt").write_bytes("\ufeffcaf\u00e9".encode())  # UTF-8 with a byte-order mark is fine
    items, skips = _scan(tmp_path)
    # A caption that is not UTF-8 is read as Windows-1252 (a superset of Latin-1's letters) and noted, not skipped.
    assert [(i.image.name, i.caption) for i in items] == [("latin1.png", "caf\u00e9 au lait"), ("ok.png", "caf\u00e9")]
    assert "not UTF-8" in skips["latin1.txt"] and "0xe9 at position 3" in skips["latin1.txt"]
    assert "empty.txt is empty" in skips["empty.png"] and "data.default_caption" in skips["empty.png"]
    assert "no caption file none.txt" in skips["none.png"]
    assert "[trigger] but data.trigger is not set" in skips["tag.png"]
    # With a default caption, empty and missing captions use it; with only a trigger word, it is the caption.
    items, skips = _scan(tmp_path, default_caption="a photo")
    assert {i.image.name: i.caption for i in items}["empty.png"] == "a photo"
    items, _ = _scan(tmp_path, trigger="sks")
    assert {i.image.name: apply_trigger(i.caption, i.trigger) for i in items} == {
        "latin1.png": "sks, caf\u00e9 au lait",
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


def test_captions_in_other_encodings_are_read_and_noted(tmp_path: Path) -> None:
    """UTF-8 (with or without BOM) and UTF-16 with a BOM are read as they are; anything else as Windows-1252 (the
    encoding of Notepad's "ANSI" captions), with one note naming the file. The image is never dropped for it."""
    _touch(tmp_path, "plain.png", "bom.png", "le.png", "be.png", "ansi.png", "meta.png")
    (tmp_path / "plain.txt").write_bytes("caf\u00e9".encode())
    (tmp_path / "bom.txt").write_bytes("\ufeffcaf\u00e9".encode())
    (tmp_path / "le.txt").write_bytes("\ufeffcaf\u00e9\r\nau lait".encode("utf-16-le"))
    (tmp_path / "be.txt").write_bytes("\ufeffcaf\u00e9".encode("utf-16-be"))
    # cp1252: e-acute, curly quotes, the euro sign, and 0x81 (undefined in cp1252: read as U+0081, never an error).
    (tmp_path / "ansi.txt").write_bytes(b"caf\xe9 \x93au lait\x94 \x80 \x81")
    (tmp_path / "metadata.csv").write_bytes(b"file_name,text\nmeta.png,cr\xe8me br\xfbl\xe9e\n")
    items, skips = scan([ImageFolder(str(tmp_path))])
    assert {i.image.name: i.caption for i in items} == {
        "ansi.png": "caf\u00e9 \u201cau lait\u201d \u20ac \x81",
        "be.png": "caf\u00e9",
        "bom.png": "caf\u00e9",
        "le.png": "caf\u00e9 au lait",
        "meta.png": "cr\u00e8me br\u00fbl\u00e9e",
        "plain.png": "caf\u00e9",
    }
    assert all(s.note for s in skips) and len(skips) == 2  # notes, not skipped images
    (ansi,) = [s for s in skips if s.path.name == "ansi.txt"]
    assert "not UTF-8" in ansi.reason and "Windows-1252" in ansi.reason and "save it as UTF-8" in ansi.reason
    (meta,) = [s for s in skips if "metadata.csv" in s.line()]
    assert "not UTF-8" in meta.reason and "Windows-1252" in meta.reason


def test_a_huge_caption_is_cut_at_read_time_with_one_note(tmp_path: Path) -> None:
    """A 10 MB caption (a log pasted by mistake) is cut to MAX_CAPTION_CHARS: far more than any text encoder reads,
    so what the encoder sees is unchanged, but nothing downstream tokenizes, hashes or prints megabytes."""
    _touch(tmp_path, "huge.png", "meta.png", "short.png")
    (tmp_path / "huge.txt").write_text("word " * 2_000_000)
    (tmp_path / "short.txt").write_text("a short caption")
    (tmp_path / "metadata.jsonl").write_text(json.dumps({"file_name": "meta.png", "text": "tag, " * 10_000}) + "\n")
    items, skips = scan([ImageFolder(str(tmp_path))])
    captions = {i.image.name: i.caption for i in items}
    assert len(captions["huge.png"]) == 20_000 and captions["huge.png"].startswith("word word ")
    assert len(captions["meta.png"]) == 20_000 and captions["short.png"] == "a short caption"
    from lightning_lora.data.captions import MAX_CAPTION_CHARS

    assert MAX_CAPTION_CHARS == 20_000
    assert len(skips) == 2 and all(s.note for s in skips)
    (huge,) = [s for s in skips if s.path.name == "huge.txt"]
    assert "9,999,999 characters" in huge.reason and "first 20,000" in huge.reason
    (meta,) = [s for s in skips if "metadata.jsonl:1" in s.line()]
    assert "meta.png" in meta.reason and "first 20,000" in meta.reason


def test_file_names_that_are_not_utf8_are_hashed_and_shown(tmp_path: Path) -> None:
    """A name with a byte that is not UTF-8 (Latin-1 names from old cameras and Windows archives): the validation
    split hashes its raw bytes, and every message shows the byte as \\xNN (printable under a strict UTF-8 locale)."""
    folder = tmp_path / os.fsdecode(b"f\xf6tos")
    folder.mkdir()
    latin1 = os.fsdecode(b"caf\xe9.png")
    (folder / latin1).write_bytes(b"")
    (folder / os.fsdecode(b"caf\xe9.txt")).write_text("a cafe")
    _touch(folder, "plain.png", os.fsdecode(b"\xff.svg"))
    items, skips = scan([ImageFolder(str(folder))], default_caption="x")
    assert sorted(i.image.name for i in items) == sorted([latin1, "plain.png"])
    train, val = split_validation(items, 0.5)  # used to raise UnicodeEncodeError
    assert len(train) == len(val) == 1
    assert split_validation(items, 0.5) == (train, val)
    from lightning_lora.data.sources import display

    shown = display(folder / latin1)
    assert shown.endswith("f\\xf6tos/caf\\xe9.png") and shown.encode("utf-8")
    (svg,) = skips
    assert svg.line().startswith(display(folder)) and "\\xff.svg" in svg.line()
    assert svg.line().encode("utf-8")  # strict: no surrogate escapes left
    assert display("caf\u00e9.png") == "caf\u00e9.png"  # valid names are shown as they are


def test_validation_split_of_ordinary_names_never_moves(tmp_path: Path) -> None:
    """The split decides which images existing runs train on: hashing raw bytes leaves every UTF-8 name's hash as
    it was (these values were recorded before the change)."""
    items = [Item(tmp_path / "set" / f"img{i:03d}.png", "c") for i in range(40)]
    held = [v.image.name for v in split_validation(items, 0.2)[1]]
    assert held == [f"img{i:03d}.png" for i in (1, 7, 12, 15, 18, 19, 20, 24, 29, 33, 38)]
    from lightning_lora.data.sources import _name_hash

    recorded = {
        "set/img000.png": "0x1.d853b0190e18bp-1",
        "fotos/caf\u00e9.jpg": "0x1.625c1314d197cp-1",
        "\u00dcn\u00efc\u00f6d\u00e9/\u5199\u771f.png": "0x1.ecd6d4d811f77p-2",
    }
    for name, value in recorded.items():
        assert _name_hash(Item(tmp_path / name, "c")) == float.fromhex(value), name


def test_every_format_pillow_reads_is_used_and_the_others_are_named(tmp_path: Path) -> None:
    """GIF, TIFF, JFIF, AVIF... are images too; a known image format this installation cannot read (HEIC, camera
    RAW, SVG) is listed with what to do; other files (captions, videos, documents) are ignored without a word."""
    from lightning_lora.data.sources import IMAGE_EXTENSIONS

    readable = ["anim.gif", "scan.tif", "page.TIFF", "photo.jfif", "old.pcx", "tex.tga", "d.png"]
    named = ["phone.heic", "raw.CR2", "raw.nef", "raw.dng", "logo.svg", "photo.jxl"]
    _touch(tmp_path, *readable, *named, "pic.avif", "clip.mp4", "movie.mpg", "data.json", "doc.pdf", "x.h5")
    items, skips = _scan(tmp_path, default_caption="x")
    avif_ok = ".avif" in IMAGE_EXTENSIONS
    assert sorted(i.image.name for i in items) == sorted(readable + (["pic.avif"] if avif_ok else []))
    heic_ok = ".heic" in IMAGE_EXTENSIONS  # only with the pillow-heif plugin installed
    assert set(skips) == set(named) - ({"phone.heic"} if heic_ok else set()) | (set() if avif_ok else {"pic.avif"})
    if not heic_ok:
        assert "HEIC" in skips["phone.heic"] and "pip install pillow-heif" in skips["phone.heic"]
        assert "JPEG" in skips["phone.heic"]
    assert "camera RAW" in skips["raw.CR2"] and "camera RAW" in skips["raw.nef"] and "camera RAW" in skips["raw.dng"]
    assert "SVG" in skips["logo.svg"] and "PNG" in skips["logo.svg"]
    assert "JPEG XL" in skips["photo.jxl"]
    assert all(ext.startswith(".") and ext == ext.lower() for ext in IMAGE_EXTENSIONS)
    assert {".gif", ".tif", ".tiff", ".jpg", ".png", ".webp", ".bmp"} <= set(IMAGE_EXTENSIONS)
    assert not {".eps", ".ps", ".pdf", ".mpg", ".h5"} & set(IMAGE_EXTENSIONS)  # need Ghostscript, or not pixels
    # A folder of nothing but unreadable formats says so instead of "no images".
    only = tmp_path / "only"
    _touch(only, "a.cr2")
    with pytest.raises(ConfigError, match=r"(?s)holds no images.*a\.cr2.*camera RAW"):
        _scan(only)


def test_a_pillow_without_avif_names_avif_files(monkeypatch: pytest.MonkeyPatch) -> None:
    from PIL import features

    from lightning_lora.data import images

    check = features.check_module
    monkeypatch.setattr(features, "check_module", lambda name: False if name == "avif" else check(name))
    extensions = images._readable_formats()
    assert ".avif" not in extensions and extensions[".png"] == "PNG" and extensions[".gif"] == "GIF"
    assert "AVIF" in images.UNREADABLE[".avif"] and "pillow" in images.UNREADABLE[".avif"].lower()


def test_links_and_metadata_rows_that_match_no_image_are_named(tmp_path: Path) -> None:
    _touch(tmp_path, "good.png")
    (tmp_path / "link.png").symlink_to("good.png")  # a link to an image is an image
    (tmp_path / "dangling.png").symlink_to("gone.png")
    (tmp_path / "loop.jpg").symlink_to("loop.jpg")
    (tmp_path / "notes.txt").symlink_to("missing.txt")  # not an image name: not our business
    rows = [
        {"file_name": "good.png", "text": "good"},
        {"file_name": "./link.png", "text": "linked"},
        {"file_name": "../../x.png", "text": "outside"},
        {"file_name": "missing.png", "text": "nothing"},
        {"file_name": "sub/y.png", "text": "nested"},
        {"file_name": "dangling.png", "text": "named once, as a broken link"},
    ]
    (tmp_path / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    items, skips = scan([ImageFolder(str(tmp_path))])
    assert [(i.image.name, i.caption) for i in items] == [("good.png", "good"), ("link.png", "linked")]
    by_name = {s.path.name: s for s in skips if not s.note}
    assert set(by_name) == {"dangling.png", "loop.jpg"}
    assert by_name["dangling.png"].kind == "broken link"
    assert by_name["dangling.png"].reason == "broken symbolic link (target gone.png does not exist)"
    assert by_name["loop.jpg"].kind == "broken link" and "symbolic link loop" in by_name["loop.jpg"].reason
    notes = sorted(s.reason for s in skips if s.note)
    assert notes == [
        "metadata.jsonl:3: names ../../x.png, which is outside this folder",
        "metadata.jsonl:4: names missing.png, which is not an image in this folder",
        "metadata.jsonl:5: names sub/y.png, which is not an image in this folder (subfolders are not searched)",
    ]
    assert all(s.kind == "metadata" and s.path == tmp_path for s in skips if s.note)


def test_a_binary_file_named_like_a_caption_is_no_caption(tmp_path: Path) -> None:
    """A PNG saved as ``photo.txt`` (NUL bytes) or a file of control characters is no caption, in any encoding: it is
    named, and the image takes the default caption or the trigger word alone, as without a caption file; without
    either the image is skipped. Text with a few control characters (an escape sequence pasted in) stays a caption.
    """
    import io

    from PIL import Image

    png = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 10, 10)).save(png, format="PNG")
    _touch(tmp_path, "photo.png", "noise.png", "escape.png")
    (tmp_path / "photo.txt").write_bytes(png.getvalue())
    (tmp_path / "noise.txt").write_bytes(bytes(range(1, 32)) * 4)  # control characters, no NUL
    (tmp_path / "escape.txt").write_bytes(b"\x1b[1ma red hat\x1b[0m on a beach")
    items, skips = _scan(tmp_path)
    assert [(i.image.name, i.caption) for i in items] == [("escape.png", "\x1b[1ma red hat\x1b[0m on a beach")]
    assert "photo.txt is not a caption" in skips["photo.png"] and "NUL bytes" in skips["photo.png"]
    assert "noise.txt is not a caption" in skips["noise.png"] and "control characters" in skips["noise.png"]
    assert "data.default_caption" in skips["photo.png"] and "\x89PNG" not in str(items)
    items, all_skips = scan([ImageFolder(str(tmp_path))], default_caption="a photo")
    assert {i.image.name: i.caption for i in items} == {
        "escape.png": "\x1b[1ma red hat\x1b[0m on a beach",
        "noise.png": "a photo",
        "photo.png": "a photo",
    }
    notes = {s.path.name: s for s in all_skips}
    assert notes.keys() == {"photo.txt", "noise.txt"} and all(s.note and s.kind == "not text" for s in all_skips)
    assert "the default caption is used" in notes["photo.txt"].reason
    items, all_skips = scan([ImageFolder(str(tmp_path))], trigger="sks")
    assert {i.image.name: i.caption for i in items}["photo.png"] == ""  # the trigger word alone
    assert all("the trigger word alone is used" in s.reason for s in all_skips)


def test_folder_roles_weights_and_masks_reach_the_items(tmp_path: Path) -> None:
    """A folder entry's role, loss weight and masks: each image gets its mask by file name (another format is fine;
    of two masks of one name the first in file-name order), an image without one is noted, a mask that matches no image
    is noted; ``masks: alpha`` marks every image; a regularization folder keeps its captions without
    ``data.trigger`` (its own ``trigger`` still applies)."""
    _touch(tmp_path / "me", "a.png", "b.jpg", "c.png")
    _touch(tmp_path / "masks", "a.png", "b.jpg", "b.png", "zzz.webp")
    _touch(tmp_path / "class", "d.png")
    for name in ("a", "b", "c"):
        (tmp_path / "me" / f"{name}.txt").write_text(f"photo {name}")
    (tmp_path / "class" / "d.txt").write_text("a photo of a person")
    folders = [
        ImageFolder(str(tmp_path / "me"), masks=str(tmp_path / "masks"), unmasked_weight=0.1),
        ImageFolder(str(tmp_path / "class"), role="regularization", loss_weight=0.5, repeats=2),
    ]
    items, skips = scan(folders, trigger="sks")
    assert [(i.image.name, i.caption, i.trigger, i.role, i.loss_weight) for i in items] == [
        ("a.png", "photo a", "sks", "train", 1.0),
        ("b.jpg", "photo b", "sks", "train", 1.0),
        ("c.png", "photo c", "sks", "train", 1.0),
        ("d.png", "a photo of a person", None, "regularization", 0.5),
    ]
    masks = {i.image.name: i.mask for i in items}
    expected = {"a.png": tmp_path / "masks" / "a.png", "b.jpg": tmp_path / "masks" / "b.jpg", "c.png": None}
    assert masks == {**expected, "d.png": None} and items[0].unmasked_weight == 0.1 and items[3].repeats == 2
    notes = {(s.path.name, s.kind): s.reason for s in skips}
    assert all(s.note for s in skips) and len(skips) == 3
    assert "a second mask named b; b.jpg is used" in notes[("b.png", "mask")]
    assert "matches no image of its folder" in notes[("zzz.webp", "unmatched mask")]
    assert "no mask named c in " in notes[("c.png", "no mask")] and "trained everywhere" in notes[("c.png", "no mask")]
    own = [ImageFolder(str(tmp_path / "class"), role="regularization", trigger="ohwx")]
    assert [i.trigger for i in scan(own, trigger="sks")[0]] == ["ohwx"]
    alpha, _ = scan([ImageFolder(str(tmp_path / "me"), masks="alpha")])
    assert {i.mask for i in alpha} == {"alpha"}


def test_a_mask_folder_that_is_missing_empty_or_the_image_folder_is_refused_in_one_line(tmp_path: Path) -> None:
    _touch(tmp_path / "me", "a.png")
    _touch(tmp_path / "empty", "notes.txt")
    _touch(tmp_path / "others", "b.png", "c.png")
    cases = {
        str(tmp_path / "others"): "holds 2 masks, none named like an image of the folder (e.g. b.png); a mask has its",
        str(tmp_path / "nowhere"): "is not a folder. Check the path (or write masks: alpha",
        str(tmp_path / "empty"): "holds no masks (",
        str(tmp_path / "me"): "is the image folder itself",
    }
    for masks, message in cases.items():
        with pytest.raises(ConfigError, match=re.escape(message)) as refused:
            scan([ImageFolder(str(tmp_path / "me"), masks=masks)])
        assert "\n" not in str(refused.value) and str(refused.value).startswith("data.images: the masks of ")


def test_a_regularization_folder_without_images_is_refused_in_one_line(tmp_path: Path) -> None:
    _touch(tmp_path / "me", "a.png")
    _touch(tmp_path / "class", "notes.txt")
    (tmp_path / "me" / "a.txt").write_text("a photo")
    folders = [ImageFolder(str(tmp_path / "me")), ImageFolder(str(tmp_path / "class"), role="regularization")]
    with pytest.raises(ConfigError, match=r"data.images: the regularization folder '.*class' holds no images") as e:
        scan(folders)
    assert "\n" not in str(e.value)


def test_without_trigger_takes_the_trigger_out_or_puts_the_class_word_in() -> None:
    assert without_trigger("sks, a photo of a dog", "sks") == "a photo of a dog"
    assert without_trigger("a photo of sks", "sks", "dog") == "a photo of dog"
    assert without_trigger("tag1, sks, tag2", "sks") == "tag1, tag2"
    assert without_trigger("sks", "sks") == "" and without_trigger("sks", "sks", "person") == "person"
    assert without_trigger("sksy and sks.", "sks") == "sksy and ."  # whole words only
    assert without_trigger("a,b", "sks") == "a,b"  # nothing else changes
