"""``lightning-lora export``: write a LoRA as a file other tools load, from a training checkpoint or another LoRA file.

::

    lightning-lora export runs/lora/checkpoints/last.ckpt --format kohya --out my_lora_comfy.safetensors
    lightning-lora export runs/lora/checkpoints/step000500.ckpt --format diffusers --out lora.safetensors --dtype bf16
    lightning-lora export someone_elses_lora.safetensors --format diffusers --out for_diffusers.safetensors
    lightning-lora export old_diffusers_lora.safetensors --format kohya --family sdxl --out for_comfyui.safetensors
    lightning-lora export runs/lora/checkpoints/last.ckpt --ema --format kohya --out lora_ema.safetensors
    lightning-lora export runs/lora/checkpoints/last.ckpt --ema-sigma-rel 0.08 --format kohya --out phema.safetensors

``diffusers`` files load with ``pipe.load_lora_weights(file)`` (and, for FLUX, in ComfyUI); ``kohya`` files (BFL module
names with fused q/k/v for FLUX, SGM names for SDXL, diffusers names with ``_`` for SD1.5) load in ComfyUI, Forge,
kohya's sd-scripts and in diffusers too. After writing, the command says which tools apply every layer of the file
and, per tool, which layers it skips and why (:mod:`lightning_lora.formats.clients`).

From a checkpoint only its LoRA tensors are read (with ``weights_only=True``); the base model is not loaded. A run with
a ``LoraEMA`` callback also gives the EMA of its LoRA (``--ema``) or, when it kept snapshots, the power-function EMA of
any width ``--ema-sigma-rel`` (post-hoc EMA, :mod:`lightning_lora.ema`), in either layout. From a
``.safetensors`` LoRA file (a diffusers or kohya one, made by lightning-lora or another trainer), the file is converted:
a diffusers file by its own config, a kohya file by diffusers' own converter; the family comes from ``--family``, the
file's metadata or its keys. The output is written atomically and an existing file is never replaced without
``--overwrite``. Problems the user can fix print one line naming the file and the fix, exit status 2: among them an
output that cannot be written (a read-only folder, a full disk, a file-size limit), which leaves nothing behind.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
from typing import Any, NamedTuple

import torch

from lightning_lora.cli.help import VerbParser
from lightning_lora.errors import ConfigError, first_line
from lightning_lora.export import (
    FORMATS,
    checkpoint_lora,
    convert_lora_file,
    export_lora,
    file_coverage,
    read_lora_file,
)
from lightning_lora.families import FAMILIES
from lightning_lora.formats.clients import TOOL_NAMES
from lightning_lora.io import write_failure
from lightning_lora.precision import DTYPES

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    parser = VerbParser(
        prog="lightning-lora export",
        description="Write the LoRA of a lightning-lora checkpoint, or convert a LoRA file, as a diffusers or "
        "kohya/ComfyUI safetensors file.",
    )
    parser.add_argument(
        "checkpoint",
        type=Path,
        help="a .ckpt written by `lightning-lora fit` (e.g. .../last.ckpt), or a .safetensors LoRA file to convert",
    )
    parser.add_argument(
        "--format",
        choices=FORMATS,
        required=True,
        help="diffusers: peft keys, for pipe.load_lora_weights (FLUX: ComfyUI too); kohya: lora_unet_ keys, for "
        "ComfyUI/Forge/sd-scripts (and diffusers)",
    )
    parser.add_argument("--out", type=Path, required=True, help="the .safetensors file to write")
    parser.add_argument(
        "--family",
        choices=sorted(FAMILIES),
        default=None,
        help="the model family of a .safetensors input (default: from its metadata or keys)",
    )
    parser.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32", help="tensor dtype in the file")
    parser.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    averaged = parser.add_mutually_exclusive_group()
    averaged.add_argument(
        "--ema", action="store_true", help="from a checkpoint of a run with LoraEMA: its EMA instead of the raw LoRA"
    )
    averaged.add_argument(
        "--ema-sigma-rel",
        type=float,
        default=None,
        metavar="SIGMA_REL",
        help="from a checkpoint of a run with LoraEMA snapshots: the power-function EMA of this width (0.05: about the "
        "last tenth of the run; up to 0.2887), reconstructed from the snapshots (post-hoc EMA)",
    )
    return parser


def main(argv: list[str]) -> int:
    """Run ``lightning-lora export`` with ``argv`` (the arguments after ``export``); return the exit status."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # argparse printed usage (status 2) or --help (status 0)
        return int(e.code or 0)
    try:
        averaged = Averaged(args.ema, args.ema_sigma_rel)
        path, notes = _export(
            args.checkpoint, args.format, args.out, DTYPES[args.dtype], args.overwrite, args.family, averaged
        )
    except ConfigError as e:
        print(f"lightning-lora export: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        message = write_failure(e, "--out")
        if message is None:
            raise
        print(f"lightning-lora export: error: {message}. Nothing was written.", file=sys.stderr)
        return 2
    print(f"LoRA ({args.format} format, {args.dtype}) written to {path}")
    for note in notes:
        print(f"  {note}")
    return 0


class Averaged(NamedTuple):
    """Which weights of a checkpoint to export: the raw LoRA, its EMA (``--ema``), or a post-hoc EMA
    (``--ema-sigma-rel``)."""

    ema: bool = False
    sigma_rel: float | None = None

    @property
    def wanted(self) -> bool:
        return self.ema or self.sigma_rel is not None


def _export(
    source: Path,
    format: str,
    out: Path,
    dtype: torch.dtype,
    overwrite: bool,
    family_name: str | None = None,
    averaged: Averaged = Averaged(),
) -> tuple[Path, list[str]]:
    if out.suffix != ".safetensors":
        raise ConfigError(f"--out {out}: name the file *.safetensors (diffusers and ComfyUI look for that suffix).")
    if out.is_dir():
        raise ConfigError(f"--out {out}: is a folder; give a file name such as {out / 'lora.safetensors'}.")
    if out.exists() and not overwrite:
        raise ConfigError(f"--out {out}: exists. Pass --overwrite to replace it, or choose another --out file.")
    if source.resolve() == out.resolve():
        raise ConfigError(f"--out {out}: is the input file; choose another --out file.")
    if averaged.wanted and source.suffix == ".safetensors":
        flag = "--ema" if averaged.ema else "--ema-sigma-rel"
        raise ConfigError(f"{flag}: {source} is a LoRA file; the EMA of a run is in its checkpoints (.ckpt).")
    family = FAMILIES[family_name]() if family_name else None
    created = [folder for folder in (out.parent, *out.parent.parents) if not folder.exists()]  # deepest first
    info: dict[str, Any] = {}
    try:
        if source.suffix == ".safetensors":
            lora = read_lora_file(source, family)
            path = convert_lora_file(source, out, format=format, family=lora.family, dtype=dtype)
            state, family = lora.state, lora.family
        else:
            state, options, family, info = checkpoint_lora(source, averaged.ema, averaged.sigma_rel)
            path = export_lora(state, out, format=format, lora=options, family=family, info=info, dtype=dtype)  # type: ignore[arg-type]
    except ConfigError:  # names the option and the fix (a format the family lacks, a variant the format cannot hold)
        raise
    except ValueError as e:  # a LoRA this format cannot express, e.g. a layer without a kohya name
        raise ConfigError(f"{source}: {first_line(e)}") from None
    except OSError:  # the file was written atomically, so it is not there; nor are the folders made for it
        for folder in created:
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise
    coverage = file_coverage(state, family, format)
    tools = ", ".join(TOOL_NAMES[t] for t in coverage.loads_in) or f"none of {', '.join(TOOL_NAMES.values())}"
    notes = [f"applies every layer as trained in: {tools}"]
    if info.get("ema"):
        notes.insert(0, f"weights: {info['ema']}")
    notes += [f"note: {line}" for line in coverage.notes(path.name)]
    return path, notes
