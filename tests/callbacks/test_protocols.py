"""The structural types the callbacks and the data module use to read the model hold for the real classes on every
Python the package supports: from Python 3.12, ``isinstance`` against a runtime protocol looks its members up
statically (``inspect.getattr_static``), which does not see a ``torch.nn.Module``'s registered submodules. The GPU
machine (Python 3.12) found ``LoraExport`` refusing a real ``LoraModule`` that CI (Python 3.11) accepted."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from pathlib import Path
from typing import Any

import torch

import lightning_lora
from lightning_lora.callbacks.lora_export import as_lora_model
from lightning_lora.data.datamodule import LatentDataModule
from lightning_lora.module import LoraModule


def _built_module() -> LoraModule:
    """A LoraModule as it is after ``configure_model``: its denoiser a registered submodule."""
    module = LoraModule("a/model")
    module.denoiser = torch.nn.Linear(2, 2)
    return module


def _runtime_protocols() -> list[type]:
    """Every runtime-checkable Protocol defined in the package."""
    found = []
    for info in pkgutil.walk_packages(lightning_lora.__path__, "lightning_lora."):
        if info.name.startswith("lightning_lora.cli") or info.name.endswith("__main__"):
            continue  # the command's modules only route; importing cli.demo would build nothing but costs time
        mod = importlib.import_module(info.name)
        for obj in vars(mod).values():
            if inspect.isclass(obj) and obj.__module__ == mod.__name__ and getattr(obj, "_is_runtime_protocol", False):
                found.append(obj)
    return found


def _static_members_present(obj: Any, protocol: type) -> bool:
    """Python 3.12's rule for ``isinstance(obj, protocol)``, on any Python."""
    members = getattr(protocol, "__protocol_attrs__", None) or {
        name for name in vars(protocol) if not name.startswith("_")
    } | set(getattr(protocol, "__annotations__", {}))
    sentinel = object()
    return all(inspect.getattr_static(obj, name, sentinel) is not sentinel for name in members)


def test_the_export_reads_a_built_lora_module() -> None:
    module = _built_module()
    assert as_lora_model(module) is module
    assert as_lora_model(torch.nn.Linear(2, 2)) is None


def test_every_runtime_protocol_holds_for_the_real_classes_under_static_lookup(photos_dir: Path) -> None:
    real = [_built_module(), LatentDataModule(images=str(photos_dir))]
    protocols = _runtime_protocols()
    assert protocols, "the package defines runtime protocols (the data module's ModelSide at least)"
    for protocol in protocols:
        fits = [obj for obj in real if isinstance(obj, protocol)]
        assert fits, f"{protocol.__qualname__}: neither a LoraModule nor a LatentDataModule satisfies it"
        for obj in fits:
            assert _static_members_present(obj, protocol), (
                f"{protocol.__qualname__}: a {type(obj).__name__} passes isinstance on this Python but not on 3.12+ "
                "(a member only an nn.Module's __getattr__ finds)"
            )
