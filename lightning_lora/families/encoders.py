"""The text encoders the families cache with, as architectures: what the memory planner needs to size the caching phase
(the encoders are loaded once, before training, to turn every caption into embeddings).

FLUX.1 encodes with CLIP-L (123 M parameters, the pooled vector) and T5-XXL's encoder (4.76 B: ~8.9 GiB in bf16, the
largest single thing many users load); SDXL with CLIP-L and OpenCLIP ViT-bigG (695 M); SD1.5 with CLIP-L; Qwen-Image
with Qwen2.5-VL-7B (8.3 B with its vision tower, which text-only encoding never runs); FLUX.2 klein with Qwen3-4B / 8B
(as causal LMs, language-model head included) and FLUX.2 dev with Mistral-Small-3.1-24B (24 B with its vision tower);
Krea 2 with Qwen3-VL-4B (4.4 B with its vision tower).
Their
``config.json`` fields that decide the shapes ship here, so a plan of the shipped configs needs no download; a local
folder's own configs are read instead. :func:`skeleton` builds one on the meta device (shapes, no memory).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = [
    "CLIP_L",
    "MISTRAL_SMALL_31",
    "OPENCLIP_BIGG",
    "QWEN25_VL_7B",
    "QWEN3_4B",
    "QWEN3_4B_LM",
    "QWEN3_8B_LM",
    "QWEN3_VL_4B",
    "T5_XXL",
    "skeleton",
]

CLIP_L: dict[str, Any] = {
    "_class": "CLIPTextModel",
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_attention_heads": 12,
    "num_hidden_layers": 12,
    "max_position_embeddings": 77,
    "vocab_size": 49408,
    "projection_dim": 768,
    "hidden_act": "quick_gelu",
}
"""OpenAI CLIP ViT-L/14's text encoder (FLUX.1's and SDXL's ``text_encoder``, SD1.5's)."""

OPENCLIP_BIGG: dict[str, Any] = {
    "_class": "CLIPTextModelWithProjection",
    "hidden_size": 1280,
    "intermediate_size": 5120,
    "num_attention_heads": 20,
    "num_hidden_layers": 32,
    "max_position_embeddings": 77,
    "vocab_size": 49408,
    "projection_dim": 1280,
    "hidden_act": "gelu",
}
"""OpenCLIP ViT-bigG/14's text encoder with its projection (SDXL's ``text_encoder_2``)."""

T5_XXL: dict[str, Any] = {
    "_class": "T5EncoderModel",
    "d_model": 4096,
    "d_ff": 10240,
    "d_kv": 64,
    "num_heads": 64,
    "num_layers": 24,
    "vocab_size": 32128,
    "feed_forward_proj": "gated-gelu",
    "is_encoder_decoder": False,
    "use_cache": False,
}
"""Google T5 v1.1 XXL's encoder (FLUX.1's ``text_encoder_2``)."""

QWEN3_4B: dict[str, Any] = {
    "_class": "Qwen3Model",
    "hidden_size": 2560,
    "intermediate_size": 9728,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": True,
    "use_cache": False,
}
"""Qwen3-4B without its language-model head (4.0 B parameters, 7.5 GiB in bf16): Z-Image's ``text_encoder``, loaded as
``Qwen3Model`` (the pipeline reads its second-to-last hidden states)."""

QWEN3_4B_LM: dict[str, Any] = {**QWEN3_4B, "_class": "Qwen3ForCausalLM"}
"""Qwen3-4B with its (tied) language-model head, as ``Qwen3ForCausalLM``: FLUX.2 klein 4B's ``text_encoder`` (the
pipeline stacks the hidden states of layers 9, 18 and 27)."""

QWEN3_8B_LM: dict[str, Any] = {
    "_class": "Qwen3ForCausalLM",
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": False,
    "use_cache": False,
}
"""Qwen3-8B as ``Qwen3ForCausalLM`` (8.2 B parameters, 15.3 GiB in bf16): FLUX.2 klein 9B's ``text_encoder``."""

MISTRAL_SMALL_31: dict[str, Any] = {
    "_class": "Mistral3ForConditionalGeneration",
    "hidden_size": 5120,  # the text model's (read by the planner for the caching activations)
    "text_config": {
        "model_type": "mistral",
        "hidden_size": 5120,
        "intermediate_size": 32768,
        "num_hidden_layers": 40,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 131072,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-05,
        "tie_word_embeddings": False,
        "use_cache": False,
    },
    "vision_config": {
        "model_type": "pixtral",
        "hidden_size": 1024,
        "intermediate_size": 4096,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "head_dim": 64,
        "patch_size": 14,
        "image_size": 1540,
    },
    "spatial_merge_size": 2,
    "multimodal_projector_bias": False,
    "projector_hidden_act": "gelu",
    "tie_word_embeddings": False,
}
"""Mistral-Small-3.1-24B with its Pixtral vision tower (24 B parameters, ~45 GiB in bf16; the tower is loaded, never
run): FLUX.2 dev's ``text_encoder`` (the pipeline stacks the hidden states of layers 10, 20 and 30)."""

QWEN25_VL_7B: dict[str, Any] = {
    "_class": "Qwen2_5_VLForConditionalGeneration",
    "model_type": "qwen2_5_vl",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "max_position_embeddings": 128000,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "rope_scaling": {"mrope_section": [16, 24, 24], "rope_type": "default", "type": "default"},
    "tie_word_embeddings": False,
    "use_cache": False,
    "vision_config": {
        "depth": 32,
        "hidden_size": 1280,
        "intermediate_size": 3420,
        "num_heads": 16,
        "out_hidden_size": 3584,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 112,
        "fullatt_block_indexes": [7, 15, 23, 31],
        "hidden_act": "silu",
    },
}
"""Qwen2.5-VL-7B-Instruct with its vision tower and language-model head (8.3 B parameters, 15.4 GiB in bf16; the vision
tower is loaded but never run): Qwen-Image's ``text_encoder`` (``Qwen/Qwen-Image`` ``text_encoder/config.json``)."""


QWEN3_VL_4B: dict[str, Any] = {
    "_class": "Qwen3VLModel",
    "hidden_size": 2560,  # the text model's (read by the planner for the caching activations)
    "text_config": {
        "hidden_size": 2560,
        "intermediate_size": 9728,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {"rope_type": "default", "mrope_section": [24, 20, 20], "mrope_interleaved": True,
                            "rope_theta": 5000000},
        "use_cache": False,
    },
    "vision_config": {
        "depth": 24,
        "hidden_size": 1024,
        "intermediate_size": 4096,
        "num_heads": 16,
        "out_hidden_size": 2560,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "num_position_embeddings": 2304,
        "deepstack_visual_indexes": [5, 11, 17],
    },
    "tie_word_embeddings": True,
}  # fmt: skip
"""Qwen/Qwen3-VL-4B-Instruct as ``Qwen3VLModel`` (no language-model head; 4.4 B parameters with the vision tower, which
text-only encoding never runs): Krea 2's ``text_encoder`` (``Krea2Pipeline`` stacks the hidden states of 12 of its 36
layers). The shapes of Qwen3-VL-4B-Instruct's ``config.json`` (text: 2560 wide, 36 layers, 32 query / 8 key-value
heads of 128, SwiGLU 9728, Qwen3's 151936 tokens; vision: 24 blocks of 1024, patches of 16, deep-stack taps 5, 11,
17), as Krea's model cards and reference code name it (krea-ai/krea-2 ``inference.py``)."""


def skeleton(config: dict[str, Any], dtype: torch.dtype) -> nn.Module:
    """The encoder ``config`` describes (``_class`` names the transformers class), built on the meta device."""
    import transformers

    options = {k: v for k, v in config.items() if not k.startswith("_")}
    cls = getattr(transformers, config["_class"])
    config_cls = cls.config_class  # CLIPTextConfig, T5Config, Qwen3Config...
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            return cls(config_cls(**options))
    finally:
        torch.set_default_dtype(previous)
