"""Tiny, randomly initialised FLUX.2 pipelines (klein and dev), built offline and deterministically (see
:mod:`lightning_lora.tiny` for the approach; klein's Qwen tokenizer is Z-Image's, :mod:`lightning_lora.tiny.zimage`).

What is built
-------------
A ``Flux2KleinPipeline`` (:func:`build_tiny_flux2`) and a ``Flux2Pipeline`` (:func:`build_tiny_flux2_dev`) with the
real structure and configs at tiny widths:

* ``Flux2Transformer2DModel``: 2 double-stream and 2 single-stream blocks (klein 4B has 5 and 20, dev 8 and 48), 2 heads
  of 32 split into four rotary axes of 8 (the real 128 is 32/32/32/32), SwiGLU MLPs of ratio 3 as in the real model,
  ``in_channels`` 64: 16 VAE channels patchified 2x2 (the real VAE has 32: 128). klein has no guidance embedder; dev
  has one (``guidance_embeds``: the distilled guidance scale is an input, as in FLUX.1-dev);
* ``AutoencoderKLFlux2``: four blocks (a spatial scale factor of 8) with 16 latent channels and the VAE's batch norm
  over the patchified channels, whose running mean and variance are set to random values (a fresh BatchNorm's 0 and 1
  would make the normalisation the identity, and a test of it vacuous);
* klein: ``Qwen3ForCausalLM`` with 28 layers 64 wide (the real Qwen3-4B has 36 of 2560), so the pipeline's default text
  layers 9, 18 and 27 exist and 27 is not the last (whose output is normed); the tiny byte-level BPE
  ``Qwen2Tokenizer`` with Qwen3's chat template (``enable_thinking=False`` appends the empty ``<think>`` block, as the
  pipeline asks);
* dev: ``Mistral3ForConditionalGeneration`` (what ``Flux2Pipeline`` loads: Mistral-Small-3.1, a Mistral decoder of 40
  layers of 5120 with a Pixtral vision tower) with a decoder of 31 layers 64 wide, so that the pipeline's layers 10,
  20 and 30 exist and 30 is not the normed last one, and a one-layer vision tower (present because the class has one;
  the pipeline feeds text only). Its tokenizer: see below;
* ``FlowMatchEulerDiscreteScheduler`` with dynamic ("exponential") shifting, as FLUX.2 ships it: the pipelines pass
  their own ``mu`` (``compute_empirical_mu``) for every image size and step count.

Either way the caption features are ``3 x 64 = 192`` wide, the transformer's ``joint_attention_dim``, and every linear
layer's input is a multiple of 64 (bitsandbytes' CPU NF4). The klein pipeline's ``is_distilled`` is False (a base
model: samples use classifier-free guidance with the empty prompt), so the guided path of the pipeline is what the
tests compare; dev samples with its guidance input.

dev's tokenizer
---------------
FLUX.2 dev ships Mistral-Small-3.1's ``PixtralProcessor`` as its ``tokenizer`` component, but ``Flux2Pipeline`` only
calls its ``apply_chat_template`` on text: a system turn (``SYSTEM_MESSAGE`` of ``diffusers.pipelines.flux2``) and a
user turn, tokenized, padded and cut to ``max_sequence_length``. The processor renders the template and then runs its
tokenizer without adding special tokens (the template starts with ``<s>``), which is what the tokenizer's own
``apply_chat_template`` does. transformers 5 builds a ``PixtralProcessor`` only with torchvision installed, so the tiny
pipeline saves the tokenizer alone (``PreTrainedTokenizerFast``), and lightning-lora loads dev's ``tokenizer`` folder
with ``AutoTokenizer`` (the real folder's ``tokenizer.json`` and chat template are the processor's tokenizer's).

The tokenizer is Mistral's *tekken* kind, byte-level BPE, in miniature: the control tokens at Mistral's own ids
(``<unk>`` 0, ``<s>`` 1, ``</s>`` 2, ``[INST]`` 3, ``[/INST]`` 4, ..., ``[IMG]`` 10, ``<pad>`` 11, ...,
``[SYSTEM_PROMPT]`` 17, ``[/SYSTEM_PROMPT]`` 18; the vision config's ``image_token_index`` is 10 as in the real model),
then the byte-level vocabulary and merges of the tiny Qwen tokenizer (:func:`~lightning_lora.tiny.zimage.
qwen_vocab_and_merges`) over the caption words *and the words of the pipeline's system message*, so that the system turn
is about 30 tokens, not 150 single characters. A plain call adds ``<s>`` in front (Mistral's post-processor). The chat
template (:data:`MISTRAL_CHAT_TEMPLATE`) renders Mistral-Small-3.1's V7 format for the turns the pipeline sends::

    <s>[SYSTEM_PROMPT]{system}[/SYSTEM_PROMPT][INST]{prompt}[/INST]
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from diffusers import (
    AutoencoderKLFlux2,
    FlowMatchEulerDiscreteScheduler,
    Flux2KleinPipeline,
    Flux2Pipeline,
    Flux2Transformer2DModel,
)
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import (
    Mistral3Config,
    Mistral3ForConditionalGeneration,
    MistralConfig,
    PixtralVisionConfig,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from lightning_lora.families.facts import RandomModels
from lightning_lora.tiny.shared import CAPTION_WORDS, SMALL_VAE, _build, _save_tiny
from lightning_lora.tiny.zimage import QWEN_SPECIALS, make_qwen_tokenizer, qwen_vocab_and_merges

__all__ = [
    "FLUX2_SCHEDULER_CONFIG",
    "MISTRAL_CHAT_TEMPLATE",
    "MISTRAL_SPECIALS",
    "RANDOM_FLUX2",
    "build_tiny_flux2",
    "build_tiny_flux2_dev",
    "make_mistral_tokenizer",
    "save_tiny_flux2",
    "save_tiny_flux2_dev",
]

#: FLUX.2's ``scheduler/scheduler_config.json`` (klein and dev): dynamic shifting with an exponential time shift; the
#: pipelines always pass ``mu`` (their empirical fit to image tokens and step count), so the base/max values are unused.
FLUX2_SCHEDULER_CONFIG: dict[str, Any] = {
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
    "time_shift_type": "exponential",
}

#: Mistral-Small-3.1's first control tokens, at their ids 0-18 (the real vocabulary reserves 1000 such ids).
MISTRAL_SPECIALS: tuple[str, ...] = (
    "<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]", "[IMG_END]", "[PREFIX]", "[MIDDLE]",
    "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
)  # fmt: skip

#: Mistral-Small-3.1's V7 chat format for system, user and assistant turns; a turn's content is a string or a list of
#: blocks (text blocks give their text, an image block the ``[IMG]`` placeholder, as Pixtral's template does).
MISTRAL_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['content'] is string %}{%- set text = message['content'] %}"
    "{%- else %}{%- set text = namespace(value='') %}"
    "{%- for block in message['content'] %}"
    "{%- if block['type'] == 'text' %}{%- set text.value = text.value + block['text'] %}"
    "{%- elif block['type'] == 'image' %}{%- set text.value = text.value + '[IMG]' %}{%- endif %}"
    "{%- endfor %}{%- set text = text.value %}{%- endif %}"
    "{%- if message['role'] == 'system' %}{{- '[SYSTEM_PROMPT]' + text + '[/SYSTEM_PROMPT]' }}"
    "{%- elif message['role'] == 'user' %}{{- '[INST]' + text + '[/INST]' }}"
    "{%- else %}{{- text + eos_token }}{%- endif %}"
    "{%- endfor %}"
)

_TEXT_WIDTH, _LATENT_CHANNELS = 64, 16
_QWEN_LAYERS = 28  # klein's layers 9, 18, 27 exist and 27 is not the normed last
_MISTRAL_LAYERS = 31  # dev's layers 10, 20, 30 exist and 30 is not the normed last


def _system_words() -> list[str]:
    """The words of ``Flux2Pipeline``'s system message (one token each in the tiny Mistral vocabulary)."""
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

    return re.findall(r"[A-Za-z]+", SYSTEM_MESSAGE)


def make_mistral_tokenizer() -> PreTrainedTokenizerFast:
    """The tiny tekken-style Mistral tokenizer, in memory (see the module docstring): byte-level BPE after Mistral's
    control tokens, ``<s>`` prepended to a plain call, pad ``<pad>``, right padding, :data:`MISTRAL_CHAT_TEMPLATE`."""
    vocab, merges = qwen_vocab_and_merges([*CAPTION_WORDS, *_system_words()])
    pieces = [t for t in sorted(vocab, key=vocab.__getitem__) if t not in QWEN_SPECIALS]
    ids = {token: i for i, token in enumerate([*MISTRAL_SPECIALS, *pieces])}
    backend = Tokenizer(models.BPE(vocab=ids, merges=merges, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in MISTRAL_SPECIALS])
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", ids["<s>"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        padding_side="right",
        model_max_length=131072,
        chat_template=MISTRAL_CHAT_TEMPLATE,
    )


def _tiny_transformer(seed: int, guidance_embeds: bool) -> Flux2Transformer2DModel:
    return _build(seed, "transformer", lambda: Flux2Transformer2DModel(
        patch_size=1,
        in_channels=4 * _LATENT_CHANNELS,  # 2x2 patchified VAE channels
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=32,
        num_attention_heads=2,
        joint_attention_dim=3 * _TEXT_WIDTH,  # three text-encoder layers' hidden states side by side
        timestep_guidance_channels=256,
        mlp_ratio=3.0,
        axes_dims_rope=(8, 8, 8, 8),  # (T, H, W, L) axes; sums to attention_head_dim
        rope_theta=2000,
        guidance_embeds=guidance_embeds,  # dev: the distilled guidance input; klein: none
    ))  # fmt: skip


def _tiny_vae(seed: int) -> AutoencoderKLFlux2:
    def factory() -> AutoencoderKLFlux2:
        vae: Any = AutoencoderKLFlux2(  # Any: diffusers does not type its batch norm (vae.bn)
            block_out_channels=(8, 8, 8, 8),  # 4 blocks -> 3 downsamplings -> scale factor 8
            layers_per_block=1,
            latent_channels=_LATENT_CHANNELS,
            norm_num_groups=4,
            sample_size=64,
        )
        with torch.no_grad():  # random batch-norm statistics, so the normalisation is not the identity
            vae.bn.running_mean.copy_(0.5 * torch.randn(vae.bn.running_mean.shape))
            vae.bn.running_var.copy_(0.5 + torch.rand(vae.bn.running_var.shape))
        return vae

    return _build(seed, "vae", factory)


def build_tiny_flux2(seed: int = 0) -> Flux2KleinPipeline:
    """A FLUX.2-klein-shaped ``Flux2KleinPipeline`` with tiny random weights (fp32, every component in ``eval()``); see
    the module docstring. The same ``seed`` gives bit-identical weights in any process."""
    tokenizer = make_qwen_tokenizer()
    text_encoder = _build(seed, "text_encoder", lambda: Qwen3ForCausalLM(Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=_TEXT_WIDTH,
        intermediate_size=128,
        num_hidden_layers=_QWEN_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},  # Qwen3's
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        attention_dropout=0.0,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )))  # fmt: skip
    return Flux2KleinPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**FLUX2_SCHEDULER_CONFIG),
        vae=_tiny_vae(seed),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=_tiny_transformer(seed, guidance_embeds=False),
        is_distilled=False,
    )


def build_tiny_flux2_dev(seed: int = 0) -> Flux2Pipeline:
    """A FLUX.2-dev-shaped ``Flux2Pipeline`` with tiny random weights (fp32, every component in ``eval()``): guidance
    embedder, Mistral3 text encoder, tekken-style tokenizer; see the module docstring. The same ``seed`` gives
    bit-identical weights in any process."""
    tokenizer = make_mistral_tokenizer()
    text_config = MistralConfig(
        vocab_size=len(tokenizer),
        hidden_size=_TEXT_WIDTH,
        intermediate_size=128,
        num_hidden_layers=_MISTRAL_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention, as the real 32 / 8
        head_dim=16,
        max_position_embeddings=1024,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000_000.0},  # Mistral-Small-3.1's
        rms_norm_eps=1e-5,
        sliding_window=None,
        tie_word_embeddings=False,
        attention_dropout=0.0,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    vision_config = PixtralVisionConfig(
        hidden_size=_TEXT_WIDTH,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,  # heads of 32
        patch_size=8,
        image_size=64,
    )
    text_encoder = _build(seed, "text_encoder", lambda: Mistral3ForConditionalGeneration(Mistral3Config(
        text_config=text_config,
        vision_config=vision_config,
        image_token_index=MISTRAL_SPECIALS.index("[IMG]"),
        spatial_merge_size=2,
        tie_word_embeddings=False,
    )))  # fmt: skip
    return Flux2Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**FLUX2_SCHEDULER_CONFIG),
        vae=_tiny_vae(seed),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=_tiny_transformer(seed, guidance_embeds=True),
    )


def save_tiny_flux2(folder: Path, seed: int = 0) -> Path:
    """Build the tiny FLUX.2 klein pipeline and save it to ``folder`` (atomically, idempotent; see
    :func:`lightning_lora.tiny.flux.save_tiny_flux`); ``Flux2KleinPipeline.from_pretrained(folder)`` loads it back."""
    wanted = {"family": "flux2", "seed": seed}
    return _save_tiny(Path(folder), wanted, lambda: build_tiny_flux2(seed), "FLUX.2 klein")


def save_tiny_flux2_dev(folder: Path, seed: int = 0) -> Path:
    """Build the tiny FLUX.2 dev pipeline and save it to ``folder`` (atomically, idempotent; see
    :func:`lightning_lora.tiny.flux.save_tiny_flux`); ``Flux2Pipeline.from_pretrained(folder)`` loads it back."""
    wanted = {"family": "flux2", "variant": "dev", "seed": seed}
    return _save_tiny(Path(folder), wanted, lambda: build_tiny_flux2_dev(seed), "FLUX.2 dev")


RANDOM_FLUX2 = RandomModels(
    denoiser="black-forest-labs/FLUX.2-klein-base-4B",
    tiny_denoiser={  # the tiny pipeline's transformer: 2 double + 2 single blocks, 2 heads of 32
        "in_channels": 4 * _LATENT_CHANNELS,
        "num_layers": 2,
        "num_single_layers": 2,
        "attention_head_dim": 32,
        "num_attention_heads": 2,
        "joint_attention_dim": 3 * _TEXT_WIDTH,
        "axes_dims_rope": [8, 8, 8, 8],
    },
    tiny_vae={**SMALL_VAE, "latent_channels": _LATENT_CHANNELS},  # the tiny transformer's 64 = 16 x 2 x 2
    scheduler="FlowMatchEulerDiscreteScheduler",
    scheduler_config=FLUX2_SCHEDULER_CONFIG,
)
"""What the benchmark builds for FLUX.2 with random weights (:meth:`lightning_lora.families.Flux2.random_models`)."""
