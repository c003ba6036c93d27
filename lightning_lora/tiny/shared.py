"""Tiny, randomly initialised diffusion pipelines, built offline and deterministically.

Why this exists
---------------
The real FLUX.1-dev weights are 24 GB and live behind a model hub. Tests and the CPU demo need something with
exactly the same *structure* (same classes, same config keys, same tokenizers, same scheduler settings) but small
enough to build in milliseconds and with no download at all. This module builds such a pipeline from configs alone:

* ``FluxTransformer2DModel`` with 2 double-stream and 2 single-stream blocks,
* ``AutoencoderKL`` with four blocks (so, like the real VAE, a spatial scale factor of 8),
* ``CLIPTextModel`` and ``T5EncoderModel`` with a couple of layers each,
* hand-built CLIP (byte-level BPE) and T5 (Unigram) tokenizers,
* ``FlowMatchEulerDiscreteScheduler`` with FLUX.1-dev's real scheduler config.

Determinism
-----------
Two processes given the same seed produce bit-identical weights and identical token ids:

* weights: each component is created under its own seed (``seed`` plus a fixed offset) inside
  ``torch.random.fork_rng``, so the caller's global RNG is left alone and the order of construction does not matter;
* tokenizers: the vocabularies are written out by hand from a fixed word list. We deliberately do *not* use the
  ``tokenizers`` trainers: ``BpeTrainer``/``UnigramTrainer`` return the same merges/pieces in a different order on
  every run, so token ids would change between processes.

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

The ``dim64`` variant
---------------------
``dim64=True`` uses 16 latent channels (so the transformer's ``in_channels`` is 64, exactly like real FLUX) and sizes
every ``nn.Linear`` of the transformer and both text encoders so that ``in_features`` is a multiple of 64. bitsandbytes'
CPU 4-bit path crashes on layers with ``in_features < 64`` in eval mode without gradients (bitsandbytes 0.50:
``shape '[32, 0]' is invalid``).

SDXL and SD1.5
--------------
:func:`build_tiny_sdxl` keeps SDXL's real UNet *layout* (three levels: no attention, then two with attention;
two ResNets per level; the LDM/kohya block numbering depends on that) at tiny widths, with two CLIP text encoders of
different widths (the UNet's cross-attention width is their sum; the pooled embedding is the second's projection)
and SDXL's real scheduler (``EulerDiscreteScheduler``, scaled-linear betas). :func:`build_tiny_sd15` is an SD1.5-like
pipeline: attention at the high-resolution level, 1x1-convolution ``proj_in``/``proj_out`` as in SD1.5, one CLIP
encoder, ``PNDMScheduler`` as shipped with SD1.5 (``prediction_type="v_prediction"`` makes an SD2-768-like one).

Gotcha: modules built from a config start in ``train()`` mode (``from_pretrained`` returns ``eval()``). With dropout
that makes every call random, so every component is put in ``eval()`` and T5's ``dropout_rate`` is 0.
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
from diffusers import (
    AutoencoderKL,
    EulerDiscreteScheduler,
    FlowMatchEulerDiscreteScheduler,
    FluxPipeline,
    FluxTransformer2DModel,
    PNDMScheduler,
    StableDiffusionPipeline,
    StableDiffusionXLPipeline,
    UNet2DConditionModel,
)
from transformers import (  # type: ignore[attr-defined]  # T5TokenizerFast: a lazy attribute of transformers 5
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
    T5Config,
    T5EncoderModel,
    T5TokenizerFast,
)

__all__ = [
    "CAPTION_WORDS",
    "FLUX_DEV_SCHEDULER_CONFIG",
    "SD15_SCHEDULER_CONFIG",
    "SDXL_SCHEDULER_CONFIG",
    "build_clip_tokenizer",
    "build_t5_tokenizer",
    "build_tiny_flux",
    "build_tiny_sd15",
    "build_tiny_sdxl",
    "clip_vocab_and_merges",
    "make_clip_tokenizer",
    "make_t5_tokenizer",
    "save_tiny_flux",
    "save_tiny_sd15",
    "save_tiny_sdxl",
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

#: The scheduler config of black-forest-labs/FLUX.1-dev (``scheduler/scheduler_config.json``).
FLUX_DEV_SCHEDULER_CONFIG: dict[str, Any] = {
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
}

#: The scheduler config of stabilityai/stable-diffusion-xl-base-1.0 (``scheduler/scheduler_config.json``).
SDXL_SCHEDULER_CONFIG: dict[str, Any] = {
    "num_train_timesteps": 1000,
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "prediction_type": "epsilon",
    "interpolation_type": "linear",
    "timestep_spacing": "leading",
    "steps_offset": 1,
    "use_karras_sigmas": False,
}

#: The scheduler config of the SD1.5 release (``scheduler/scheduler_config.json``: PNDM, scaled-linear betas).
SD15_SCHEDULER_CONFIG: dict[str, Any] = {
    "num_train_timesteps": 1000,
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "prediction_type": "epsilon",
    "set_alpha_to_one": False,
    "skip_prk_steps": True,
    "steps_offset": 1,
}

CLIP_BOS = "<|startoftext|>"
CLIP_EOS = "<|endoftext|>"
CLIP_MAX_LENGTH = 77
T5_MAX_LENGTH = 512
END_OF_WORD = "</w>"
METASPACE = "\u2581"  # "▁", SentencePiece's word-start marker

_Module = TypeVar("_Module")  # a diffusers / transformers model (their stubs do not all say nn.Module)

# Fixed per-component seed offsets: the weights of one component do not depend on how the others are built.
_SEED_OFFSETS = {"transformer": 0, "vae": 1, "text_encoder": 2, "text_encoder_2": 3, "unet": 4}
# Written into folders made by save_tiny_flux, so that a later call can recognise (and refuse to clobber) them.
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


def tiny_flux_vae(seed: int, latent_channels: int = 16) -> AutoencoderKL:
    """FLUX.1's VAE in miniature (Z-Image uses the same one): 16 latent channels, scale factor 8, FLUX's
    ``scaling_factor`` / ``shift_factor``, no quant convs."""
    return _build(seed, "vae", lambda: AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,  # 4 blocks -> 3 downsamplings -> scale factor 8
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 8, 8),
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=4,
        sample_size=64,
        scaling_factor=0.3611,  # FLUX VAE values
        shift_factor=0.1159,
        use_quant_conv=False,
        use_post_quant_conv=False,
    ))  # fmt: skip


def build_tiny_flux(seed: int = 0, dim64: bool = False, guidance_embeds: bool = True) -> FluxPipeline:
    """A FLUX.1-dev-shaped ``FluxPipeline`` with tiny random weights (fp32, every component in ``eval()``).

    Args:
        seed: determines every weight; the same seed gives bit-identical weights in any process.
        dim64: 16 latent channels (transformer ``in_channels`` 64, like real FLUX) and every Linear of the transformer
            and text encoders with ``in_features`` a multiple of 64 (for bitsandbytes 4-bit on CPU). Otherwise 4
            latent channels (``in_channels`` 16) and widths of 16/32.
        guidance_embeds: True for a FLUX.1-dev-like model (distilled guidance input), False for schnell-like.
    """
    clip_tok = make_clip_tokenizer()
    t5_tok = make_t5_tokenizer()
    width = 64 if dim64 else 32  # text-encoder width = transformer's joint_attention_dim / pooled_projection_dim
    ffn = 128 if dim64 else 37  # an odd size catches shape mix-ups in the small variant
    latent_channels = 16 if dim64 else 4

    transformer = _build(seed, "transformer", lambda: FluxTransformer2DModel(
        patch_size=1,
        in_channels=4 * latent_channels,  # latents are packed 2x2 before the transformer
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=32 if dim64 else 16,
        num_attention_heads=2,
        joint_attention_dim=width,
        pooled_projection_dim=width,
        guidance_embeds=guidance_embeds,
        axes_dims_rope=(8, 12, 12) if dim64 else (4, 4, 8),  # must sum to attention_head_dim
    ))  # fmt: skip
    vae = tiny_flux_vae(seed, latent_channels)
    text_encoder = _build(seed, "text_encoder", lambda: CLIPTextModel(CLIPTextConfig(
        vocab_size=len(clip_tok),
        hidden_size=width,
        intermediate_size=ffn,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=CLIP_MAX_LENGTH,
        projection_dim=width,
        bos_token_id=clip_tok.bos_token_id,
        eos_token_id=clip_tok.eos_token_id,
        pad_token_id=clip_tok.pad_token_id,
    )))  # fmt: skip
    text_encoder_2 = _build(seed, "text_encoder_2", lambda: T5EncoderModel(T5Config(  # type: ignore[call-arg]
        vocab_size=len(t5_tok),
        d_model=width,
        d_kv=width // 4,
        d_ff=ffn,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        feed_forward_proj="gated-gelu",  # like T5 v1.1 XXL
        dropout_rate=0.0,
        pad_token_id=t5_tok.pad_token_id,
        eos_token_id=t5_tok.eos_token_id,
        decoder_start_token_id=0,
    )))  # fmt: skip
    scheduler = FlowMatchEulerDiscreteScheduler(**FLUX_DEV_SCHEDULER_CONFIG)
    return FluxPipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=clip_tok,
        text_encoder_2=text_encoder_2,
        tokenizer_2=t5_tok,
        transformer=transformer,
    )


def save_tiny_flux(folder: Path, seed: int = 0, dim64: bool = False) -> Path:
    """Build the tiny FLUX pipeline and ``save_pretrained`` it to ``folder``; return ``folder``.

    ``FluxPipeline.from_pretrained(folder)`` loads it back with identical weights. If ``folder`` already holds a
    pipeline (``model_index.json``) it is returned untouched, unless it is a tiny pipeline made with other arguments
    (``FileExistsError``). Any other non-empty folder is never overwritten (``FileExistsError``). The pipeline is
    written to a temporary sibling folder first and renamed into place, so a crash never leaves a half-written
    pipeline that looks complete.

    Exactness: loaded with ``from_pretrained(folder, disable_mmap=True)`` the pipeline reproduces the in-memory one
    bit for bit. With the default memory-mapped load the weights are equal but not 64-byte aligned, and CPU matmuls
    then round differently (transformer outputs differ by ~4e-7).
    """
    wanted = {"seed": seed, "dim64": dim64, "guidance_embeds": True}
    return _save_tiny(Path(folder), wanted, lambda: build_tiny_flux(seed=seed, dim64=dim64), "FLUX")


def _save_tiny(folder: Path, wanted: dict[str, Any], build: Callable[[], Any], what: str) -> Path:
    """Save ``build()`` to ``folder`` atomically unless it already holds that pipeline (see :func:`save_tiny_flux`)."""
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


def build_tiny_sdxl(seed: int = 0) -> StableDiffusionXLPipeline:
    """An SDXL-shaped ``StableDiffusionXLPipeline`` with tiny random weights (fp32, every component in ``eval()``).

    The UNet has SDXL's block layout (see the module docstring); the text encoders are 32 (CLIP-L's place) and 48
    (OpenCLIP-G's place, with a 32-wide projection for the pooled embedding) wide, so the cross-attention width is
    80 and the added-embedding input is ``6 * 8`` (time ids) ``+ 32`` (pooled) = 80.
    """
    tok = make_clip_tokenizer()
    tok_2 = make_clip_tokenizer(pad_token="!")
    te_width, te2_width, pooled = 32, 48, 32
    time_dim = 8
    unet = _build(seed, "unet", lambda: UNet2DConditionModel(
        sample_size=16,
        in_channels=4,
        out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        block_out_channels=(16, 32, 32),
        layers_per_block=2,
        attention_head_dim=(2, 4, 4),
        transformer_layers_per_block=(1, 1, 2),
        use_linear_projection=True,
        cross_attention_dim=te_width + te2_width,
        addition_embed_type="text_time",
        addition_time_embed_dim=time_dim,
        projection_class_embeddings_input_dim=6 * time_dim + pooled,
        norm_num_groups=8,
    ))  # fmt: skip
    text_encoder = _build(seed, "text_encoder", lambda: CLIPTextModel(_tiny_clip_config(tok, te_width)))
    text_encoder_2 = _build(seed, "text_encoder_2", lambda: CLIPTextModelWithProjection(
        _tiny_clip_config(tok_2, te2_width, projection_dim=pooled, hidden_act="gelu")
    ))  # fmt: skip
    return StableDiffusionXLPipeline(
        vae=_tiny_sd_vae(seed, scaling_factor=0.13025, force_upcast=True),
        text_encoder=text_encoder,
        text_encoder_2=text_encoder_2,
        tokenizer=tok,
        tokenizer_2=tok_2,
        unet=unet,
        scheduler=EulerDiscreteScheduler(**SDXL_SCHEDULER_CONFIG),
        force_zeros_for_empty_prompt=True,
        add_watermarker=False,
    )


def build_tiny_sd15(seed: int = 0, prediction_type: str = "epsilon") -> StableDiffusionPipeline:
    """An SD1.5-shaped ``StableDiffusionPipeline`` with tiny random weights (fp32, every component in ``eval()``).

    Args:
        seed: determines every weight.
        prediction_type: written into the scheduler config; ``v_prediction`` makes an SD2-768-like model.
    """
    tok = make_clip_tokenizer()
    width = 32
    unet = _build(seed, "unet", lambda: UNet2DConditionModel(
        sample_size=16,
        in_channels=4,
        out_channels=4,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        block_out_channels=(16, 32),
        layers_per_block=2,
        attention_head_dim=4,
        use_linear_projection=False,  # SD1.5's proj_in / proj_out are 1x1 convolutions
        cross_attention_dim=width,
        norm_num_groups=8,
    ))  # fmt: skip
    text_encoder = _build(seed, "text_encoder", lambda: CLIPTextModel(_tiny_clip_config(tok, width)))
    return StableDiffusionPipeline(
        vae=_tiny_sd_vae(seed, scaling_factor=0.18215, force_upcast=False),
        text_encoder=text_encoder,
        tokenizer=tok,
        unet=unet,
        scheduler=PNDMScheduler(**{**SD15_SCHEDULER_CONFIG, "prediction_type": prediction_type}),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )


def save_tiny_sdxl(folder: Path, seed: int = 0) -> Path:
    """Build the tiny SDXL pipeline and save it to ``folder`` (atomically, idempotent; see :func:`save_tiny_flux`)."""
    return _save_tiny(Path(folder), {"family": "sdxl", "seed": seed}, lambda: build_tiny_sdxl(seed=seed), "SDXL")


def save_tiny_sd15(folder: Path, seed: int = 0, prediction_type: str = "epsilon") -> Path:
    """Build the tiny SD1.5 pipeline and save it to ``folder`` (atomically, idempotent; see :func:`save_tiny_flux`)."""
    wanted = {"family": "sd15", "seed": seed, "prediction_type": prediction_type}
    return _save_tiny(Path(folder), wanted, lambda: build_tiny_sd15(seed, prediction_type), "SD1.5")
