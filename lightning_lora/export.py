"""Export the trained LoRA as a safetensors file that diffusers, ComfyUI, Forge or kohya's sd-scripts load.

A LoRA file is the adapter's tensors in one of the layouts of :mod:`lightning_lora.formats` (``diffusers``: peft keys
with ``lora_adapter_metadata``; ``kohya``: ``lora_unet_<module>`` keys with one ``alpha`` per module), plus our own
metadata (``lightning_lora.*`` keys: version, format, rank, alpha, targets, and what the caller passes as ``info``:
base model, family, steps...); safetensors metadata values are strings.

The file is written atomically, so an interrupted export never leaves a half file.

Who decides what
----------------
The *family* decides which formats it writes (:attr:`~lightning_lora.families.base.DiffusionFamily.lora_formats`) and
how its modules are named in the kohya layout (:meth:`~lightning_lora.families.base.DiffusionFamily.kohya_lora`); the
*format* decides which adapter variants a file can hold (:data:`lightning_lora.formats.VARIANTS`). A request outside
either is refused with the reason (a family without a kohya layout, a DoRA adapter for a LoRA-only format), never
answered with a file that holds less than was trained.

Two ways in, one way out
------------------------
:func:`save_lora` writes from the live peft model (the end-of-training callback). :func:`export_lora` writes from a
plain peft-style state dict (``<module>.lora_A.weight``, no prefix, no adapter name). :func:`checkpoint_lora` gets that
state dict, the LoRA options, the family and the step from a Lightning checkpoint without loading the base model, so
``lightning-lora export`` takes seconds, not a 24 GB load.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from lightning_lora import __version__
from lightning_lora.errors import ConfigError
from lightning_lora.families import FAMILIES, DiffusionFamily
from lightning_lora.formats import FORMATS, VARIANTS, LoraFormat
from lightning_lora.formats.diffusers import to_diffusers
from lightning_lora.io import save_safetensors
from lightning_lora.lora import LoraOptions, adapter_state, parse_key, split_lora_state

__all__ = ["FORMATS", "CheckpointLora", "checkpoint_lora", "export_lora", "read_metadata", "save_lora"]


def save_lora(
    denoiser: nn.Module,
    path: str | Path,
    *,
    family: DiffusionFamily,
    lora: LoraOptions,
    info: Mapping[str, Any],
    format: LoraFormat = "diffusers",
    dtype: torch.dtype | None = None,
) -> Path:
    """Write the LoRA of a live peft model (adapter ``default``) to ``path``; see :func:`export_lora`."""
    from peft.utils import get_peft_model_state_dict

    state = get_peft_model_state_dict(denoiser, unwrap_compiled=True)
    return export_lora(state, path, format=format, lora=lora, family=family, info=info, dtype=dtype)


def read_metadata(path: str | Path) -> dict[str, str]:
    """The safetensors header metadata of a LoRA file."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata() or {})


# --------------------------------------------------------------------------------------------- from a state dict


def export_lora(
    state: Mapping[str, torch.Tensor],
    path: str | Path,
    *,
    format: LoraFormat,
    lora: LoraOptions,
    family: DiffusionFamily,
    info: Mapping[str, Any],
    dtype: torch.dtype | None = None,
) -> Path:
    """Write a LoRA given as a peft-style state dict to ``path`` (safetensors, atomically) in ``format``.

    Args:
        state: ``{"<module>.lora_A.weight": [r, in], "<module>.lora_B.weight": [out, r]}``, module names of the
            denoiser without prefix or adapter name (what :func:`checkpoint_lora` returns).
        path: the ``.safetensors`` file to write (replaced atomically if it exists: callers decide about overwriting).
        format: ``diffusers`` (peft keys under the family's ``denoiser_subfolder``, ``transformer.`` or ``unet.``,
            with ``lora_adapter_metadata``; :mod:`lightning_lora.formats.diffusers`) or ``kohya``
            (``lora_unet_<module>`` keys with ``.alpha``, module names as sd-scripts has them for the family;
            :mod:`lightning_lora.formats.kohya`). It must be one of the family's ``lora_formats``.
        lora: the LoRA options the state was trained with (rank, alpha, targets, dropout, init).
        family: the model family the LoRA belongs to; it names the modules in its formats.
        info: our metadata (base model, steps...), stored as ``lightning_lora.<key>`` strings.
        dtype: cast the weights (bf16 halves the file); default keeps them as given. kohya ``alpha`` stays float32.

    Raises:
        ConfigError: a format the family does not write, an adapter variant the format cannot hold, an empty state,
            a rank other than the options'. ``ValueError``: a module the format has no name for, a malformed state.
    """
    if format not in FORMATS:
        raise ConfigError(f"--format: {format!r} is not one of {', '.join(FORMATS)}")
    if format not in family.lora_formats:
        raise family.format_refused(format)
    _check_variants(state, format, family)
    pairs = split_lora_state(state)
    if not pairs:
        raise ConfigError("the LoRA state dict is empty: nothing to export")
    rank, alpha = int(lora.rank), lora.scale_alpha
    wrong = [m for m, (a, _) in pairs.items() if a.shape[0] != rank]
    if wrong:
        raise ConfigError(f"{wrong[0]}: rank {pairs[wrong[0]][0].shape[0]} but the LoRA options say rank {rank}")
    metadata = {
        "format": "pt",
        "lightning_lora.version": __version__,
        "lightning_lora.format": format,
        "lightning_lora.rank": str(rank),
        "lightning_lora.alpha": str(alpha),
    }
    if lora.targets is not None:
        metadata["lightning_lora.targets"] = json.dumps(lora.targets)
    if format == "diffusers":
        tensors, header = to_diffusers(state, family.denoiser_subfolder, lora, dtype=dtype)
    else:  # kohya: the family names its modules
        tensors = family.kohya_lora(state, alpha, dtype=dtype)
        header = family.kohya_metadata(rank, alpha, title=Path(path).stem)
    metadata.update(header)
    metadata.update({f"lightning_lora.{k}": v if isinstance(v, str) else json.dumps(v) for k, v in info.items()})
    return save_safetensors(tensors, path, metadata=metadata)


def _check_variants(state: Mapping[str, torch.Tensor], format: str, family: DiffusionFamily) -> None:
    """Refuse an adapter variant (DoRA, LoKr...) that files of ``format`` cannot hold, naming it and the format."""
    for key in state:
        parsed = parse_key(key)
        if parsed is None or parsed.variant in VARIANTS[format]:
            continue
        variant = parsed.variant
        holds = [f for f in family.lora_formats if variant in VARIANTS[f]]
        instead = (
            f"Export it with --format {holds[0]}." if holds else f"No format lightning-lora writes holds {variant} yet."
        )
        raise ConfigError(
            f"--format {format}: the LoRA is a {variant} adapter ({key!r}), and a {format} file holds "
            f"{' and '.join(VARIANTS[format])} only: writing it would drop the {variant} tensors and change what the "
            f"adapter does. {instead}"
        )


# --------------------------------------------------------------------------------------------- from a checkpoint


class CheckpointLora(NamedTuple):
    """What :func:`checkpoint_lora` reads from a training checkpoint: everything :func:`export_lora` needs."""

    state: dict[str, torch.Tensor]
    """The adapter tensors in peft keys without prefix or adapter name
    (``transformer_blocks.0.attn.to_q.lora_A.weight``); a variant's tensors (DoRA's
    ``<module>.lora_magnitude_vector``) included, for the format to accept or refuse."""
    lora: LoraOptions
    """The LoRA options the run trained with."""
    family: DiffusionFamily
    """The run's model family, built with its saved options."""
    info: dict[str, Any]
    """What :func:`export_lora` stores as metadata: ``family`` (its name), ``base_model``, ``denoiser_file``,
    ``steps``, ``checkpoint``."""


def checkpoint_lora(path: str | Path) -> CheckpointLora:
    """The LoRA in a Lightning checkpoint of ``lightning-lora fit``, without loading the base model.

    The file is read by :func:`lightning_lora.checkpoint.read_checkpoint` (``weights_only=True``: a checkpoint cannot
    run code). Raises :class:`ConfigError` naming the file for a missing, corrupt or foreign one.
    """
    from lightning_lora.checkpoint import read_checkpoint

    path = Path(path)
    checkpoint = read_checkpoint(
        path,
        option="checkpoint",
        fix="Pass a .ckpt written by `lightning-lora fit`, e.g. runs/lora/checkpoints/last.ckpt.",
    )
    state = adapter_state(checkpoint.get("state_dict") or {})  # every adapter tensor: the format accepts or refuses
    if not state:
        raise ConfigError(
            f"{path}: holds no LoRA tensors (keys denoiser.<module>.lora_A.default.weight); it is not a checkpoint of "
            "`lightning-lora fit`."
        )
    hparams = checkpoint.get("hyper_parameters") or {}
    trained_rank = next((int(t.shape[0]) for k, t in state.items() if k.endswith(".lora_A.weight")), 1)
    lora = LoraOptions.from_saved(hparams.get("lora"), trained_rank)
    family = _family(hparams.get("family"), path)
    denoiser_file = hparams.get("denoiser_file")
    info = {
        "family": family.name,
        "base_model": str(hparams.get("pretrained") or ""),
        "denoiser_file": Path(denoiser_file).name if denoiser_file else "",
        "steps": int(checkpoint.get("global_step", 0)),
        "checkpoint": path.name,
    }
    return CheckpointLora(state, lora, family, info)


def _family(saved: Any, path: Path) -> DiffusionFamily:
    """The family saved as ``{"class_path": ..., "init_args": ...}`` (none saved: FLUX), looked up in the registry by
    its class path and built with its saved options when they are plain values and still valid, else with defaults:
    export needs the family's identity and layouts, which its training options do not change."""
    class_path = saved.get("class_path") if isinstance(saved, dict) else None
    if not class_path:
        return FAMILIES["flux"]()
    qualname = str(class_path).rsplit(".", 1)[-1]
    exact = [c for c in FAMILIES.values() if f"{c.__module__}.{c.__qualname__}" == class_path]
    matches = exact or [c for c in FAMILIES.values() if c.__qualname__ == qualname]
    if not matches:
        raise ConfigError(
            f"{path}: was trained with the model family {class_path!r}, which this version does not know "
            f"(it knows {', '.join(sorted(FAMILIES))})."
        )
    cls = matches[0]
    init_args = saved.get("init_args")
    parameters = inspect.signature(cls).parameters
    kwargs = {k: v for k, v in init_args.items() if k in parameters} if isinstance(init_args, dict) else {}
    if all(_plain(v) for v in kwargs.values()):
        try:
            return cls(**kwargs)
        except (TypeError, ValueError):  # options of another version (ConfigError is a ValueError)
            pass
    return cls()


def _plain(value: Any) -> bool:
    if value is None or isinstance(value, bool | int | float | str):
        return True
    if isinstance(value, list | tuple):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return False
