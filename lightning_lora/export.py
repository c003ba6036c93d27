"""Export the trained LoRA as a safetensors file that diffusers loads.

The diffusers/peft layout of a FLUX LoRA is the peft state dict of the transformer with a ``transformer.`` prefix::

    transformer.transformer_blocks.0.attn.to_q.lora_A.weight   [r, in]
    transformer.transformer_blocks.0.attn.to_q.lora_B.weight   [out, r]

plus, in the safetensors header, ``lora_adapter_metadata``: the peft ``LoraConfig`` as JSON with the same prefix.
diffusers' ``load_lora_weights`` reads rank and alpha from it; without it a LoRA trained with alpha != rank would load
with the wrong scale. Our own metadata (``lightning_lora.*`` keys: base model, family, rank, alpha, targets, steps)
sits beside it; safetensors metadata values are strings.

The file is written atomically, so an interrupted export never leaves a half file.

Two ways in, one way out
------------------------
:func:`save_lora` writes from the live peft model (the end-of-training callback). :func:`export_lora` writes from a
plain peft-style state dict (``<module>.lora_A.weight``, no prefix, no adapter name) in either format: ``diffusers``
(above) or ``kohya`` (for ComfyUI, Forge and sd-scripts: BFL module names with fused q/k/v for FLUX, the original
SGM names for SDXL, diffusers names for SD1.5; see :mod:`lightning_lora.export_kohya`). :func:`checkpoint_lora` gets
that state dict, the LoRA options and the step from a Lightning checkpoint without loading the base model, so
``lightning-lora export`` takes a second, not a 24 GB load.
"""

from __future__ import annotations

import json
import pickle
import re
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from lightning_lora import __version__
from lightning_lora.errors import ConfigError, first_line
from lightning_lora.export_kohya import (
    flux_to_kohya,
    kohya_flux_metadata,
    kohya_sd15_metadata,
    kohya_sdxl_metadata,
    sd15_to_kohya,
    sdxl_to_kohya,
)
from lightning_lora.io import save_safetensors
from lightning_lora.lora import LoraOptions, adapter_state, peft_config, split_lora_state

__all__ = ["FORMATS", "checkpoint_lora", "export_lora", "read_metadata", "save_lora"]

#: The file layouts :func:`export_lora` writes.
FORMATS = ("diffusers", "kohya")

_METADATA_KEY = "lora_adapter_metadata"  # diffusers.loaders.lora_base.LORA_ADAPTER_METADATA_KEY


def save_lora(
    denoiser: nn.Module,
    path: str | Path,
    *,
    family: str,
    lora: Mapping[str, Any],
    info: Mapping[str, Any],
    format: Literal["diffusers", "kohya"] = "diffusers",
    dtype: torch.dtype | None = None,
) -> Path:
    """Write the LoRA of a live peft model (adapter ``default``) to ``path``; see :func:`export_lora`."""
    from peft.utils import get_peft_model_state_dict

    state = get_peft_model_state_dict(denoiser, unwrap_compiled=True)
    return export_lora(state, path, format=format, lora=lora, info=info, family=family, dtype=dtype)


def read_metadata(path: str | Path) -> dict[str, str]:
    """The safetensors header metadata of a LoRA file."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata() or {})


# --------------------------------------------------------------------------------------------- from a state dict

# family name -> (peft state, alpha, dtype) -> kohya tensors. The one place that knows which family has a kohya layout.
_KOHYA_CONVERTERS: dict[str, Callable[..., dict[str, torch.Tensor]]] = {
    "flux": flux_to_kohya,
    "sdxl": sdxl_to_kohya,
    "sd15": sd15_to_kohya,
}
_KOHYA_METADATA: dict[str, Callable[..., dict[str, str]]] = {
    "flux": kohya_flux_metadata,
    "sdxl": kohya_sdxl_metadata,
    "sd15": kohya_sd15_metadata,
}


def export_lora(
    state: Mapping[str, torch.Tensor],
    path: str | Path,
    *,
    format: Literal["diffusers", "kohya"],
    lora: Mapping[str, Any],
    info: Mapping[str, Any],
    family: str = "flux",
    dtype: torch.dtype | None = None,
) -> Path:
    """Write a LoRA given as a peft-style state dict to ``path`` (safetensors, atomically) in ``format``.

    Args:
        state: ``{"<module>.lora_A.weight": [r, in], "<module>.lora_B.weight": [out, r]}``, module names of the
            denoiser without prefix or adapter name (what :func:`checkpoint_lora` returns).
        path: the ``.safetensors`` file to write (replaced atomically if it exists: callers decide about overwriting).
        format: ``diffusers`` (peft keys under the family's ``denoiser_subfolder``, ``transformer.`` or ``unet.``,
            with ``lora_adapter_metadata``) or ``kohya`` (``lora_unet_<module>`` keys with ``.alpha``; module names
            as sd-scripts has them for the family, see :mod:`lightning_lora.export_kohya`).
        lora: the LoRA options: ``rank``, ``alpha`` (None means rank), optionally ``targets``, ``dropout``, ``init``.
        info: our metadata (base model, steps...), stored as ``lightning_lora.<key>`` strings.
        family: the model family's registry name.
        dtype: cast the weights (bf16 halves the file); default keeps them as given. kohya ``alpha`` stays float32.
    """
    from lightning_lora.families import FAMILIES

    if family not in FAMILIES:
        raise ConfigError(f"family {family!r} is not one of {sorted(FAMILIES)}")
    pairs = split_lora_state(state)
    if not pairs:
        raise ConfigError("the LoRA state dict is empty: nothing to export")
    rank = int(lora["rank"])
    wrong = [m for m, (a, _) in pairs.items() if a.shape[0] != rank]
    if wrong:
        raise ConfigError(f"{wrong[0]}: rank {pairs[wrong[0]][0].shape[0]} but the LoRA options say rank {rank}")
    alpha = float(lora.get("alpha") or rank)
    targets = lora.get("targets")
    metadata = {
        "format": "pt",
        "lightning_lora.version": __version__,
        "lightning_lora.format": format,
        "lightning_lora.rank": str(rank),
        "lightning_lora.alpha": str(alpha),
    }
    if targets is not None:
        metadata["lightning_lora.targets"] = json.dumps(targets)
    if format == "diffusers":
        prefix = FAMILIES[family].denoiser_subfolder
        config = _peft_config(list(pairs), rank, alpha, lora)
        adapter = {f"{prefix}.{k}": v for k, v in config.items()}
        metadata[_METADATA_KEY] = json.dumps(adapter, sort_keys=True, default=str)
        metadata["lightning_lora.target_modules"] = json.dumps(config["target_modules"])
        tensors = {f"{prefix}.{k}": (v.to(dtype) if dtype is not None else v) for k, v in state.items()}
    elif format == "kohya":
        if family not in _KOHYA_CONVERTERS:
            raise ConfigError(f"--format kohya: there is no kohya layout for {family!r} yet; use --format diffusers.")
        tensors = _KOHYA_CONVERTERS[family](state, alpha, dtype=dtype)
        metadata.update(_KOHYA_METADATA[family](rank, alpha, title=Path(path).stem))
    else:
        raise ConfigError(f"--format: {format!r} is not one of {', '.join(FORMATS)}")
    metadata.update({f"lightning_lora.{k}": v if isinstance(v, str) else json.dumps(v) for k, v in info.items()})
    return save_safetensors(tensors, path, metadata=metadata)


def _peft_config(modules: list[str], rank: int, alpha: float, lora: Mapping[str, Any]) -> dict[str, Any]:
    """The peft ``LoraConfig`` fields diffusers rebuilds the adapter from (``LoraConfig(**fields)``).

    ``target_modules`` is a regular expression matching exactly the modules in the file (peft full-matches a string),
    not the user's preset: a list of names would be matched as suffixes (``proj_out`` would also hit every single
    block's ``proj_out``), and a preset could change meaning between versions.
    """
    options = LoraOptions(
        rank=rank, alpha=alpha, dropout=float(lora.get("dropout") or 0.0), init=lora.get("init") or "gaussian"
    )
    config = peft_config(options, "(" + "|".join(re.escape(m) for m in modules) + ")").to_dict()
    return {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}


# --------------------------------------------------------------------------------------------- from a checkpoint


def checkpoint_lora(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    """The LoRA in a Lightning checkpoint of ``lightning-lora fit``, without loading the base model.

    Returns ``(state, lora, info)``: ``state`` in peft keys without prefix or adapter name
    (``transformer_blocks.0.attn.to_q.lora_A.weight``), ``lora`` the LoRA options (``rank``, ``alpha`` resolved to a
    number, ``targets``, ``dropout``, ``init``), ``info`` what :func:`export_lora` stores as metadata (``family``,
    ``base_model``, ``denoiser_file``, ``steps``, ``checkpoint``). The file is read with ``weights_only=True``: a
    checkpoint cannot run code. Raises :class:`ConfigError` naming the file for a missing, corrupt or foreign one.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(
            f"{path}: no such checkpoint. Pass a .ckpt written by `lightning-lora fit`, e.g. "
            "runs/lora/checkpoints/last.ckpt."
        )
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, pickle.UnpicklingError, zipfile.BadZipFile, EOFError, ValueError, OSError) as e:
        reason = first_line(e, 200)
        raise ConfigError(
            f"{path}: cannot be read as a checkpoint ({reason}). It is damaged (an interrupted copy?) or not a "
            "checkpoint of `lightning-lora fit`: pass another .ckpt from the run's checkpoints/ folder."
        ) from None
    saved = checkpoint.get("state_dict") if isinstance(checkpoint, dict) else None
    state = adapter_state(saved or {})  # every adapter tensor: a variant a format cannot hold is refused by name
    if not state:
        raise ConfigError(
            f"{path}: holds no LoRA tensors (keys denoiser.<module>.lora_A.default.weight); it is not a checkpoint of "
            "`lightning-lora fit`."
        )
    hparams = checkpoint.get("hyper_parameters") or {}
    options = dict(hparams.get("lora") or {})
    rank = int(options.get("rank") or next(t.shape[0] for k, t in state.items() if k.endswith(".lora_A.weight")))
    lora = {
        "rank": rank,
        "alpha": float(options.get("alpha") or rank),
        "targets": options.get("targets"),
        "dropout": float(options.get("dropout") or 0.0),
        "init": options.get("init", "gaussian"),
    }
    denoiser_file = hparams.get("denoiser_file")
    info = {
        "family": _family_name(hparams.get("family"), path),
        "base_model": str(hparams.get("pretrained") or ""),
        "denoiser_file": Path(denoiser_file).name if denoiser_file else "",
        "steps": int(checkpoint.get("global_step", 0)),
        "checkpoint": path.name,
    }
    return state, lora, info


def _family_name(family: Any, path: Path) -> str:
    """The registry name of the family saved as ``{"class_path": ..., "init_args": ...}`` (default: flux)."""
    from lightning_lora.families import FAMILIES

    class_path = family.get("class_path") if isinstance(family, dict) else None
    if not class_path:
        return "flux"
    wanted = class_path.rsplit(".", 1)[-1]
    for name, cls in FAMILIES.items():
        if cls.__qualname__ == wanted:
            return name
    raise ConfigError(f"{path}: was trained with the model family {class_path!r}, which this version does not know.")
