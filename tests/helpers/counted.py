"""Classes a config can name (``helpers.counted.CountedAdamW``) that count how often they are built, to show what a
command instantiates: ``plan`` and ``cache`` build no optimizer and none of the config's callbacks."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import Callback

BUILT: dict[str, int] = {}
"""Class name -> how many instances were built in this process."""


class CountedAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` that counts its instances in :data:`BUILT`."""

    def __init__(self, params: Any, lr: float = 1e-3) -> None:
        BUILT["CountedAdamW"] = BUILT.get("CountedAdamW", 0) + 1
        super().__init__(params, lr=lr)


class CountedCallback(Callback):
    """A callback that does nothing but count its instances in :data:`BUILT`."""

    def __init__(self) -> None:
        BUILT["CountedCallback"] = BUILT.get("CountedCallback", 0) + 1
