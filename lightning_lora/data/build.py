"""From found images to a complete cache: plan the entries, encode what is missing, report what happened.

:func:`plan` turns each :class:`~lightning_lora.data.sources.Item` into :class:`CacheEntry` s without decoding any
pixels: the content hash and viewed size come from the memo (or one header read and one hash), the bucket and crop
from :class:`~lightning_lora.data.buckets.BucketSpec` (one entry per resolution the image is used at), and the keys
from the cache. A training entry has an optional mirrored latent and one text per caption variant; a validation
entry has neither (it is evaluated as written).

:func:`build` runs the plan, encodes the latents that are missing (images that turn out not to decode are skipped),
then the masks that are missing (at each latent's grid, :meth:`~lightning_lora.data.cache.LatentCache.encode_masks`),
then the texts that are missing (always including the empty prompt, which caption dropout needs), and returns a
:class:`CacheReport`: what was found, encoded, reused, skipped and why, the notes (findings that leave no image out:
see :mod:`lightning_lora.data.sources`), the buckets, and the time. Each skip and note is also logged once.

**Roles.** An entry is a ``train`` image, a ``regularization`` image (its folder's ``role``), or, with
``model.preservation.every_image``, a ``preservation`` entry: a training image again (the same latents) with its
captions' trigger removed (:func:`~lightning_lora.data.captions.without_trigger`), weighted by
``model.preservation.weight``, without a mask (it keeps the whole image as the base draws it). The summary counts each
kind, and the images with a mask, without one, and the masks that matched no image: whether masks are used is never a
guess.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

import torch

from lightning_lora.data.buckets import BucketSpec, Placement
from lightning_lora.data.cache import ImageIndex, LatentCache, LatentJob, MaskJob, readable
from lightning_lora.data.captions import apply_trigger, tag_variants, without_trigger
from lightning_lora.data.images import BadImage, has_alpha
from lightning_lora.data.sources import ALPHA, Item, Skip, display
from lightning_lora.errors import ConfigError, first_line
from lightning_lora.objectives import Preservation, SampleRole

__all__ = [
    "CacheEntry",
    "CacheReport",
    "DataSpec",
    "EntryMask",
    "build",
    "entry_texts",
    "missing_jobs",
    "missing_masks",
    "plan",
    "usable",
]

log = logging.getLogger(__name__)

OnBadFile = Literal["skip", "error"]


@dataclass(frozen=True)
class DataSpec:
    """What the data options decide about the cached tensors."""

    buckets: BucketSpec
    flip: bool = False
    caption_variants: int = 1
    keep_tokens: int = 0
    background: tuple[int, int, int] = (255, 255, 255)
    preservation: Preservation = field(default_factory=Preservation)
    """``model.preservation``: with ``every_image``, the preservation entries and their captions."""


@dataclass(frozen=True)
class EntryMask:
    """An entry's mask: its ``source`` (a mask file, or the image itself for its ``alpha`` channel), the sha256 of its
    bytes and its viewed size, the cache keys of the mask of the plain and the mirrored latent, and the loss weight
    outside it."""

    source: Path
    digest: str
    size: tuple[int, int]
    alpha: bool
    key: str
    flip_key: str | None
    unmasked_weight: float = 0.0

    def keys(self) -> list[str]:
        return [self.key] + ([self.flip_key] if self.flip_key else [])


@dataclass(frozen=True)
class CacheEntry:
    """One training (or validation) sample: an image at one resolution, and its cached tensors' keys."""

    image: Path
    caption: str  # as trained: trigger applied, tags as written
    resolution: int
    placement: Placement
    latent_key: str
    flip_key: str | None
    texts: tuple[str, ...]  # [0] is `caption`; the others are shuffled tag variants
    text_keys: tuple[str, ...]  # the cache keys of `texts`
    digest: str  # sha256 of the image's bytes the latent keys were made from
    repeats: int = 1
    role: SampleRole = "train"
    loss_weight: float = 1.0
    mask: EntryMask | None = None

    @property
    def bucket(self) -> tuple[int, int]:
        return self.placement.bucket

    def latent_keys(self) -> list[str]:
        return [self.latent_key] + ([self.flip_key] if self.flip_key else [])

    def mask_jobs(self, cache: LatentCache) -> list[MaskJob]:
        """The jobs that compute this entry's masks (none without a mask): the image's crop box, scaled to the mask's
        size, at the grid of each of its latents."""
        if self.mask is None:
            return []
        m, p = self.mask, self.placement
        sx, sy = m.size[0] / p.original[0], m.size[1] / p.original[1]
        left, top, right, bottom = p.source_box()
        box = (left * sx, top * sy, right * sx, bottom * sy)
        pairs = [(self.latent_key, m.key, False)] + ([(self.flip_key, m.flip_key, True)] if self.flip_key else [])
        return [
            MaskJob(self.image, m.source, m.digest, m.alpha, box, latent, key, flipped)
            for latent, key, flipped in pairs
            if key is not None
        ]


def entry_texts(item: Item, spec: DataSpec, validation: bool = False) -> list[str]:
    """The texts an item is trained with: its caption variants with the trigger applied; [0] as written."""
    raw = [item.caption] if validation else tag_variants(item.caption, spec.caption_variants, spec.keep_tokens)
    return list(dict.fromkeys(apply_trigger(r, item.trigger) for r in raw))


def plan(
    cache: LatentCache,
    items: Sequence[Item],
    spec: DataSpec,
    index: ImageIndex,
    *,
    validation: bool = False,
    threads: int = 8,
) -> tuple[list[CacheEntry], list[Skip]]:
    """Entries of ``items`` (no pixels decoded) and the images that cannot be used (unreadable, too small)."""

    def lookup(item: Item) -> tuple[tuple[str, tuple[int, int]], _Mask | None] | BadImage:  # the image, its mask
        try:
            found = index.lookup(item.image)
        except BadImage as e:
            return e
        try:
            return found, _mask_of(item, found, index)
        except BadImage as e:
            name = item.image.name if item.mask == ALPHA else item.mask.name  # type: ignore[union-attr]
            return BadImage(f"mask: {e.kind}", f"its mask {display(name)}: {e.reason}; fix the mask or remove it")

    with ThreadPoolExecutor(max_workers=threads) as pool:  # hashing and header reads wait on the disk
        looked_up = list(pool.map(lookup, items))
    entries: list[CacheEntry] = []
    skips: list[Skip] = []
    twins = spec.preservation.every_image and not validation
    for item, found in zip(items, looked_up, strict=True):
        if isinstance(found, BadImage):
            skips.append(Skip(item.image, found.kind, found.reason))
            continue
        (digest, (width, height)), mask = found
        if item.mask == ALPHA and mask is None:
            skips.append(Skip(item.image, "no mask", "has no transparency (masks: alpha): trained everywhere"))
        placements, reason = spec.buckets.place(width, height)
        if reason is not None:
            skips.append(Skip(item.image, "too small", reason))
            continue
        texts = entry_texts(item, spec, validation)
        text_keys = tuple(cache.text_key(t) for t in texts)
        for resolution, p in placements:
            latent_key = cache.latent_key(digest, p, False, spec.background)
            flip_key = cache.latent_key(digest, p, True, spec.background) if spec.flip and not validation else None
            entry = CacheEntry(
                image=item.image,
                caption=texts[0],
                resolution=resolution,
                placement=p,
                latent_key=latent_key,
                flip_key=flip_key,
                texts=tuple(texts),
                text_keys=text_keys,
                digest=digest,
                repeats=1 if validation else item.repeats,
                role=item.role,
                loss_weight=item.loss_weight,
                mask=mask.keyed(cache, latent_key, flip_key, item.unmasked_weight) if mask is not None else None,
            )
            entries.append(entry)
            if twins and item.role == "train" and item.trigger:
                entries.append(_preservation_entry(cache, entry, item.trigger, spec.preservation))
    return entries, skips


@dataclass(frozen=True)
class _Mask:
    """An item's mask as planned, before its keys: its file, the sha256 of its bytes, its viewed size, alpha or not."""

    source: Path
    digest: str
    size: tuple[int, int]
    alpha: bool

    def keyed(self, cache: LatentCache, latent_key: str, flip_key: str | None, unmasked_weight: float) -> EntryMask:
        key = cache.mask_key(self.digest, self.alpha, latent_key)
        flip = cache.mask_key(self.digest, self.alpha, flip_key) if flip_key else None
        return EntryMask(self.source, self.digest, self.size, self.alpha, key, flip, unmasked_weight)


def _mask_of(item: Item, image: tuple[str, tuple[int, int]], index: ImageIndex) -> _Mask | None:
    """The mask of ``item`` (``image``: its digest and viewed size), or None: no mask, or ``masks: alpha`` and an image
    without transparency (counted as an image without a mask). Raises :class:`BadImage` for a mask it cannot read."""
    if item.mask is None:
        return None
    if item.mask == ALPHA:
        return _Mask(item.image, image[0], image[1], True) if has_alpha(item.image) else None
    assert isinstance(item.mask, Path)
    digest, size = index.lookup(item.mask)
    return _Mask(item.mask, digest, size, False)


def _preservation_entry(cache: LatentCache, entry: CacheEntry, trigger: str, preservation: Preservation) -> CacheEntry:
    """``entry`` as a preservation sample (``every_image``): its captions without the trigger, its weight, no mask."""
    texts = list(dict.fromkeys(without_trigger(t, trigger, preservation.class_word) for t in entry.texts))
    return replace(
        entry,
        caption=texts[0],
        texts=tuple(texts),
        text_keys=tuple(cache.text_key(t) for t in texts),
        role="preservation",
        loss_weight=preservation.weight,
        mask=None,
    )


def missing_jobs(cache: LatentCache, entries: Sequence[CacheEntry]) -> tuple[list[LatentJob], int]:
    """Jobs for the latent files that are missing or unreadable, and the number of files reused."""
    jobs: dict[tuple[Path, Placement], LatentJob] = {}
    seen: set[str] = set()
    reused = 0
    for e in entries:
        plain = flip = None
        for key in e.latent_keys():
            if key in seen:
                continue
            seen.add(key)
            if readable(cache.latent_path(key)):
                reused += 1
            elif key == e.latent_key:
                plain = key
            else:
                flip = key
        if plain or flip:
            old = jobs.get((e.image, e.placement))
            if old is not None:  # the same file listed twice (e.g. as training and validation image)
                plain, flip = plain or old.plain_key, flip or old.flip_key
            jobs[(e.image, e.placement)] = LatentJob(e.image, e.placement, plain, flip, e.digest)
    return list(jobs.values()), reused


def missing_masks(cache: LatentCache, entries: Sequence[CacheEntry]) -> tuple[list[MaskJob], int]:
    """Jobs for the mask files that are missing or unreadable, and the number of files reused."""
    jobs: dict[str, MaskJob] = {}
    for e in entries:
        for job in e.mask_jobs(cache):
            jobs.setdefault(job.key, job)
    missing = [j for j in jobs.values() if not readable(cache.mask_path(j.key))]
    return missing, len(jobs) - len(missing)


def usable(cache: LatentCache, entries: Sequence[CacheEntry]) -> list[CacheEntry]:
    """The entries whose latent (and mask) files are all in the cache (the others were skipped when building)."""
    return [
        e
        for e in entries
        if all(readable(cache.latent_path(k)) for k in e.latent_keys())
        and (e.mask is None or all(readable(cache.mask_path(k)) for k in e.mask.keys()))
    ]


@dataclass
class CacheReport:
    """What a cache build found and did; :meth:`format` is the summary printed after it."""

    root: Path
    images: int = 0  # image files found, training and validation
    validation_images: int = 0
    train: list[CacheEntry] = field(default_factory=list)
    validation: list[CacheEntry] = field(default_factory=list)
    latents_encoded: int = 0
    latents_reused: int = 0
    images_encoded: int = 0
    texts_encoded: int = 0
    texts_reused: int = 0
    masks_encoded: int = 0
    masks_reused: int = 0
    masks_configured: bool = False  # a folder has masks (then the summary counts them, also when none matched)
    skipped: list[Skip] = field(default_factory=list)
    seconds: float = 0.0
    encode_seconds: float = 0.0

    @property
    def buckets(self) -> Counter[tuple[int, int]]:
        """Training images per bucket (an image used at two resolutions counts in both)."""
        return Counter(e.bucket for e in self.train)

    @property
    def images_per_second(self) -> float:
        return self.images_encoded / self.encode_seconds if self.encode_seconds > 0 else 0.0

    def format(self) -> str:
        bad = [s for s in self.skipped if not s.note]
        notes = [s for s in self.skipped if s.note]
        train = [e for e in self.train if e.role == "train"]
        lines = [
            f"Cache {display(self.root)}",
            f"  images found:    {self.images}"
            + (f" ({self.validation_images} held out for validation)" if self.validation_images else ""),
            f"  training:        {len({e.image for e in train})} images, {len(train)} entries (image x resolution), "
            f"{sum(e.repeats for e in train)} samples per epoch (with repeats)"
            + (f"; {len({e.image for e in self.validation})} validation images" if self.validation else ""),
            *self._roles(),
            f"  latents:         {self.latents_encoded} encoded, {self.latents_reused} reused",
            f"  text embeddings: {self.texts_encoded} encoded, {self.texts_reused} reused",
            *self._masks(),
            *_listed("skipped:        ", bad, always=True),
            *_listed("notes:          ", notes),
        ]
        buckets = sorted(self.buckets.items(), key=lambda kv: (kv[0][0] * kv[0][1], kv[0]))
        lines.append("  buckets:         " + ", ".join(f"{w}x{h}: {n}" for (w, h), n in buckets))
        rate = f", {self.images_per_second:.1f} images/s encoded" if self.images_encoded else ""
        lines.append(f"  time:            {self.seconds:.1f} s{rate}")
        return "\n".join(lines)

    def _roles(self) -> list[str]:
        """The lines of the regularization and preservation samples (none without them)."""
        lines = []
        regularization = [e for e in self.train if e.role == "regularization"]
        if regularization:
            weights = ", ".join(f"{w:g}" for w in sorted({e.loss_weight for e in regularization}))
            lines.append(
                f"  regularization:  {len({e.image for e in regularization})} images, "
                f"{sum(e.repeats for e in regularization)} samples per epoch (loss weight {weights})"
            )
        preservation = [e for e in self.train if e.role == "preservation"]
        if preservation:
            lines.append(
                f"  preservation:    {len(preservation)} entries with the trigger taken out of the caption, "
                f"{sum(e.repeats for e in preservation)} samples per epoch "
                f"(loss weight {preservation[0].loss_weight:g})"
            )
        return lines

    def _masks(self) -> list[str]:
        """The line that counts the masks (none when no folder has masks)."""
        if not self.masks_configured:
            return []
        masked = len({e.image for e in self.train if e.mask is not None})
        without = len({s.path for s in self.skipped if s.kind == "no mask"})
        unmatched = sum(1 for s in self.skipped if s.kind == "unmatched mask")
        return [
            f"  masks:           {masked} images with a mask, {without} without (trained everywhere), "
            f"{unmatched} mask{'s' if unmatched != 1 else ''} matched no image; {self.masks_encoded} computed, "
            f"{self.masks_reused} reused"
        ]


def _listed(title: str, skips: Sequence[Skip], always: bool = False, shown: int = 20) -> list[str]:
    """``title count (n kind, ...)`` and the first ``shown`` lines (nothing when there are none, unless ``always``)."""
    if not skips and not always:
        return []
    kinds = Counter(s.kind for s in skips)
    counts = " (" + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())) + ")" if skips else ""
    lines = [f"  {title} {len(skips)}{counts}"] + [f"    {s.line()}" for s in skips[:shown]]
    if len(skips) > shown:
        lines.append(f"    ... and {len(skips) - shown} more (each is in the log above)")
    return lines


def _fatal(skips: Sequence[Skip]) -> ConfigError:
    shown = "\n".join(f"  {s.line()}" for s in skips[:20])
    more = f"\n  ... and {len(skips) - 20} more" if len(skips) > 20 else ""
    return ConfigError(
        f"data.on_bad_file is 'error' and {len(skips)} file(s) cannot be used:\n{shown}{more}\n"
        "Fix or remove them, or set data.on_bad_file: skip to leave them out."
    )


def build(
    cache: LatentCache,
    train_items: Sequence[Item],
    validation_items: Sequence[Item],
    spec: DataSpec,
    device: torch.device,
    *,
    scan_skips: Sequence[Skip] = (),
    batch_size: int = 4,
    workers: int = 0,
    on_bad_file: OnBadFile = "skip",
    progress: bool = False,
) -> CacheReport:
    """Encode whatever is missing for these items; see the module docstring. Raises :class:`ConfigError` when no
    training image is usable, or on any skip with ``on_bad_file="error"``."""
    start = time.perf_counter()
    report = CacheReport(root=cache.root, images=len(train_items) + len(validation_items))
    report.validation_images = len(validation_items)
    cache.remove_stale_temporaries()
    index = ImageIndex(cache.root)
    train, skips = plan(cache, train_items, spec, index)
    validation, val_skips = plan(cache, validation_items, spec, index, validation=True)
    cache.root.mkdir(parents=True, exist_ok=True)
    index.save()
    report.skipped = [*scan_skips, *skips, *val_skips]
    report.images += sum(1 for s in scan_skips if not s.note and s.kind != "empty folder")
    fatal = [s for s in report.skipped if not s.note]
    if on_bad_file == "error" and fatal:
        raise _fatal(fatal)

    jobs, report.latents_reused = missing_jobs(cache, [*train, *validation])
    try:
        encoded = cache.encode_latents(
            jobs, device, batch_size=batch_size, workers=workers, background=spec.background, progress=progress
        )
    except torch.OutOfMemoryError as e:
        raise ConfigError(
            f"data.encode_batch_size: out of GPU memory while encoding images with the VAE, {batch_size} at a time "
            f"({first_line(e, 160)}). Lower data.encode_batch_size (1 needs the least); the latents written so far "
            "stay in the cache and are reused by the next run."
        ) from None
    report.latents_encoded, report.images_encoded, report.encode_seconds = (
        encoded.written,
        encoded.encoded,
        encoded.seconds,
    )
    report.skipped += encoded.skips
    if on_bad_file == "error" and encoded.skips:
        raise _fatal(encoded.skips)
    bad = {s.path for s in encoded.skips}
    train = [e for e in train if e.image not in bad]
    validation = [e for e in validation if e.image not in bad]
    report.masks_configured = any(i.mask is not None for i in [*train_items, *validation_items]) or any(
        s.kind == "unmatched mask" for s in report.skipped
    )
    mask_jobs, report.masks_reused = missing_masks(cache, [*train, *validation])
    masks = cache.encode_masks(mask_jobs, threads=max(1, workers))
    report.masks_encoded = masks.written
    report.skipped += masks.skips
    if on_bad_file == "error" and masks.skips:
        raise _fatal(masks.skips)
    bad = {s.path for s in masks.skips}
    report.train = [e for e in train if e.image not in bad]
    report.validation = [e for e in validation if e.image not in bad]
    for s in report.skipped:
        log.warning("%s", f"note: {s.line()}" if s.note else f"skipped {s.line()}")
    if not report.train:
        kinds = Counter(s.kind for s in report.skipped if not s.note and s.kind != "empty folder")
        why = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())) or "no images"
        raise ConfigError(
            f"data.images: none of the images can be used for training ({why}); the lines above name each file and "
            "the reason."
        )
    if any(i.role == "regularization" for i in train_items) and not any(
        e.role == "regularization" for e in report.train
    ):
        raise ConfigError(
            "data.images: none of the regularization images can be used (the lines above name each file and the "
            "reason); fix them, or remove the regularization folder (and model.preservation)."
        )

    texts: dict[str, str] = {cache.text_key(""): ""}
    for entry in [*report.train, *report.validation]:
        texts.update(zip(entry.text_keys, entry.texts, strict=True))
    missing = cache.missing_texts(texts.values())
    try:
        encoded_texts = cache.encode_texts(missing, device, batch_size, progress=progress)
    except torch.OutOfMemoryError as e:
        mode = cache.text_encoder_quantization
        fix = (
            "Set data.text_encoder_quantization: nf4 (or fp8) to hold the text encoders in 4 (8) bits while caching"
            if mode == "none"
            else f"The text encoders are already in {mode}; lower data.encode_batch_size, or cache on a larger GPU "
            "(`lightning-lora cache`) and train here"
        )
        raise ConfigError(
            f"data.text_encoder_quantization: out of GPU memory while encoding captions with the text encoders "
            f"({first_line(e, 160)}). {fix}. The embeddings written so far stay in the cache."
        ) from None
    report.texts_encoded = encoded_texts.encoded
    if encoded_texts.truncated:
        entries = [*report.train, *report.validation]
        note = _truncation_note(cache.root, entries, encoded_texts.truncated, encoded_texts.limit)
        report.skipped.append(note)
        log.warning("note: %s", note.line())
    report.texts_reused = len(texts) - len(missing)
    report.seconds = time.perf_counter() - start
    return report


def _truncation_note(root: Path, entries: Sequence[CacheEntry], truncated: Sequence[str], limit: str) -> Skip:
    """One note for all the captions the text encoder cuts, naming an image whose caption is one of them."""
    owner = {t: e.image for e in reversed(entries) for t in e.texts}  # the first entry with the text wins
    first, n = truncated[0], len(truncated)
    start = " ".join(first[:60].split())
    return Skip(
        owner.get(first, root),
        "over token limit",
        f"{n} caption{'s are' if n > 1 else ' is'} longer than the text encoder reads ({limit}) and cut there (the "
        f'rest is not trained on); e.g. this image\'s: "{start}..."',
    )
