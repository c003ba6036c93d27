"""Export the trained LoRA as a safetensors file that diffusers loads.

The diffusers/peft layout of a FLUX LoRA is the peft state dict of the transformer with a ``transformer.`` prefix::

    transformer.transformer_blocks.0.attn.to_q.lora_A.weight   [r, in]
    transformer.transformer_blocks.0.attn.to_q.lora_B.weight   [out, r]

plus, in the safetensors header, ``lora_adapter_metadata``: the peft ``LoraConfig`` as JSON with the same prefix.
diffusers' ``load_lora_weights`` reads rank and alpha from it; without it a LoRA trained with alpha != rank would load
with the wrong scale. Our own metadata (``lightning_lora.*`` keys: base model, family, rank, alpha, targets, steps)
sits beside it; safetensors metadata values are strings.

The file is written atomically, so an interrupted export never leaves a half file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_lora import __version__
from lightning_lora.io import save_safetensors

__all__ = ["lora_state_dict", "save_lora", "read_metadata"]

_METADATA_KEY = "lora_adapter_metadata"  # diffusers.loaders.lora_base.LORA_ADAPTER_METADATA_KEY


def lora_state_dict(denoiser: nn.Module, prefix: str, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The adapter's tensors with diffusers key names (``<prefix>.<module>.lora_A.weight``)."""
    from peft.utils import get_peft_model_state_dict

    state = get_peft_model_state_dict(denoiser, unwrap_compiled=True)
    return {f"{prefix}.{k}": (v.to(dtype) if dtype is not None else v) for k, v in state.items()}


def save_lora(
    denoiser: nn.Module,
    path: str | Path,
    *,
    prefix: str,
    info: dict[str, Any],
    dtype: torch.dtype | None = None,
) -> Path:
    """Write the denoiser's LoRA to ``path`` in diffusers format, with metadata, atomically.

    Args:
        denoiser: the model carrying the peft adapter ``default``.
        path: the ``.safetensors`` file to write.
        prefix: the pipeline component name (``transformer`` for FLUX, ``unet`` for SD).
        info: our metadata (base model, family, steps...); stored as ``lightning_lora.<key>`` strings.
        dtype: cast the tensors (e.g. bf16 halves the file); default keeps float32.
    """
    config = denoiser.peft_config["default"].to_dict()  # type: ignore[union-attr,index]
    config = {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}
    metadata = {
        "format": "pt",
        _METADATA_KEY: json.dumps({f"{prefix}.{k}": v for k, v in config.items()}, sort_keys=True, default=str),
        "lightning_lora.version": __version__,
        "lightning_lora.format": "diffusers",
        "lightning_lora.rank": str(config["r"]),
        "lightning_lora.alpha": str(config["lora_alpha"]),
        "lightning_lora.target_modules": json.dumps(config["target_modules"], default=str),
    }
    metadata.update({f"lightning_lora.{k}": v if isinstance(v, str) else json.dumps(v) for k, v in info.items()})
    return save_safetensors(lora_state_dict(denoiser, prefix, dtype), path, metadata=metadata)


def read_metadata(path: str | Path) -> dict[str, str]:
    """The safetensors header metadata of a LoRA file."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata() or {})
