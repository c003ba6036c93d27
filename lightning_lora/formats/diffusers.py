"""The diffusers/peft LoRA layout: what ``pipe.load_lora_weights(file)`` reads.

The file holds the peft state dict of the denoiser with the family's denoiser subfolder as prefix (``transformer.`` for
FLUX, ``unet.`` for SDXL and SD1.5)::

    transformer.transformer_blocks.0.attn.to_q.lora_A.weight   [r, in]
    transformer.transformer_blocks.0.attn.to_q.lora_B.weight   [out, r]

plus, in the safetensors header, ``lora_adapter_metadata``: the peft ``LoraConfig`` as JSON with the same prefix.
diffusers' ``load_lora_weights`` reads rank and alpha from it; without it a LoRA trained with alpha != rank would load
with the wrong scale. The config comes from the one :func:`lightning_lora.lora.peft_config`, so the file says exactly
what training built.

``target_modules`` in that config is a regular expression matching exactly the modules in the file (peft full-matches
a string), not the user's preset: a list of names would be matched as suffixes (``proj_out`` would also hit every
single block's ``proj_out``), and a preset could change meaning between versions.

This module builds the tensors and the header entries; :func:`lightning_lora.export.export_lora` writes the file.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from lightning_lora.lora import LoraOptions, peft_config, split_lora_state

__all__ = ["METADATA_KEY", "adapter_config", "to_diffusers"]

METADATA_KEY = "lora_adapter_metadata"
"""The header key diffusers reads the peft config from (``diffusers.loaders.lora_base.LORA_ADAPTER_METADATA_KEY``)."""


def adapter_config(modules: list[str], options: LoraOptions) -> dict[str, Any]:
    """The peft ``LoraConfig`` fields diffusers rebuilds the adapter from (``LoraConfig(**fields)``), with a
    ``target_modules`` expression matching exactly ``modules`` (see the module docstring). Sets become sorted lists
    (JSON)."""
    # Numbers as numbers of their type (alpha resolved), whatever the caller's options held: the JSON of the header
    # is the same for the same LoRA. Dropout is a training setting: a file that kept it would make diffusers add
    # dropout layers that stay in training mode in a pipeline (random outputs at inference), so it is written as 0.
    options = LoraOptions(rank=int(options.rank), alpha=options.scale_alpha, dropout=0.0, init=options.init)
    config = peft_config(options, "(" + "|".join(re.escape(m) for m in modules) + ")").to_dict()
    return {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}


def to_diffusers(
    state: Mapping[str, Tensor], prefix: str, options: LoraOptions, *, dtype: torch.dtype | None = None
) -> tuple[dict[str, Tensor], dict[str, str]]:
    """A LoRA in the diffusers/peft layout: ``(tensors, header entries)``.

    Args:
        state: peft keys without prefix or adapter name (``transformer_blocks.0.attn.to_q.lora_A.weight``).
        prefix: the family's denoiser subfolder (``transformer``, ``unet``), the component the pipeline loads it into.
        options: the LoRA options (rank, alpha, init) the peft config is made of (dropout: written as 0).
        dtype: cast the weights (default: as given).

    Returns:
        the tensors under ``<prefix>.<peft key>`` and the header entries ``lora_adapter_metadata`` (the prefixed peft
        config) and ``lightning_lora.target_modules`` (the expression of the adapted modules).
    """
    config = adapter_config(list(split_lora_state(state)), options)
    adapter = {f"{prefix}.{k}": v for k, v in config.items()}
    metadata = {
        METADATA_KEY: json.dumps(adapter, sort_keys=True, default=str),
        "lightning_lora.target_modules": json.dumps(config["target_modules"]),
    }
    tensors = {f"{prefix}.{k}": (v.to(dtype) if dtype is not None else v) for k, v in state.items()}
    return tensors, metadata
