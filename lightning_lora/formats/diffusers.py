"""The diffusers/peft LoRA layout: what ``pipe.load_lora_weights(file)`` reads.

The file holds the peft state dict of the denoiser with the family's denoiser subfolder as prefix (``transformer.`` for
FLUX, ``unet.`` for SDXL and SD1.5)::

    transformer.transformer_blocks.0.attn.to_q.lora_A.weight   [r, in]
    transformer.transformer_blocks.0.attn.to_q.lora_B.weight   [out, r]      (the scale alpha / r folded in)
    transformer.transformer_blocks.0.attn.to_q.lora_magnitude_vector [out]  (DoRA only)

plus, in the safetensors header, ``lora_adapter_metadata``: the peft ``LoraConfig`` as JSON with the same prefix
(diffusers ``loaders/lora_base.py`` ``LORA_ADAPTER_METADATA_KEY``), from which ``load_lora_weights`` rebuilds the
adapter (``loaders/peft.py`` ``load_lora_adapter`` -> ``LoraConfig(**metadata)``).

The scale is in the weights
---------------------------
The file's ``lora_B`` is the trained ``lora_B`` times ``alpha / r``, and the config says ``lora_alpha = r``: the same
function in diffusers (scale 1 on the folded weights), and the only way the file means the same in the other loaders
that read these keys. ComfyUI maps ``transformer.<module>`` keys of FLUX (``comfy/lora.py`` ``model_lora_keys_unet``,
``flux_to_diffusers``) and computes ``alpha / rank`` only from an ``.alpha`` *tensor*, which this layout cannot carry:
diffusers 0.42 refuses a file with both ``.alpha`` tensors and adapter metadata (``load_lora_adapter``: "Both
`network_alphas` and `metadata` cannot be specified"). Without folding, a LoRA trained with alpha = rank / 2 loaded at
twice its strength there; with it, it loads at the trained strength everywhere. ``lightning_lora.alpha`` (our own key)
keeps the trained alpha.

Modules of other ranks (a file converted from another tool) get peft's ``rank_pattern`` / ``alpha_pattern``
(``^<module>`` keys, peft ``utils/other.py`` ``get_pattern_key``), each with alpha = its rank: scale 1 everywhere.

``target_modules`` in that config is a regular expression matching exactly the modules in the file (peft full-matches
a string), not the user's preset: a list of names would be matched as suffixes (``proj_out`` would also hit every
single block's ``proj_out``), and a preset could change meaning between versions.

Variants: DoRA is ``use_dora: true`` plus the magnitude vectors, which ``load_lora_weights`` loads through peft
(``utils/peft_utils.py``). LoKr and LoHa are refused: diffusers 0.42's ``load_lora_weights`` for FLUX.1, SDXL and SD1.5
rejects any file without ``lora`` in its keys ("Invalid LoRA checkpoint", ``loaders/lora_pipeline.py``), so such a
file would load nowhere; the kohya layout holds them.

This module builds the tensors and the header entries (:func:`to_diffusers`) and reads a file of this layout back
into a peft state dict with the scale folded in (:func:`from_diffusers`); :func:`lightning_lora.export.export_lora`
writes the file.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from lightning_lora.formats import FileFacts, LoraFormat
from lightning_lora.formats.adapters import adapters_from_peft, cast
from lightning_lora.lora import LoraOptions, parse_key, peft_config

__all__ = [
    "METADATA_KEY",
    "PREFIXES",
    "DiffusersLayout",
    "adapter_config",
    "common_rank_of",
    "from_diffusers",
    "is_diffusers_file",
    "to_diffusers",
]

METADATA_KEY = "lora_adapter_metadata"
"""The header key diffusers reads the peft config from (``diffusers.loaders.lora_base.LORA_ADAPTER_METADATA_KEY``)."""

PREFIXES = ("transformer", "unet")
"""The denoiser subfolders a diffusers LoRA file's keys start with."""


def adapter_config(ranks: Mapping[str, int], *, dora: bool = False, init: str = "gaussian") -> dict[str, Any]:
    """The peft ``LoraConfig`` fields diffusers rebuilds the adapter from (``LoraConfig(**fields)``) for modules of
    these ``ranks``, with the scale folded into the weights (``lora_alpha`` = rank, per module), a
    ``target_modules`` expression matching exactly those modules, and dropout 0. Sets become sorted lists (JSON)."""
    r = common_rank_of(ranks)
    # Dropout is a training setting: a file that kept it would make diffusers add dropout layers that stay in training
    # mode in a pipeline (random outputs at inference), so it is written as 0.
    options = LoraOptions(rank=r, alpha=float(r), dropout=0.0, init=init, variant="dora" if dora else "lora")  # type: ignore[arg-type]
    config = peft_config(options, "(" + "|".join(re.escape(m) for m in ranks) + ")").to_dict()
    pattern = {"^" + re.escape(m): rank for m, rank in ranks.items() if rank != r}
    config["rank_pattern"] = pattern
    config["alpha_pattern"] = {k: float(v) for k, v in pattern.items()}
    return {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}


def common_rank_of(ranks: Mapping[str, int]) -> int:
    """The most common of ``ranks`` (ties: the first seen)."""
    counts: dict[int, int] = {}
    for rank in ranks.values():
        counts[rank] = counts.get(rank, 0) + 1
    return max(counts, key=lambda rank: counts[rank]) if counts else 1


def to_diffusers(
    state: Mapping[str, Tensor],
    prefix: str,
    *,
    scale: float,
    init: str = "gaussian",
    dtype: torch.dtype | None = None,
) -> tuple[dict[str, Tensor], dict[str, str]]:
    """A LoRA in the diffusers/peft layout: ``(tensors, header entries)``.

    Args:
        state: peft keys without prefix or adapter name (``transformer_blocks.0.attn.to_q.lora_A.weight``; DoRA's
            ``lora_magnitude_vector`` too).
        prefix: the family's denoiser subfolder (``transformer``, ``unet``), the component the pipeline loads it into.
        scale: every module's update is multiplied by this (peft's ``alpha / r``): folded into ``lora_B``.
        init: the ``init_lora_weights`` the config records (it does not change the loaded weights).
        dtype: cast the weights (default: as given); the folding is done in float32 first.

    Returns:
        the tensors under ``<prefix>.<peft key>`` and the header entries ``lora_adapter_metadata`` (the prefixed peft
        config) and ``lightning_lora.target_modules`` (the expression of the adapted modules).

    Raises:
        ValueError: a LoKr or LoHa adapter (see the module docstring), naming the module.
    """
    adapters = adapters_from_peft(state)
    refused = next(((m, a.variant) for m, a in adapters.items() if a.variant not in ("LoRA", "DoRA")), None)
    if refused is not None:
        raise ValueError(
            f"{refused[0]}: a {refused[1]} adapter; diffusers' load_lora_weights loads LoRA and DoRA files only, so a "
            f"diffusers file of it would load nowhere. Export the kohya format (ComfyUI and LyCORIS load {refused[1]})."
        )
    kinds = {a.variant for a in adapters.values()}
    if len(kinds) > 1:  # one LoraConfig: use_dora for all or none; a LoRA layer read as DoRA gets a wrong magnitude
        raise ValueError(
            "some layers are DoRA and others plain LoRA; a diffusers file has one peft config for all layers. Export "
            "the kohya format."
        )
    tensors: dict[str, Tensor] = {}
    for module, adapter in adapters.items():
        b = adapter["lora_B"]
        if scale != 1:
            b = (b.to(torch.promote_types(b.dtype, torch.float32)) * scale).to(b.dtype if dtype is None else dtype)
        tensors[f"{prefix}.{module}.lora_A.weight"] = cast(adapter["lora_A"], dtype)
        tensors[f"{prefix}.{module}.lora_B.weight"] = cast(b, dtype)
        if adapter.variant == "DoRA":
            tensors[f"{prefix}.{module}.lora_magnitude_vector"] = cast(adapter["lora_magnitude_vector"], dtype)
    ranks = {module: int(adapter["lora_A"].shape[0]) for module, adapter in adapters.items()}
    config = adapter_config(ranks, dora=any(a.variant == "DoRA" for a in adapters.values()), init=init)
    metadata = {
        METADATA_KEY: json.dumps({f"{prefix}.{k}": v for k, v in config.items()}, sort_keys=True, default=str),
        "lightning_lora.target_modules": json.dumps(config["target_modules"]),
    }
    return tensors, metadata


def from_diffusers(tensors: Mapping[str, Tensor], metadata: Mapping[str, str]) -> tuple[str, dict[str, Tensor]]:
    """A diffusers/peft LoRA file's ``(prefix, peft state dict)``, every module's scale folded into ``lora_B``.

    The scale of a module is what diffusers would apply: ``lora_alpha / r`` of the file's config (its
    ``alpha_pattern`` / ``rank_pattern`` where they match, peft's ``use_rslora``: ``/ sqrt(r)``); ``alpha / r`` from
    ``.alpha`` tensors when the file has those instead; 1 when it has neither (diffusers' convention). Raises
    ``ValueError`` for a file of another layout or with keys under several prefixes.
    """
    prefixes = {key.partition(".")[0] for key in tensors}
    if len(prefixes) != 1 or next(iter(prefixes)) not in PREFIXES:
        raise ValueError(
            f"not a diffusers LoRA file of one denoiser (its keys start with {sorted(prefixes)[:4]}, expected one of "
            f"{', '.join(PREFIXES)})"
        )
    prefix = prefixes.pop()
    n = len(prefix) + 1
    raw = {key[n:]: tensor for key, tensor in tensors.items()}
    alphas = {key.removesuffix(".alpha"): float(t) for key, t in raw.items() if key.endswith(".alpha")}
    state = {key: t for key, t in raw.items() if not key.endswith(".alpha")}
    config = _config(metadata.get(METADATA_KEY), prefix)
    adapters = adapters_from_peft(state)
    out: dict[str, Tensor] = {}
    for module, adapter in adapters.items():
        if adapter.variant not in ("LoRA", "DoRA"):
            out.update({f"{module}.{k}": v for k, v in adapter.tensors.items()})
            continue
        r = int(adapter["lora_A"].shape[0])
        if config is not None:
            alpha = float(_pattern(config.get("alpha_pattern") or {}, module, config.get("lora_alpha", r)))
            r_config = int(_pattern(config.get("rank_pattern") or {}, module, config.get("r", r)))
            scale = alpha / (math.sqrt(r_config) if config.get("use_rslora") else r_config)
        else:
            scale = alphas[module] / r if module in alphas else 1.0
        b = adapter["lora_B"]
        out[f"{module}.lora_A.weight"] = adapter["lora_A"]
        out[f"{module}.lora_B.weight"] = b if scale == 1 else (b.float() * scale).to(b.dtype)
        if adapter.variant == "DoRA":
            out[f"{module}.lora_magnitude_vector"] = adapter["lora_magnitude_vector"]
    return prefix, out


def _config(text: str | None, prefix: str) -> dict[str, Any] | None:
    if not text:
        return None
    raw = json.loads(text)
    n = len(prefix) + 1
    scoped = {k[n:]: v for k, v in raw.items() if k.startswith(prefix + ".")}
    return scoped or raw


def _pattern(patterns: Mapping[str, Any], module: str, default: Any) -> Any:
    """peft's rule (``utils/other.py`` ``get_pattern_key``): the first key ``k`` with ``(.*\\.)?(k)$`` matching the
    module name."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def is_diffusers_file(tensors: Mapping[str, Tensor]) -> bool:
    """Whether the keys are peft keys under one of :data:`PREFIXES` (``unet.<module>.lora_A.weight``...)."""
    return bool(tensors) and all(
        key.partition(".")[0] in PREFIXES and (key.endswith(".alpha") or parse_key(key) is not None) for key in tensors
    )


@dataclass(frozen=True)
class DiffusersLayout:
    """The diffusers / peft layout as one family serves it: the keys under the family's denoiser subfolder. A family
    lists it in its ``lora_files.layouts``."""

    prefix: str
    """The family's denoiser subfolder (``transformer``, ``unet``): the keys' prefix, the pipeline component."""
    format: ClassVar[LoraFormat] = "diffusers"

    def write(self, state: Mapping[str, Tensor], file: FileFacts) -> tuple[dict[str, Tensor], dict[str, str]]:
        """The file's tensors and header entries (:func:`to_diffusers`; the rank, alpha and title are not needed: the
        scale is folded into the weights and the config says so)."""
        return to_diffusers(state, self.prefix, scale=file.scale, init=file.init, dtype=file.dtype)

    def read(self, tensors: Mapping[str, Tensor], metadata: Mapping[str, str]) -> dict[str, Tensor]:
        """A diffusers file as a peft state dict, the scale folded in (:func:`from_diffusers`); ``ValueError`` for a
        file of another denoiser."""
        prefix, state = from_diffusers(tensors, metadata)
        if prefix != self.prefix:
            raise ValueError(f"holds a {prefix} LoRA, but the family's denoiser is the {self.prefix}.")
        return state
