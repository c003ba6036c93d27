"""The linear layers a quantized base format replaces."""

from __future__ import annotations

import re

from torch import nn

__all__ = ["linear_layers"]


def linear_layers(model: nn.Module, skip: list[str]) -> list[tuple[nn.Module, str, str, nn.Linear]]:
    """``(parent, child name, full name, layer)`` for every plain ``nn.Linear`` not matched by ``skip`` (regular
    expressions of module names)."""
    patterns = [re.compile(p) for p in skip]
    found = []
    for parent_name, parent in model.named_modules():
        for name, child in parent.named_children():
            full = f"{parent_name}.{name}" if parent_name else name
            if type(child) is nn.Linear and not any(p.fullmatch(full) or p.search(full) for p in patterns):
                found.append((parent, name, full, child))
    return found
