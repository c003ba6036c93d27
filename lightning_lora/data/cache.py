"""The latent cache: VAE latents and text embeddings computed once, stored as safetensors, keyed by content.

Training never runs the VAE or the text encoders: every (image, bucket, crop, flip) is encoded once into normalized
latents, every distinct caption text once into the family's text embeddings, and the files are reused by every
later run and epoch.

Keys are content hashes of everything that determines the tensor:

* latents: the image file's bytes, the placement (original size, bucket, resized size, crop), the flip, the decoding
  rule and alpha background, the VAE's identity (files, dtype) and the family;
* text: the exact text (after trigger and tag shuffling), the identity and dtype of the text encoders the family
  declares (``architecture.text_encoders`` of :class:`~lightning_lora.families.base.DiffusionFamily`), and the family's
  text options (e.g. T5 length); for an edit family whose prompt encoder sees the control images
  (``editing.prompt_sees_controls``: Qwen-Image-Edit's vision-language model), the controls' pixels too
  (:meth:`ControlImage.identity`): one entry per (caption, controls) pair.

* masks (``data.images[].masks``): the mask file's bytes (or, for ``masks: alpha``, the image's), whether it is an
  alpha channel, the mask rule, and the key of the latent it weighs (which fixes its grid, crop and flip).

A control image (edit training) is cached like a target: its latent under its own key (its bytes and placement), so
editing a control re-encodes only it, and a control shared by two targets is encoded once.

A mask is its own small entry rather than part of its latent's key: editing, adding or removing a mask recomputes only
that mask (a box resize on the CPU, no VAE), and the image's latents stay as they are.

So editing one caption re-encodes only that caption, editing one image only that image's entries, changing the
resolution or buckets only the images whose placement changed, swapping the model everything that depends on it;
and a stale tensor is never served: a changed input has a new key. Files are written atomically (temporary file,
fsync, rename; see :mod:`lightning_lora.io`), so a killed build leaves whole files only and the next build
continues where it stopped; a file that cannot be parsed (a disk error, an old bug) is detected and rebuilt.

Layout::

    <cache_dir>/latents/<key>.safetensors  {"latents": [C, h, w] float32, "original_size": [2], "crop_top_left": [2],
                                            "target_size": [2]}   (int64, (height, width) / (top, left) order)
    <cache_dir>/text/<key>.safetensors     {"prompt_embeds": ..., "pooled_prompt_embeds": ...}   (family-defined)
    <cache_dir>/masks/<key>.safetensors    {"mask": [1, h, w] float32 in [0, 1]}   (the latent's grid)
    <cache_dir>/images.json                memo: path + size + mtime + ctime + inode -> content hash and viewed size

The memo saves reading every image at every start. Like git's index it keys on the change time too (which no tool
can set back), and it distrusts a file changed within two seconds of the memo's own write (a coarse file-system clock
could hide an edit): such files are hashed again.

Encoding is a pipeline: DataLoader worker processes decode and resize (:mod:`lightning_lora.data.images`) while the
main process encodes batches of one bucket on the device and two threads write the files. The VAE is loaded only
when the first image decoded, and the VAE and text encoders are deleted (and the CUDA cache emptied) when done.

**A file replaced during the build.** A latent's key is made from the hash of the image's bytes when the build is
planned; the pixels are decoded later, in a worker. The worker reads the file once, hashes those bytes and decodes
them (never the file again): when the hash is not the planned one, the image was replaced in between (a sync tool,
an editor saving), and it is skipped ("changed while the cache was built") instead of writing other pixels under
the key. The next build plans it afresh.

**Captions longer than the text encoder reads** are cut by the encoder (FLUX's T5 reads ``max_sequence_length``
tokens, CLIP 77). diffusers' pipelines warn about each such batch and print the whole cut-off text (for one huge
caption: minutes and hundreds of megabytes of output); while captions are encoded those warnings are silenced (the
loggers' levels are restored afterwards) and :meth:`LatentCache.encode_texts` counts them instead, through the
family's :meth:`~lightning_lora.families.base.DiffusionFamily.prompt_limit`, for one line in the summary.
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import os
import re
import sys
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file
from torch.utils.data import DataLoader, Dataset

from lightning_lora.data.buckets import Placement
from lightning_lora.data.images import DECODE_RULE, MASK_RULE, BadImage, decode, decode_mask, probe
from lightning_lora.data.sources import Skip, display
from lightning_lora.families.base import DiffusionFamily, ModelSource
from lightning_lora.io import atomic_write_bytes, save_safetensors

__all__ = [
    "ControlImage",
    "EncodeResult",
    "ImageIndex",
    "LatentCache",
    "LatentJob",
    "MaskJob",
    "TextResult",
    "decode_loader",
    "progress_bar",
    "readable",
]

log = logging.getLogger(__name__)

_MEMO_SLACK_NS = 2_000_000_000  # FAT and some network file systems keep modification times in 2 s steps


def _hash(*parts: str | bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p if isinstance(p, bytes) else p.encode())
        h.update(b"\x00")
    return h.hexdigest()[:32]


def file_digest(path: Path) -> str:
    """sha256 of a file's bytes, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def readable(path: Path) -> bool:
    """The file exists and its safetensors header parses and matches its size (a truncated file fails)."""
    if not path.is_file():
        return False
    try:
        with safe_open(path, framework="pt") as f:
            f.keys()
    except (SafetensorError, OSError, RuntimeError):
        log.warning("cache file %s is unreadable; it will be rebuilt", display(path))
        return False
    return True


class ImageIndex:
    """The memo of content hashes and viewed sizes under ``root/images.json`` (see the module docstring)."""

    def __init__(self, root: Path) -> None:
        self.path = root / "images.json"
        self._files: dict[str, list[Any]] = {}
        self._trusted_before = 0
        self._dirty = False
        try:
            data = json.loads(self.path.read_text())
            if data.get("version") != 2:
                raise ValueError("another memo format")
            self._files = dict(data["files"])
            self._trusted_before = int(data["written_ns"]) - _MEMO_SLACK_NS
        except (OSError, ValueError, KeyError, TypeError):
            pass  # no memo yet, or an unreadable one: everything is hashed again

    def lookup(self, path: Path) -> tuple[str, tuple[int, int]]:
        """``(sha256 of the bytes, (width, height) as viewed)``; raises :class:`BadImage`."""
        try:
            st = path.stat()
        except OSError as e:
            raise BadImage("unreadable file", f"cannot read the file ({e.strerror or e})") from e
        name = str(path.resolve())
        # ctime cannot be set back by tools that restore a modification time (cp -p, touch -r, rsync -t).
        signature = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
        record = self._files.get(name)
        recent = max(st.st_mtime_ns, st.st_ctime_ns) >= self._trusted_before
        if record is not None and record[:4] == signature and not recent:
            return str(record[4]), (int(record[5]), int(record[6]))
        size = probe(path)
        try:
            digest = file_digest(path)
        except OSError as e:
            raise BadImage("unreadable file", f"cannot read the file ({e.strerror or e})") from e
        self._files[name] = [*signature, digest, *size]
        self._dirty = True
        return digest, size

    def save(self) -> None:
        if self._dirty:
            data = {"version": 2, "written_ns": time.time_ns(), "files": self._files}
            atomic_write_bytes(self.path, json.dumps(data, separators=(",", ":")).encode())
            self._dirty = False


@dataclass(frozen=True)
class ControlImage:
    """A control image as one target uses it: its file, the sha256 of its bytes, and where it sits (its target's bucket
    and crop)."""

    image: Path
    digest: str
    placement: Placement

    def identity(self, background: tuple[int, int, int], flip: bool = False) -> str:
        """What its pixels are (bytes, placement, decoding rule, background): part of the text key of a prompt that
        sees it."""
        return _hash("pixels", self.digest, _geometry(self.placement, flip, background), DECODE_RULE)

    def pixels(self, background: tuple[int, int, int]) -> np.ndarray:
        """Its pixels as placed, ``uint8 [h, w, 3]``; :class:`BadImage` for a file that no longer decodes (or no
        longer has the planned bytes)."""
        try:
            data = self.image.read_bytes()
        except OSError as e:
            raise BadImage("unreadable file", f"cannot read the file ({e.strerror or e})") from e
        if hashlib.sha256(data).hexdigest() != self.digest:
            raise BadImage("changed", _CHANGED)
        return decode(data, self.placement.source_box(), self.placement.bucket, background)


def _geometry(p: Placement, flip: bool, background: tuple[int, int, int]) -> str:
    return f"{p.original}|{p.bucket}|{p.resized}|{p.crop}|{'flip' if flip else 'plain'}|bg{background}"


@dataclass(frozen=True)
class LatentJob:
    """One image to decode once and encode into up to two entries: as is, and mirrored. ``digest`` is the sha256 of
    the bytes the keys were made from: other bytes are not encoded under them."""

    image: Path
    placement: Placement
    plain_key: str | None
    flip_key: str | None
    digest: str


@dataclass(frozen=True)
class MaskJob:
    """One mask to compute at the grid of the latent ``latent_key``: the ``box`` (in the mask's viewed pixels) of
    ``source`` (a mask image, or the image itself for its ``alpha`` channel; ``digest``: the sha256 of its bytes the key
    was made from), mirrored with ``flipped``. ``image`` is the training image it belongs to (named by a failure)."""

    image: Path
    source: Path
    digest: str
    alpha: bool
    box: tuple[float, float, float, float]
    latent_key: str
    key: str
    flipped: bool


@dataclass
class EncodeResult:
    encoded: int = 0  # images decoded and encoded
    written: int = 0  # latent files written (an image with its mirror counts two)
    skips: list[Skip] = field(default_factory=list)
    seconds: float = 0.0


@dataclass
class TextResult:
    """What :meth:`LatentCache.encode_texts` did."""

    encoded: int = 0  # texts encoded
    truncated: list[str] = field(default_factory=list)  # those longer than the text encoder reads
    limit: str = ""  # what the text encoder reads, e.g. "512 T5 tokens"


_CHANGED = "changed while the cache was built; it is encoded on the next run"


def _read_planned(path: Path, digest: str) -> bytes | None:
    """The bytes of ``path``, read once, or None when their sha256 is not ``digest`` (the file was replaced since the
    build was planned: see the module docstring). Raises :class:`BadImage` for a file that cannot be read."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise BadImage("unreadable file", f"cannot read the file ({e.strerror or e})") from e
    return data if hashlib.sha256(data).hexdigest() == digest else None


class _DecodeJobs(Dataset):
    """DataLoader side of the pipeline: job index -> decoded uint8 pixels, or the reason it failed."""

    def __init__(self, jobs: Sequence[LatentJob], background: tuple[int, int, int]) -> None:
        self.jobs = list(jobs)
        self.background = background

    def __len__(self) -> int:
        return len(self.jobs)

    def __getitem__(self, index: int) -> tuple[int, np.ndarray | None, str, str]:
        job = self.jobs[index]
        try:
            data = _read_planned(job.image, job.digest)
            if data is None:
                return index, None, "changed", _CHANGED
            pixels = decode(data, job.placement.source_box(), job.placement.bucket, self.background)
            return index, pixels, "", ""
        except BadImage as e:
            return index, None, e.kind, e.reason
        except Exception as e:  # a decoder bug on one odd file must not stop the whole build
            return index, None, "cannot decode", f"cannot decode ({type(e).__name__}: {e})"


def _collate(samples: list[tuple[int, np.ndarray | None, str, str]]) -> tuple[list[int], Any, list[tuple]]:
    ok = [(i, px) for i, px, _, _ in samples if px is not None]
    failed = [(i, kind, reason) for i, px, kind, reason in samples if px is None]
    pixels = torch.from_numpy(np.stack([px for _, px in ok])) if ok else None
    return [i for i, _ in ok], pixels, failed


def _chunks(jobs: Sequence[LatentJob], batch_size: int) -> list[list[int]]:
    """Job indices in batches of one bucket, each with at most ``batch_size`` outputs (at least one job)."""
    by_bucket: dict[tuple[int, int], list[int]] = {}
    for i, job in enumerate(jobs):
        by_bucket.setdefault(job.placement.bucket, []).append(i)
    batches: list[list[int]] = []
    for bucket in sorted(by_bucket):
        current: list[int] = []
        outputs = 0
        for i in by_bucket[bucket]:
            n = (jobs[i].plain_key is not None) + (jobs[i].flip_key is not None)
            if current and outputs + n > batch_size:
                batches.append(current)
                current, outputs = [], 0
            current.append(i)
            outputs += n
        if current:
            batches.append(current)
    return batches


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def decode_loader(
    jobs: Sequence[LatentJob],
    batch_size: int,
    workers: int,
    background: tuple[int, int, int] = (255, 255, 255),
    pin_memory: bool = False,
) -> DataLoader:
    """Batches ``(job indices, uint8 pixels [n, h, w, 3], failures)`` of one bucket each, decoded in ``workers``
    processes (0: in this one)."""
    return DataLoader(
        _DecodeJobs(jobs, background),
        batch_sampler=_chunks(jobs, batch_size),
        num_workers=workers,
        collate_fn=_collate,
        pin_memory=pin_memory,
        prefetch_factor=4 if workers > 0 else None,
        # Its own generator: creating the iterator draws a worker seed, and that must not come from the global
        # random state (a run that built its cache would otherwise train differently from one that reused it).
        generator=torch.Generator().manual_seed(0),
    )


@contextmanager
def _quiet_truncation(encoders: Any) -> Iterator[None]:
    """Silence the warnings the pipeline of ``encoders`` (diffusers) and transformers' tokenizers give for a prompt
    longer than the encoder reads, and restore the loggers' levels afterwards (see the module docstring)."""
    loggers = [logging.getLogger(type(encoders).__module__), logging.getLogger("transformers.tokenization_utils_base")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def progress_bar(total: int, desc: str, enabled: bool) -> Any:
    """The cache build's progress bar: on stdout with the command's other lines and the training's bar, shown when
    stdout is a terminal (disable=None: silent in a log and in tests)."""
    from tqdm.auto import tqdm

    unit = "img" if "image" in desc else "text"
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stdout, disable=None if enabled else True)


def quantize_text_encoders(
    encoders: Any, components: Sequence[str], mode: str, device: torch.device, dtype: torch.dtype
) -> int:
    """Store the linear layers of the text encoders ``components`` (the family's ``text_encoders``) of ``encoders``
    (a pipeline holding only its text parts) in ``nf4`` or ``fp8`` on ``device``, so that caching FLUX's 4.7 B-parameter
    T5 fits a small card (bf16: 9.1 GiB; NF4: ~4 GiB). Layers the model keeps in float32 (T5's ``wo``, a fifth of
    T5-XXL) stay unquantized, in the load dtype. Returns how many were swapped."""
    if mode == "none":
        return 0
    from lightning_lora.precision import text_encoder_precision

    swapped = 0
    for name in components:
        component = getattr(encoders, name, None)
        if isinstance(component, torch.nn.Module):
            keep = [rf"(^|\.){re.escape(m)}$" for m in getattr(component, "_keep_in_fp32_modules", None) or []]
            # Frozen and inference-only: the layers left unquantized stay in the load dtype (no fp32 upcast, which for
            # T5's wo alone would be 4 GB).
            swapped += text_encoder_precision(mode, dtype, keep).quantize(component, device)
    return swapped


class LatentCache:
    """Content-keyed cache of latents and text embeddings under ``root``; see the module docstring."""

    def __init__(
        self, root: str | Path, family: DiffusionFamily, source: ModelSource, text_encoder_quantization: str = "none"
    ) -> None:
        self.root = Path(root).expanduser()
        self.family = family
        self.source = source
        self.text_encoder_quantization = text_encoder_quantization
        self._identity: dict[str, str] = {}

    def _identity_of(self, *components: str) -> str:
        # ModelSource.identity stats the component's files: once per cache object, not once per key.
        name = "+".join(components)
        if name not in self._identity:
            self._identity[name] = "".join(self.source.identity(c) for c in components)
        return self._identity[name]

    # -- keys and paths ----------------------------------------------------------------------------------------
    def latent_key(self, digest: str, placement: Placement, flip: bool, background: tuple[int, int, int]) -> str:
        geometry = _geometry(placement, flip, background)
        return _hash("latent", digest, geometry, DECODE_RULE, self._identity_of("vae"), self.family.name)

    def text_key(self, text: str, controls: Sequence[str] = ()) -> str:
        """The key of ``text``'s embeddings; ``controls``: the :meth:`ControlImage.identity` of the control images the
        family's prompt encoder sees with it (``editing.prompt_sees_controls``), none for every other prompt."""
        identity = self._identity_of(
            *self.family.architecture.text_encoders
        )  # the encoders the family's embeddings depend on
        if self.source.is_local:  # a folder's tokenizers can change under the same name (a hub id + revision pin them)
            identity += self._identity_of(*self.family.architecture.tokenizers)
        if self.text_encoder_quantization != "none":  # other embeddings: other keys (plain ones keep theirs)
            identity += f"|{self.text_encoder_quantization}"
        if controls:  # a prompt seen with its control images (the keys of plain prompts stay as they were)
            identity += "|controls:" + ",".join(controls)
        return _hash(text, identity, self.family.text_cache_tag())

    def mask_key(self, digest: str, alpha: bool, latent_key: str) -> str:
        """The key of a mask: its file's content (``digest``), whether it is an alpha channel, and the latent it weighs
        (see the module docstring)."""
        return _hash("mask", digest, "alpha" if alpha else "gray", latent_key, MASK_RULE)

    def mask_path(self, key: str) -> Path:
        return self.root / "masks" / f"{key}.safetensors"

    def latent_path(self, key: str) -> Path:
        return self.root / "latents" / f"{key}.safetensors"

    def text_path(self, key: str) -> Path:
        return self.root / "text" / f"{key}.safetensors"

    # -- reading -----------------------------------------------------------------------------------------------
    def load_latents(self, key: str) -> dict[str, torch.Tensor]:
        """``latents`` plus ``original_size``, ``crop_top_left`` and ``target_size``."""
        return load_file(self.latent_path(key))

    def load_text(self, key: str) -> dict[str, torch.Tensor]:
        return load_file(self.text_path(key))

    # -- encoding ----------------------------------------------------------------------------------------------
    def encode_latents(
        self,
        jobs: Sequence[LatentJob],
        device: torch.device,
        *,
        batch_size: int = 4,
        workers: int = 0,
        background: tuple[int, int, int] = (255, 255, 255),
        vae: Any = None,
        channels_last: bool | None = None,
        progress: bool = False,
    ) -> EncodeResult:
        """Decode (in ``workers`` processes) and encode ``jobs``; write one file per output key.

        ``vae``: an already-loaded VAE on ``device``, used as it is (the benchmark passes one); by default the family
        loads it when the first image is decoded, and it is freed at the end. ``channels_last``: NHWC inputs, and a
        VAE loaded here converted to NHWC (default: on CUDA, where convolutions are faster so).
        """
        result = EncodeResult()
        if not jobs:
            return result
        start = time.perf_counter()
        own_vae = vae is None
        channels_last = device.type == "cuda" if channels_last is None else channels_last
        loader = decode_loader(jobs, batch_size, workers, background, pin_memory=device.type == "cuda")
        batches = iter(loader)  # forks the workers before any thread or model exists in this process
        bar = progress_bar(len(jobs), "Encoding images", progress)
        pending: deque[Future] = deque()
        try:
            with ThreadPoolExecutor(max_workers=2, thread_name_prefix="cache-writer") as writer:
                for ok, pixels, failed in batches:
                    result.skips.extend(Skip(jobs[i].image, kind, reason) for i, kind, reason in failed)
                    bar.update(len(ok) + len(failed))
                    if not ok:
                        continue
                    if vae is None:
                        vae = self.family.load_vae(self.source).to(device)
                        # NHWC is a 4-D layout: a video VAE's 5-D convolution weights (Qwen-Image's) stay as they are.
                        if channels_last and all(p.dim() < 5 for p in vae.parameters()):
                            vae = vae.to(memory_format=torch.channels_last)
                    outputs, latents = self._encode_batch(vae, [jobs[i] for i in ok], pixels, device, channels_last)
                    result.encoded += len(ok)
                    for (key, placement, flipped), lat in zip(outputs, latents, strict=True):
                        tensors = {
                            "latents": lat,
                            "original_size": torch.tensor(placement.original[::-1], dtype=torch.int64),
                            "crop_top_left": torch.tensor(placement.crop_top_left(flipped), dtype=torch.int64),
                            "target_size": torch.tensor(placement.bucket[::-1], dtype=torch.int64),
                        }
                        pending.append(writer.submit(save_safetensors, tensors, self.latent_path(key)))
                        result.written += 1
                    while len(pending) > 4 * batch_size:
                        pending.popleft().result()  # bounded memory; a write error (disk full) surfaces here
                while pending:
                    pending.popleft().result()
        finally:
            bar.close()
            del batches, loader
            if own_vae:
                del vae
            _free(device)
        result.seconds = time.perf_counter() - start
        return result

    def _encode_batch(
        self, vae: Any, jobs: list[LatentJob], pixels: torch.Tensor, device: torch.device, channels_last: bool
    ) -> tuple[list[tuple[str, Placement, bool]], torch.Tensor]:
        x = pixels.to(device, non_blocking=True).permute(0, 3, 1, 2)  # uint8 NHWC -> NCHW view (channels-last)
        plain = [k for k, j in enumerate(jobs) if j.plain_key is not None]
        mirror = [k for k, j in enumerate(jobs) if j.flip_key is not None]
        parts = []
        if plain:
            parts.append(x if len(plain) == len(jobs) else x[plain])
        if mirror:
            parts.append(x[mirror].flip(-1))
        batch = torch.cat(parts) if len(parts) > 1 else parts[0]
        batch = batch.float() / 127.5 - 1.0
        if channels_last:
            batch = batch.contiguous(memory_format=torch.channels_last)
        latents = self.family.encode_images(vae, batch).float().cpu()
        outputs = [(jobs[k].plain_key, jobs[k].placement, False) for k in plain]
        outputs += [(jobs[k].flip_key, jobs[k].placement, True) for k in mirror]
        return outputs, latents  # type: ignore[return-value]

    @contextmanager
    def _text_encoders(self, device: torch.device) -> Iterator[Any]:
        """The family's text encoders on ``device`` (stored as ``text_encoder_quantization`` says), freed afterwards,
        with the pipelines' per-batch truncation warnings silenced meanwhile."""
        encoders = self.family.load_text_encoders(self.source)
        quantize_text_encoders(
            encoders, self.family.architecture.text_encoders, self.text_encoder_quantization, device, self.source.dtype
        )
        encoders = encoders.to(device)
        try:
            with _quiet_truncation(encoders):
                yield encoders
        finally:
            del encoders
            _free(device)

    def encode_texts(
        self, texts: Sequence[str], device: torch.device, batch_size: int = 4, progress: bool = False
    ) -> TextResult:
        """Encode texts (captions, variants, the empty prompt, sample prompts) into the text cache; the result counts
        them and lists those longer than the text encoder reads (cut by it; no warning is printed per batch)."""
        texts = list(dict.fromkeys(texts))
        result = TextResult()
        if not texts:
            return result
        bar = progress_bar(len(texts), "Encoding captions", progress)
        try:
            with self._text_encoders(device) as encoders:
                limit = self.family.prompt_limit(encoders)
                result.limit = str(limit) if limit is not None else ""
                for i in range(0, len(texts), batch_size):
                    chunk = texts[i : i + batch_size]
                    if limit is not None:
                        result.truncated += [t for t, cut in zip(chunk, limit.truncated(chunk), strict=True) if cut]
                    embeds = self.family.encode_prompts(encoders, chunk)
                    for j, text in enumerate(chunk):
                        save_safetensors({k: v[j] for k, v in embeds.items()}, self.text_path(self.text_key(text)))
                    result.encoded += len(chunk)
                    bar.update(len(chunk))
        finally:
            bar.close()
        return result

    def pair_key(self, text: str, controls: Sequence[ControlImage], background: tuple[int, int, int]) -> str:
        """The text key of ``text`` seen with ``controls`` (:meth:`text_key`)."""
        return self.text_key(text, [c.identity(background) for c in controls])

    def encode_pairs(
        self,
        pairs: Sequence[tuple[str, tuple[ControlImage, ...]]],
        device: torch.device,
        background: tuple[int, int, int],
        progress: bool = False,
    ) -> TextResult:
        """Encode (text, control images) pairs for a family whose prompt encoder sees the controls
        (``editing.prompt_sees_controls``), one pair per call (the pipelines encode one prompt with its images), under
        :meth:`pair_key`. A control that no longer decodes raises :class:`BadImage` (the latents were built first from
        the same bytes, so it does not happen unless a file changed in between)."""
        pairs = list(dict.fromkeys(pairs))
        result = TextResult()
        if not pairs:
            return result
        bar = progress_bar(len(pairs), "Encoding captions with their controls", progress)
        try:
            with self._text_encoders(device) as encoders:
                from PIL import Image

                limit = self.family.prompt_limit(encoders)
                result.limit = str(limit) if limit is not None else ""
                for text, controls in pairs:
                    if limit is not None and limit.truncated([text])[0]:
                        result.truncated.append(text)
                    images = [Image.fromarray(c.pixels(background)) for c in controls]
                    embeds = self.family.encode_prompts_with_controls(encoders, [text], [images])
                    tensors = {k: v[0] for k, v in embeds.items()}
                    save_safetensors(tensors, self.text_path(self.pair_key(text, controls, background)))
                    result.encoded += 1
                    bar.update(1)
        finally:
            bar.close()
        return result

    def missing_texts(self, texts: Iterable[str]) -> list[str]:
        return [t for t in dict.fromkeys(texts) if not readable(self.text_path(self.text_key(t)))]

    def text_embeddings(
        self,
        prompts: Sequence[str],
        device: torch.device,
        controls: Sequence[tuple[ControlImage, ...]] | None = None,
        background: tuple[int, int, int] = (255, 255, 255),
    ) -> list[dict[str, torch.Tensor]]:
        """Embeddings for ``prompts`` (batch of 1 each), encoding only those not cached yet. ``controls``: each prompt's
        control images, for a family whose prompt encoder sees them (``editing.prompt_sees_controls``; ignored for
        the others)."""
        if controls is not None and self.family.editing.prompt_sees_controls:
            pairs = list(zip(prompts, controls, strict=True))
            keys = [self.pair_key(p, c, background) for p, c in pairs]
            todo = [pair for pair, key in zip(pairs, keys, strict=True) if not readable(self.text_path(key))]
            result = self.encode_pairs(todo, device, background)
        else:
            keys = [self.text_key(p) for p in prompts]
            result = self.encode_texts(self.missing_texts(prompts), device)
        for text in result.truncated:
            log.warning("prompt %r is longer than the text encoder reads (%s); it is cut there", text, result.limit)
        return [{k: v.unsqueeze(0) for k, v in self.load_text(key).items()} for key in keys]

    def encode_masks(self, jobs: Sequence[MaskJob], threads: int = 4) -> EncodeResult:
        """Compute and write ``jobs`` (:func:`~lightning_lora.data.images.decode_mask` at the grid of each one's
        latent, read from that file's header); a mask that cannot be read, or changed since the build was planned, is a
        :class:`Skip` of its image (training it without its mask would train what the mask leaves out)."""
        result = EncodeResult()
        if not jobs:
            return result
        start = time.perf_counter()

        def run(job: MaskJob) -> Skip | None:
            try:
                data = _read_planned(job.source, job.digest)
                if data is None:
                    return Skip(job.image, "changed", f"its mask {display(job.source.name)} {_CHANGED}")
                with safe_open(self.latent_path(job.latent_key), framework="pt") as f:
                    height, width = f.get_slice("latents").get_shape()[-2:]
                mask = decode_mask(data, job.box, (width, height), job.alpha)
            except BadImage as e:
                where = "" if job.source == job.image else f"its mask {display(job.source.name)} "
                return Skip(job.image, f"mask: {e.kind}", f"{where}{e.reason}; fix the mask or remove it")
            if job.flipped:
                mask = mask[:, ::-1]
            save_safetensors({"mask": torch.from_numpy(mask.copy())[None]}, self.mask_path(job.key))
            return None

        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="cache-masks") as pool:
            for skip in pool.map(run, jobs):
                if skip is None:
                    result.written += 1
                else:
                    result.skips.append(skip)
        result.encoded = result.written
        result.seconds = time.perf_counter() - start
        return result

    def remove_stale_temporaries(self, older_than_s: float = 3600.0) -> int:
        """Delete temporary files that a killed build left behind (only old ones: a live build may own new ones)."""
        removed, now = 0, time.time()
        for folder in (self.root / "latents", self.root / "text", self.root / "masks"):
            if not folder.is_dir():
                continue
            for tmp in folder.glob(".*.tmp"):
                try:
                    if now - tmp.stat().st_mtime > older_than_s:
                        os.unlink(tmp)
                        removed += 1
                except OSError:
                    pass
        return removed
