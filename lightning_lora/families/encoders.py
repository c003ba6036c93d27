"""The text encoders the families cache with, as architectures: what the memory planner needs to size the caching phase
(the encoders are loaded once, before training, to turn every caption into embeddings).

FLUX.1 encodes with CLIP-L (123 M parameters, the pooled vector) and T5-XXL's encoder (4.76 B: ~8.9 GiB in bf16, the
largest single thing many users load); SDXL with CLIP-L and OpenCLIP ViT-bigG (695 M); SD1.5 with CLIP-L. Their
``config.json`` fields that decide the shapes ship here, so a plan of the shipped configs needs no download; a local
folder's own configs are read instead. :func:`skeleton` builds one on the meta device (shapes, no memory).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["CLIP_L", "OPENCLIP_BIGG", "T5_XXL", "skeleton"]

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


def skeleton(config: dict[str, Any], dtype: torch.dtype) -> nn.Module:
    """The encoder ``config`` describes (``_class`` names the transformers class), built on the meta device."""
    import transformers

    options = {k: v for k, v in config.items() if not k.startswith("_")}
    cls = getattr(transformers, config["_class"])
    config_cls = transformers.T5Config if config["_class"].startswith("T5") else transformers.CLIPTextConfig
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            return cls(config_cls(**options))
    finally:
        torch.set_default_dtype(previous)
