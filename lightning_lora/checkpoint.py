"""Checkpoints that cannot be corrupted, and a resume that picks a valid one and refuses an incompatible one.

Writing (:class:`AtomicCheckpointIO`, a Lightning ``CheckpointIO`` plugin): the checkpoint is serialized in memory,
written to a temporary file in the same folder, fsynced, renamed over the target, and the folder is fsynced. A kill
or a full disk during the write leaves the previous file intact. Lightning's own writer uses an fsspec transaction
without fsync, so after a power loss the renamed file can still be empty.

Reading: always ``torch.load(weights_only=True)``: a checkpoint is data, never code.

Resuming (:func:`resolve_resume`): ``--ckpt_path last`` means the newest *valid* checkpoint of the run folder.
``last.ckpt`` is tried first; if it is truncated or unreadable, the newest readable ``step*.ckpt`` is used with a
warning; if none is readable, a clear error. A run folder without checkpoints starts fresh, and says so.
:func:`check_compatible` compares the checkpoint's saved options with the current ones: a different LoRA rank, alpha,
targets, family or base model would train a different adapter, so it stops with the option's name; anything else
(steps, learning rate, logging, samples) may change between runs.
"""

from __future__ import annotations

import io
import logging
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_lora.errors import ConfigError
from lightning_lora.io import atomic_write_bytes

__all__ = ["AtomicCheckpointIO", "check_compatible", "load_checkpoint", "resolve_resume"]

log = logging.getLogger(__name__)

# Options that define what the LoRA tensors mean: changing any of them makes a checkpoint unusable.
INCOMPATIBLE = {
    "model.lora.rank": ("lora", "rank"),
    "model.lora.alpha": ("lora", "alpha"),
    "model.lora.targets": ("lora", "targets"),
    "model.family": ("family", "class_path"),
    "model.pretrained": ("pretrained",),
    "model.denoiser_file": ("denoiser_file",),
}


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Load a checkpoint safely (``weights_only=True``) on the CPU."""
    return torch.load(path, map_location="cpu", weights_only=True)


def _readable(path: Path) -> dict[str, Any] | None:
    try:
        ckpt = load_checkpoint(path)
    except Exception as e:  # noqa: BLE001 - any failure to read means "not valid"; the reason is logged
        log.debug("checkpoint %s unreadable: %s", path, e)
        return None
    if not isinstance(ckpt, dict) or not {"state_dict", "loops", "optimizer_states"} <= ckpt.keys():
        return None
    return ckpt


class AtomicCheckpointIO(TorchCheckpointIO):
    """Write checkpoints atomically and durably; read them with ``weights_only=True``."""

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        atomic_write_bytes(path, buffer.getvalue())

    @override
    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        return torch.load(path, map_location=map_location or "cpu", weights_only=True)


def resolve_resume(checkpoint_dir: str | Path) -> tuple[Path | None, dict[str, Any] | None]:
    """The newest valid checkpoint in ``checkpoint_dir`` (``last.ckpt`` first) and its contents, or ``(None, None)``."""
    folder = Path(checkpoint_dir)
    last = folder / "last.ckpt"
    candidates = sorted(folder.glob("*.ckpt"), key=lambda p: p.stat().st_mtime, reverse=True) if folder.is_dir() else []
    if not candidates:
        rank_zero_info(f"--ckpt_path last: no checkpoint in {folder}; starting a new run.")
        return None, None
    if last in candidates:
        candidates.remove(last)
        candidates.insert(0, last)
    rejected: list[Path] = []
    for path in candidates:
        ckpt = _readable(path)
        if ckpt is not None:
            if rejected:
                rank_zero_warn(
                    f"--ckpt_path last: {', '.join(p.name for p in rejected)} in {folder} is truncated or corrupt; "
                    f"resuming from {path.name} (step {ckpt.get('global_step')}) instead."
                )
            return path, ckpt
        rejected.append(path)
    raise ConfigError(
        f"--ckpt_path last: none of the checkpoints in {folder} can be read ({', '.join(p.name for p in rejected)}). "
        "Start a new run in another run folder (trainer.default_root_dir), or pass a valid file to --ckpt_path."
    )


def _lookup(hparams: dict[str, Any], keys: tuple[str, ...]) -> Any:
    value: Any = hparams
    for key in keys:
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return value


def check_compatible(saved: dict[str, Any], current: dict[str, Any], path: str | Path) -> None:
    """Raise :class:`ConfigError` if an option that defines the LoRA differs between a checkpoint and this run."""
    diffs = []
    for option, keys in INCOMPATIBLE.items():
        old, new = _lookup(saved, keys), _lookup(current, keys)
        if option == "model.lora.alpha":  # null means alpha = rank
            old = old if old is not None else _lookup(saved, ("lora", "rank"))
            new = new if new is not None else _lookup(current, ("lora", "rank"))
            old, new = (float(old) if old is not None else None), (float(new) if new is not None else None)
        if option == "model.denoiser_file":  # the same file in another folder is the same model
            old, new = (Path(old).name if old else old), (Path(new).name if new else new)
        if old != new:
            diffs.append(f"{option} was {old!r}, now {new!r}")
    if diffs:
        raise ConfigError(
            f"--ckpt_path: {path} was trained with other settings: {'; '.join(diffs)}. Resume with the run's own "
            "settings (its config.yaml), or start a new run in another folder (trainer.default_root_dir)."
        )
