"""``lightning-lora export``: write the LoRA of a training checkpoint as a file other tools load.

::

    lightning-lora export runs/lora/checkpoints/last.ckpt --format kohya --out my_lora_comfy.safetensors
    lightning-lora export runs/lora/checkpoints/step000500.ckpt --format diffusers --out lora.safetensors --dtype bf16

``diffusers`` files load with ``pipe.load_lora_weights(file)``; ``kohya`` files (BFL module names, fused q/k/v) load
in ComfyUI, Forge and kohya's sd-scripts, and in diffusers too. Only the checkpoint's LoRA tensors are read (with
``weights_only=True``); the base model is not loaded. The output is written atomically and an existing file is never
replaced without ``--overwrite``. Problems the user can fix print one line naming the file and the fix, exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from lightning_lora.errors import ConfigError, first_line
from lightning_lora.export import FORMATS, checkpoint_lora, export_lora

__all__ = ["main", "build_parser"]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # as lightning_lora.module.DTYPES


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-lora export",
        description="Write the LoRA of a lightning-lora checkpoint as a diffusers or kohya/ComfyUI safetensors file.",
    )
    parser.add_argument("checkpoint", type=Path, help="a .ckpt written by `lightning-lora fit` (e.g. .../last.ckpt)")
    parser.add_argument(
        "--format",
        choices=FORMATS,
        required=True,
        help="diffusers: peft keys, for pipe.load_lora_weights; kohya: BFL keys, for ComfyUI/Forge/sd-scripts",
    )
    parser.add_argument("--out", type=Path, required=True, help="the .safetensors file to write")
    parser.add_argument("--dtype", choices=list(_DTYPES), default="fp32", help="tensor dtype in the file")
    parser.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    return parser


def main(argv: list[str]) -> int:
    """Run ``lightning-lora export`` with ``argv`` (the arguments after ``export``); return the exit status."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # argparse printed usage (status 2) or --help (status 0)
        return int(e.code or 0)
    try:
        path = _export(args.checkpoint, args.format, args.out, _DTYPES[args.dtype], args.overwrite)
    except ConfigError as e:
        print(f"lightning-lora export: error: {e}", file=sys.stderr)
        return 2
    print(f"LoRA ({args.format} format, {args.dtype}) written to {path}")
    return 0


def _export(checkpoint: Path, format: str, out: Path, dtype: torch.dtype, overwrite: bool) -> Path:
    if out.suffix != ".safetensors":
        raise ConfigError(f"--out {out}: name the file *.safetensors (diffusers and ComfyUI look for that suffix).")
    if out.is_dir():
        raise ConfigError(f"--out {out}: is a folder; give a file name such as {out / 'lora.safetensors'}.")
    if out.exists() and not overwrite:
        raise ConfigError(f"--out {out}: exists. Pass --overwrite to replace it, or choose another --out file.")
    state, lora, family, info = checkpoint_lora(checkpoint)
    try:
        return export_lora(state, out, format=format, lora=lora, family=family, info=info, dtype=dtype)  # type: ignore[arg-type]
    except ConfigError:  # names the option and the fix (a format the family lacks, a variant the format cannot hold)
        raise
    except ValueError as e:  # a LoRA this format cannot express, e.g. a layer without a kohya name
        raise ConfigError(f"{checkpoint}: {first_line(e)}") from None
