"""Helpers shared by the tests (the fixtures are in conftest.py)."""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_lora.assembly import build_lora_model
from lightning_lora.families.base import DiffusionFamily, ModelSource
from lightning_lora.lora import LoraOptions
from lightning_lora.recipe import ModelRecipe


def build_model(
    family: DiffusionFamily, source: ModelSource, lora: LoraOptions, device: Any = None, **options: Any
) -> nn.Module:
    """The trainable model of a :class:`ModelRecipe` with these options, as ``LoraModule`` builds it."""
    return build_lora_model(ModelRecipe(family, source, lora, **options), device)
