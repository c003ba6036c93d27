"""The parts every tiny pipeline shares: the caption words, the hand-built tokenizers (byte-level BPE for CLIP
and Qwen, Unigram for T5), construction under a per-component seed, the SD-style VAE and CLIP
configs, and the atomic, idempotent save (see :mod:`lightning_lora.tiny` for why and how).

How the CLIP vocabulary is built
--------------------------------
CLIP uses byte-level BPE: every byte is mapped to a printable unicode character (GPT-2's ``bytes_to_unicode``), and
the last character of every word carries a ``</w>`` suffix. Like the real ``openai/clip-vit-large-patch14`` vocab, ids
``0..255`` are the 256 byte characters, ``256..511`` the same with ``</w>``, then one token per merge, and the two
specials ``<|startoftext|>``/``<|endoftext|>`` come last. For each word of :data:`CAPTION_WORDS` we tokenize it with
the merges made so far, then append merges that glue the resulting pieces together left to right
(``c a t</w>`` -> ``ca t</w>`` -> ``cat</w>``). New merges always rank below all earlier ones, so they can never change
how an earlier word is split: every word of the list ends up as one token.

How the T5 vocabulary is built
------------------------------
T5 uses a SentencePiece Unigram model: ``<pad>``=0, ``</s>``=1, ``<unk>``=2, then ``▁`` (the word-start marker), single
characters, and one ``▁word`` piece per caption word. Whole-word pieces get a much better log-probability than their
spelling, so Viterbi picks them. A ``$A </s>`` post-processor appends the end-of-sequence token, as in real T5. We add
no ``<extra_id_N>`` sentinels (``extra_ids=0``); FLUX never uses them.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Sequence
from itertools import pairwise
from pathlib import Path
from typing import Any, TypeVar

import torch
from diffusers import AutoencoderKL
from transformers import (  # type: ignore[attr-defined]  # T5TokenizerFast: a lazy attribute of transformers 5
    CLIPTextConfig,
    CLIPTokenizer,
    T5TokenizerFast,
)

__all__ = [
    "CAPTION_WORDS",
    "SMALL_VAE",
    "build_clip_tokenizer",
    "build_t5_tokenizer",
    "clip_vocab_and_merges",
    "make_clip_tokenizer",
    "make_t5_tokenizer",
    "t5_vocab",
]

#: Words that become single tokens in both tiny tokenizers (lower case: the CLIP tokenizer lower-cases its input).
#: The order is part of the token ids: append new words at the end only.
CAPTION_WORDS: tuple[str, ...] = (
    "a", "an", "the", "photo", "of", "cat", "dog", "astronaut", "coffee", "cup", "rocket", "sks", "ohwx", "person",
    "style", "in", "on", "with", "and", "at", "by", "is", "to", "for", "from", "picture", "image", "painting",
    "drawing", "sketch", "portrait", "man", "woman", "face", "red", "blue", "green", "white", "black", "space",
    "suit", "launch", "sky", "mug", "table", "wearing", "sitting", "standing", "holding", "looking", "close", "up",
    "high", "quality", "detailed", "background", "tabby", "chelsea", "motorcycle", "color", "wheel", "logo", "moon",
    "coins", "camera", "horse", "text", "page", "galaxy", "hubble", "retina", "art", "watercolor", "oil", "digital",
    "render", "cinematic", "lighting", "night", "day", "city", "street", "forest", "beach", "mountain", "water",
    "flower", "tree", "house", "car", "bird", "small", "large", "old", "young", "cute", "beautiful", "sunset", "snow",
)  # fmt: skip

CLIP_BOS = "<|startoftext|>"
CLIP_EOS = "<|endoftext|>"
CLIP_MAX_LENGTH = 77
T5_MAX_LENGTH = 512
END_OF_WORD = "</w>"
METASPACE = "\u2581"  # "▁", SentencePiece's word-start marker

_Module = TypeVar("_Module")  # a diffusers / transformers model (their stubs do not all say nn.Module)

# Fixed per-component seed offsets: the weights of one component do not depend on how the others are built.
_SEED_OFFSETS = {"transformer": 0, "vae": 1, "text_encoder": 2, "text_encoder_2": 3, "unet": 4}
# Written into the folders _save_tiny makes, so that a later call can recognise (and refuse to clobber) them.
MARKER_FILE = "tiny_pipeline.json"


# --------------------------------------------------------------------------------------------------- tokenizers


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2/CLIP's reversible byte -> printable character table; its order is CLIP's token-id order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    for extra, byte in enumerate(b for b in range(256) if b not in table):
        table[byte] = chr(256 + extra)
    return table


def _bpe(word: str, ranks: dict[tuple[str, str], int]) -> list[str]:
    """Split ``word`` (already byte-level characters) with BPE ``ranks``: repeatedly apply the best-ranked merge."""
    symbols = [*word[:-1], word[-1] + END_OF_WORD]
    while len(symbols) > 1:
        pairs = zip(symbols[:-1], symbols[1:], strict=True)
        rank, i = min((ranks.get(pair, len(ranks)), i) for i, pair in enumerate(pairs))
        if rank == len(ranks):
            break
        symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
    return symbols


def byte_level_bpe(words: Iterable[str], specials: Sequence[str]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A byte-level BPE vocabulary and merge list (GPT-2 / Qwen style, no end-of-word marker; pure and deterministic)
    in which ``word`` and `` word`` are one token each for every word of ``words``: ids 0..255 are the byte characters,
    then every piece the merges make, then ``specials``."""
    byte_to_char = _bytes_to_unicode()
    vocab = {char: i for i, char in enumerate(byte_to_char.values())}
    merges: list[tuple[str, str]] = []
    ranks: dict[tuple[str, str], int] = {}
    for form in dict.fromkeys(form for word in words for form in (word, " " + word)):  # in order, de-duplicated
        pieces = _merge_bytes([byte_to_char[b] for b in form.encode()], ranks)
        while len(pieces) > 1:  # glue left to right: new merges rank below all older ones
            pair = (pieces[0], pieces[1])
            ranks[pair] = len(merges)
            merges.append(pair)
            pieces[:2] = [pair[0] + pair[1]]
            vocab.setdefault(pieces[0], len(vocab))
    for special in specials:
        vocab[special] = len(vocab)
    return vocab, merges


def _merge_bytes(symbols: list[str], ranks: dict[tuple[str, str], int]) -> list[str]:
    """Byte-level BPE: apply the best-ranked adjacent merge until none applies."""
    while len(symbols) > 1:
        rank, i = min((ranks.get(pair, len(ranks)), i) for i, pair in enumerate(pairwise(symbols)))
        if rank == len(ranks):
            break
        symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
    return symbols


def clip_vocab_and_merges(words: Iterable[str] = CAPTION_WORDS) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """The byte-level BPE vocabulary and merge list of the tiny CLIP tokenizer (pure and deterministic)."""
    byte_to_char = _bytes_to_unicode()
    byte_chars = list(byte_to_char.values())
    tokens = [*byte_chars, *(c + END_OF_WORD for c in byte_chars)]
    known = set(tokens)
    merges: list[tuple[str, str]] = []
    ranks: dict[tuple[str, str], int] = {}
    for word in dict.fromkeys(words):  # de-duplicated, order kept
        pieces = _bpe("".join(byte_to_char[b] for b in word.lower().encode()), ranks)
        while len(pieces) > 1:  # glue left to right: new merges rank below all older ones
            pair = (pieces[0], pieces[1])
            ranks[pair] = len(merges)
            merges.append(pair)
            pieces[:2] = [pair[0] + pair[1]]
            if pieces[0] not in known:
                known.add(pieces[0])
                tokens.append(pieces[0])
    tokens += [CLIP_BOS, CLIP_EOS]
    return {token: i for i, token in enumerate(tokens)}, merges


def t5_vocab(words: Iterable[str] = CAPTION_WORDS) -> list[tuple[str, float]]:
    """The Unigram pieces and log-probabilities of the tiny T5 tokenizer (pure and deterministic)."""
    chars = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"
    pieces: list[tuple[str, float]] = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), (METASPACE, -2.0)]
    pieces += [(c, -5.0) for c in chars]
    pieces += [(METASPACE + w, -1.0) for w in dict.fromkeys(words)]
    return pieces


def make_clip_tokenizer(words: Sequence[str] = CAPTION_WORDS, pad_token: str = CLIP_EOS) -> CLIPTokenizer:
    """The tiny CLIP tokenizer, in memory (``model_max_length`` 77, pad = eos = ``<|endoftext|>``, like real CLIP).

    ``pad_token="!"`` gives SDXL's second tokenizer (OpenCLIP-G pads with ``!``, token id 0).
    """
    vocab, merges = clip_vocab_and_merges(words)
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=CLIP_MAX_LENGTH, pad_token=pad_token)  # type: ignore[arg-type]


def make_t5_tokenizer(words: Sequence[str] = CAPTION_WORDS) -> T5TokenizerFast:
    """The tiny T5 tokenizer, in memory (pad=0, eos=1, unk=2, no sentinels, ``model_max_length`` 512)."""
    return T5TokenizerFast(vocab=t5_vocab(words), extra_ids=0, model_max_length=T5_MAX_LENGTH)


def build_clip_tokenizer(folder: Path) -> CLIPTokenizer:
    """Write the tiny CLIP tokenizer to ``folder`` and load it back from there (what a pipeline folder holds).

    Besides transformers' ``tokenizer.json``/``tokenizer_config.json`` the folder gets the classic ``vocab.json`` +
    ``merges.txt`` pair, which other tools (and transformers 4) read.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = make_clip_tokenizer()
    tokenizer.save_pretrained(folder)
    tokenizer.backend_tokenizer.model.save(str(folder))  # vocab.json + merges.txt
    return CLIPTokenizer.from_pretrained(folder)


def build_t5_tokenizer(folder: Path) -> T5TokenizerFast:
    """Write the tiny T5 tokenizer (``tokenizer.json`` + config) to ``folder`` and load it back from there."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    make_t5_tokenizer().save_pretrained(folder)
    return T5TokenizerFast.from_pretrained(folder)


# --------------------------------------------------------------------------------------------------- models


def _build(seed: int, component: str, factory: Callable[[], _Module]) -> _Module:
    """Run ``factory`` under a per-component seed (leaving the caller's RNG alone); return it fp32 and in eval()."""
    default_dtype = torch.get_default_dtype()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed * 1009 + _SEED_OFFSETS[component])
        torch.set_default_dtype(torch.float32)
        try:
            module: Any = factory()
        finally:
            torch.set_default_dtype(default_dtype)
    return module.eval()


def _save_tiny(folder: Path, wanted: dict[str, Any], build: Callable[[], Any], what: str) -> Path:
    """Save ``build()`` to ``folder`` atomically unless it already holds that pipeline (see
    :func:`~lightning_lora.tiny.flux.save_tiny_flux`)."""
    if (folder / "model_index.json").is_file():
        _check_marker(folder, wanted)
        return folder
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise FileExistsError(
            f"{folder} exists and is not empty but holds no pipeline (no model_index.json); "
            f"refusing to write a tiny {what} pipeline into it. Pick an empty or new folder."
        )
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    try:
        build().save_pretrained(staging, safe_serialization=True)
        (staging / MARKER_FILE).write_text(json.dumps(wanted, indent=2) + "\n")
        if folder.exists():
            folder.rmdir()  # empty (checked above)
        os.replace(staging, folder)
    except OSError:
        if (folder / "model_index.json").is_file():  # another process won the race
            _check_marker(folder, wanted)
            return folder
        raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return folder


def _check_marker(folder: Path, wanted: dict[str, Any]) -> None:
    marker = folder / MARKER_FILE
    if marker.is_file():
        found = json.loads(marker.read_text())
        if found != wanted:
            raise FileExistsError(f"{folder} holds a tiny pipeline built with {found}, not {wanted}")


# --------------------------------------------------------------------------------------------------- SDXL, SD1.5


def _tiny_sd_vae(seed: int, scaling_factor: float, force_upcast: bool) -> AutoencoderKL:
    """A 4-channel SD/SDXL-style VAE (scale factor 8, with quant convs, no shift)."""
    return _build(seed, "vae", lambda: AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 8, 8),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=4,
        sample_size=64,
        scaling_factor=scaling_factor,
        force_upcast=force_upcast,
    ))  # fmt: skip


def _tiny_clip_config(tokenizer: CLIPTokenizer, width: int, **extra: Any) -> CLIPTextConfig:
    return CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=width,
        intermediate_size=37,
        num_hidden_layers=3,  # SDXL reads the penultimate layer: keep more than two
        num_attention_heads=4,
        max_position_embeddings=CLIP_MAX_LENGTH,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **extra,
    )


SMALL_VAE: dict[str, Any] = {
    "block_out_channels": [8, 8, 8, 8],
    "layers_per_block": 1,
    "norm_num_groups": 4,
    "sample_size": 64,
}
"""What the benchmark's tiny ``AutoencoderKL`` changes in a real one (``RandomModels.tiny_vae``): four blocks of eight
channels, the tiny pipelines' VAE widths."""
