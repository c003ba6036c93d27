"""A tiny, randomly initialised Z-Image pipeline, built offline and deterministically (see :mod:`lightning_lora.tiny`).

Z-Image (Tongyi-MAI/Z-Image-Turbo, Tongyi-MAI/Z-Image) is a ``ZImagePipeline`` of five components. This module builds
each one from a config with the real model's *structure* and tiny widths:

* ``ZImageTransformer2DModel``: the real block types and counts of each kind scaled down (1 noise refiner, 1 context
  refiner and 2 main layers instead of 2, 2 and 30), ``dim`` 64 in 2 heads of 32 (the real head is 128 wide, split
  into rotary axes 32/48/48; here 8/12/12), 16 latent channels and 2x2 patches as in the real model. Its time
  embedder keeps diffusers' fixed 1024-wide hidden layer: the transformer is ~0.6 M parameters, most of them there;
* ``AutoencoderKL`` with four blocks (a spatial scale factor of 8) and 16 latent channels, FLUX's VAE constants
  (``scaling_factor`` 0.3611, ``shift_factor`` 0.1159), which Z-Image uses;
* ``Qwen3Model`` (the real text encoder is Qwen3-4B, 36 layers of 2560): 2 layers of 64 with 4 query heads and 2
  key/value heads (grouped-query attention like the real 32/8), every linear layer's input a multiple of 64 so that
  bitsandbytes' CPU NF4 path accepts it;
* a hand-built byte-level BPE ``Qwen2Tokenizer`` with Qwen's chat special tokens and a chat template;
* ``FlowMatchEulerDiscreteScheduler`` with Z-Image-Turbo's scheduler config (a static shift of 3, no dynamic shifting).

The tokenizer
-------------
Qwen's tokenizer is GPT-2-style byte-level BPE: every byte is one printable character (the table of
:func:`lightning_lora.tiny.shared._bytes_to_unicode`), a space becomes ``Ġ`` and is glued to the word after it, and
there is no end-of-word marker. The vocabulary here is the 256 byte characters, then for each word of
:data:`~lightning_lora.tiny.shared.CAPTION_WORDS` (and the chat roles) merges that spell ``word`` and ``Ġword`` left to
right, so every caption word is one token; new merges rank below older ones, so no later word changes an earlier word's
split. The specials come last: ``<|endoftext|>`` (pad, as in Qwen), ``<|im_start|>``, ``<|im_end|>`` (end of a turn).
Like the FLUX tokenizers it is written out by hand, never trained (trainers reorder merges between runs).

``ZImagePipeline`` does not feed the prompt to Qwen3 as it is: it wraps it in the chat template
(``apply_chat_template(..., add_generation_prompt=True, enable_thinking=True)``), which for one user turn gives::

    <|im_start|>user\\n{prompt}<|im_end|>\\n<|im_start|>assistant\\n

:data:`CHAT_TEMPLATE` produces exactly that string for user turns (Qwen3's own template also handles system prompts,
tools and thinking blocks, which the pipeline never uses; with ``enable_thinking=False`` both append an empty
``<think>`` block).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
from tokenizers import AddedToken
from transformers import Qwen2Tokenizer, Qwen3Config, Qwen3Model

from lightning_lora.families.facts import RandomModels
from lightning_lora.tiny.flux import tiny_flux_vae
from lightning_lora.tiny.shared import CAPTION_WORDS, SMALL_VAE, _build, _save_tiny, byte_level_bpe

__all__ = [
    "CHAT_TEMPLATE",
    "QWEN_SPECIALS",
    "RANDOM_ZIMAGE",
    "ZIMAGE_TURBO_SCHEDULER_CONFIG",
    "build_tiny_zimage",
    "make_qwen_tokenizer",
    "qwen_vocab_and_merges",
    "save_tiny_zimage",
]

#: Z-Image-Turbo's ``scheduler/scheduler_config.json``: a static shift of 3 (the base Z-Image ships 6).
ZIMAGE_TURBO_SCHEDULER_CONFIG: dict[str, Any] = {
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": False,
}

#: Qwen's special tokens, in the order they follow the BPE vocabulary (pad / end of text, turn start, turn end).
QWEN_SPECIALS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

#: Qwen3's chat template, reduced to what ``ZImagePipeline`` renders: user turns, the assistant prompt, and the empty
#: ``<think>`` block Qwen3 adds when thinking is switched off.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)

_ROLES = ("user", "assistant", "system")


def qwen_vocab_and_merges(words: Iterable[str] = CAPTION_WORDS) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """The byte-level BPE vocabulary (specials included, last) and merge list of the tiny Qwen tokenizer
    (:func:`~lightning_lora.tiny.shared.byte_level_bpe`): ``word`` and ``Ġword`` are one token each for every word of
    ``words`` and the chat roles."""
    return byte_level_bpe([*_ROLES, *words], QWEN_SPECIALS)


def make_qwen_tokenizer(words: Iterable[str] = CAPTION_WORDS) -> Qwen2Tokenizer:
    """The tiny Qwen tokenizer, in memory: pad = ``<|endoftext|>``, eos = ``<|im_end|>`` (as Qwen3's), right padding,
    :data:`CHAT_TEMPLATE`, ``model_max_length`` 32768 (Qwen's tokenizer config)."""
    vocab, merges = qwen_vocab_and_merges(words)
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,  # type: ignore[arg-type]  # the tokenizers library takes (a, b) pairs
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=32768,
        padding_side="right",
    )
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIALS], special_tokens=True)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tiny_zimage(seed: int = 0) -> ZImagePipeline:
    """A Z-Image-shaped ``ZImagePipeline`` with tiny random weights (fp32, every component in ``eval()``); the same
    ``seed`` gives bit-identical weights in any process. See the module docstring for the shapes."""
    tokenizer = make_qwen_tokenizer()
    width = 64  # the text encoder's hidden size = the transformer's cap_feat_dim
    transformer = _build(seed, "transformer", lambda: ZImageTransformer2DModel(
        all_patch_size=(2,),
        all_f_patch_size=(1,),
        in_channels=16,
        dim=64,
        n_layers=2,
        n_refiner_layers=1,
        n_heads=2,
        n_kv_heads=2,
        norm_eps=1e-5,
        qk_norm=True,
        cap_feat_dim=width,
        rope_theta=256.0,
        t_scale=1000.0,
        axes_dims=[8, 12, 12],  # sum = head dim (64 / 2); each even (complex rotary pairs)
        axes_lens=[1536, 512, 512],  # the real model's
    ))  # fmt: skip
    vae = tiny_flux_vae(seed)  # Z-Image uses FLUX.1's VAE
    text_encoder = _build(seed, "text_encoder", lambda: Qwen3Model(Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=width,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},  # Qwen3-4B's
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        attention_dropout=0.0,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )))  # fmt: skip
    return ZImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**ZIMAGE_TURBO_SCHEDULER_CONFIG),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
    )


def save_tiny_zimage(folder: Path, seed: int = 0) -> Path:
    """Build the tiny Z-Image pipeline and save it to ``folder`` (atomically, idempotent; see
    :func:`lightning_lora.tiny.flux.save_tiny_flux`); ``ZImagePipeline.from_pretrained(folder)`` loads it back."""
    wanted = {"family": "zimage", "seed": seed}
    return _save_tiny(Path(folder), wanted, lambda: build_tiny_zimage(seed=seed), "Z-Image")


RANDOM_ZIMAGE = RandomModels(
    denoiser="Tongyi-MAI/Z-Image-Turbo",
    tiny_denoiser={  # the tiny pipeline's transformer: 1 + 1 refiners, 2 main layers, 2 heads of 32
        "dim": 64,
        "n_layers": 2,
        "n_refiner_layers": 1,
        "n_heads": 2,
        "n_kv_heads": 2,
        "cap_feat_dim": 64,
        "axes_dims": [8, 12, 12],
    },
    tiny_vae=SMALL_VAE,  # Z-Image decodes with FLUX.1's VAE
    scheduler="FlowMatchEulerDiscreteScheduler",
    scheduler_config=ZIMAGE_TURBO_SCHEDULER_CONFIG,
)
"""What the benchmark builds for Z-Image with random weights (:meth:`lightning_lora.families.ZImage.random_models`)."""
