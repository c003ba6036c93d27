"""One adapted layer of a LoRA file, whatever its variant: which tensors it holds, and the algebra the formats share.

The variants and their tensors
------------------------------
peft names an adapter's tensors after the variant that built it (see :mod:`lightning_lora.lora`); LyCORIS, ComfyUI and
kohya's sd-scripts use the *same* tensor names for LoKr and LoHa, and their own for LoRA and DoRA. Per adapted layer
``W [out, in]`` (a convolution: ``[out, in, k, k]``, flattened to ``[out, in*k*k]`` where a product needs 2-D)::

    LoRA   lora_A [r, in], lora_B [out, r]            delta = s * B @ A
    DoRA   + lora_magnitude_vector m [out]             W' = m / ||W + s B A||_row * (W + s B A)   (peft: rows)
    LoKr   lokr_w1 [a, c] (or lokr_w1_a @ lokr_w1_b)   delta = s * kron(w1, w2)   reshaped to W's shape
           lokr_w2 [b, d] (or lokr_w2_a @ lokr_w2_b,   (out = a*b, in = c*d; a convolution's w2 carries the kernel)
           with lokr_t2 for a Tucker convolution)
    LoHa   hada_w1_a [out, r], hada_w1_b [r, in*k*k],  delta = s * (w1_a @ w1_b) * (w2_a @ w2_b)   (element-wise)
           hada_w2_a, hada_w2_b (hada_t1/t2: Tucker)

``s`` is ``alpha / r`` in peft, for every variant (LoKr too, even when neither factor is low-rank).

The rank a loader divides alpha by
----------------------------------
A file with ``.alpha`` tensors makes the loader compute ``alpha / rank`` itself, with the rank read from a tensor's
shape: ``lora_down.shape[0]`` (LoRA, DoRA; ComfyUI ``weight_adapter/lora.py``, sd-scripts
``create_network_from_weights``), ``hada_w1_b.shape[0]`` (LoHa; ComfyUI ``weight_adapter/loha.py``), and for LoKr
``lokr_w2_b.shape[0]`` or ``lokr_w1_b.shape[0]`` -- but *no scale at all* when neither factor is low-rank (ComfyUI
``weight_adapter/lokr.py`` ``calculate_weight``: ``alpha = 1.0`` unless ``dim`` was read; LyCORIS
``modules/lokr.py``: "use scale = 1" when both factors are full). :func:`alpha_rank` answers that rank (None for the
full/full LoKr, whose scale must be folded into ``lokr_w1`` instead).

This module is pure tensor code (torch only).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_lora.lora import parse_key

__all__ = [
    "VARIANT_TENSORS",
    "Adapter",
    "adapters_from_peft",
    "alpha_rank",
    "common_rank",
    "peft_state",
    "variants_of",
]

VARIANT_TENSORS: dict[str, frozenset[str]] = {
    "LoRA": frozenset({"lora_A", "lora_B"}),
    "DoRA": frozenset({"lora_A", "lora_B", "lora_magnitude_vector"}),
    "LoKr": frozenset({"lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "lokr_t2"}),
    "LoHa": frozenset({"hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "hada_t1", "hada_t2"}),
}
"""Variant -> the peft tensor names an adapter of that variant may hold."""

_WEIGHT_SUFFIX = ("lora_A", "lora_B")  # the only peft tensors stored as ``<name>.weight``


@dataclass(frozen=True)
class Adapter:
    """One adapted layer: its ``variant`` (``LoRA``, ``DoRA``, ``LoKr``, ``LoHa``) and ``tensors`` under peft's tensor
    names (``lora_A``, ``lora_magnitude_vector``, ``lokr_w1``, ``hada_w1_a``...)."""

    variant: str
    tensors: dict[str, Tensor]

    def __getitem__(self, name: str) -> Tensor:
        return self.tensors[name]

    def get(self, name: str) -> Tensor | None:
        return self.tensors.get(name)

    @property
    def out_features(self) -> int:
        """Rows of the adapted weight (its output channels)."""
        if self.variant in ("LoRA", "DoRA"):
            return int(self["lora_B"].shape[0])
        if self.variant == "LoHa":
            a = self["hada_w1_a"]
            return int(a.shape[1] if "hada_t1" in self.tensors else a.shape[0])
        w1, w2 = self._lokr_factor(1), self._lokr_factor(2)
        return w1[0] * w2[0]

    def _lokr_factor(self, i: int) -> tuple[int, int]:
        """``(rows, columns)`` of LoKr's factor ``w<i>`` (columns of a convolution's w2 exclude the kernel)."""
        full = self.get(f"lokr_w{i}")
        if full is not None:
            return int(full.shape[0]), int(full.shape[1])
        a, b = self[f"lokr_w{i}_a"], self[f"lokr_w{i}_b"]
        if i == 2 and "lokr_t2" in self.tensors:
            return int(a.shape[1]), int(b.shape[1])
        return int(a.shape[0]), int(b.shape[1])

    @property
    def in_features(self) -> int:
        """Columns of the adapted (linear) weight: its input width."""
        if self.variant in ("LoRA", "DoRA"):
            return int(self["lora_A"].shape[1])
        if self.variant == "LoHa":
            return int(self["hada_w1_b"].shape[1])
        return self._lokr_factor(1)[1] * self._lokr_factor(2)[1]

    @property
    def rank(self) -> int | None:
        """The rank ``r`` peft built the adapter with, where the tensors show it (None: a LoKr without low-rank
        factor)."""
        if self.variant in ("LoRA", "DoRA"):
            return int(self["lora_A"].shape[0])
        if self.variant == "LoHa":
            return int(self["hada_w1_b"].shape[0])
        return alpha_rank(self)


def alpha_rank(adapter: Adapter) -> int | None:
    """The rank ComfyUI and LyCORIS divide a file's ``.alpha`` by for this adapter (see the module docstring); None
    for a LoKr with two full factors (the loaders apply no scale)."""
    if adapter.variant in ("LoRA", "DoRA", "LoHa"):
        return adapter.rank
    for name in ("lokr_w2_b", "lokr_w1_b"):  # ComfyUI reads w1_b first, then lets w2_b override: same r in peft
        tensor = adapter.get(name)
        if tensor is not None:
            return int(tensor.shape[0])
    return None


def adapters_from_peft(state: Mapping[str, Tensor]) -> dict[str, Adapter]:
    """``{module: Adapter}`` from a peft state dict (``<module>.lora_A.weight``, ``<module>.lora_magnitude_vector``,
    ``<module>.lokr_w1``, ``<module>.hada_w1_a``...: no prefix, no adapter name), in the state's module order.

    Raises ``ValueError`` naming the key or module for a key that is not an adapter tensor of a known variant (LoRA
    biases, adapter names, OFT...), a module mixing variants, missing tensors, or shapes that do not chain.
    """
    found: dict[str, dict[str, Tensor]] = {}
    for key, tensor in state.items():
        parsed = parse_key(key)
        if parsed is None or parsed.adapter is not None or parsed.peft() != key:
            raise ValueError(
                f"{key!r} is not an adapter tensor of a peft state dict (<module>.lora_A.weight, "
                "<module>.lora_magnitude_vector, <module>.lokr_w1, <module>.hada_w1_a...); LoRA biases and adapter "
                "names in keys cannot be exported."
            )
        if not any(parsed.tensor in names for names in VARIANT_TENSORS.values()):
            raise ValueError(f"{key!r} is a {parsed.variant} tensor; lightning-lora writes LoRA, DoRA, LoKr and LoHa.")
        found.setdefault(parsed.module, {})[parsed.tensor] = tensor
    return {module: _adapter(module, tensors) for module, tensors in found.items()}


def _adapter(module: str, tensors: dict[str, Tensor]) -> Adapter:
    names = set(tensors)
    variant = next((v for v in ("LoRA", "DoRA", "LoKr", "LoHa") if names <= VARIANT_TENSORS[v]), None)
    if variant is None:
        raise ValueError(f"{module}: mixes the tensors of several adapter variants ({', '.join(sorted(names))})")
    if variant in ("LoRA", "DoRA"):
        variant = "DoRA" if "lora_magnitude_vector" in names else "LoRA"
        if not {"lora_A", "lora_B"} <= names:
            raise ValueError(f"{module}: has {', '.join(sorted(names))} but not both lora_A and lora_B")
        a, b = tensors["lora_A"], tensors["lora_B"]
        chained = a.ndim == b.ndim and a.shape[0] == b.shape[1] and (a.ndim == 2 or b.shape[2:] == (1, 1))
        if a.ndim not in (2, 4) or not chained:
            raise ValueError(f"{module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not form B @ A")
        m = tensors.get("lora_magnitude_vector")
        if m is not None and m.numel() != b.shape[0]:
            raise ValueError(f"{module}: lora_magnitude_vector has {m.numel()} values for {b.shape[0]} output rows")
    elif variant == "LoHa":
        missing = {"hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b"} - names
        if missing or (("hada_t1" in names) != ("hada_t2" in names)):
            raise ValueError(f"{module}: a LoHa adapter without {', '.join(sorted(missing) or ['hada_t1/hada_t2'])}")
    else:
        for i in (1, 2):
            if f"lokr_w{i}" not in names and not {f"lokr_w{i}_a", f"lokr_w{i}_b"} <= names:
                raise ValueError(f"{module}: a LoKr adapter without lokr_w{i} (or lokr_w{i}_a and lokr_w{i}_b)")
    return Adapter(variant, dict(tensors))


def peft_state(adapters: Mapping[str, Adapter]) -> dict[str, Tensor]:
    """The peft state dict of ``adapters`` (the inverse of :func:`adapters_from_peft`)."""
    out: dict[str, Tensor] = {}
    for module, adapter in adapters.items():
        for name, tensor in adapter.tensors.items():
            out[f"{module}.{name}.weight" if name in _WEIGHT_SUFFIX else f"{module}.{name}"] = tensor
    return out


def variants_of(state: Mapping[str, Tensor]) -> set[str]:
    """The variants of the adapter tensors in a peft state dict or checkpoint (``LoRA``, ``DoRA``...), read from
    the tensor names alone (no validation)."""
    found: dict[str, set[str]] = {}
    for key in state:
        parsed = parse_key(key)
        if parsed is not None:
            found.setdefault(parsed.module, set()).add(parsed.variant)
    return {("DoRA" if "DoRA" in kinds else next(iter(kinds))) for kinds in found.values()}


def common_rank(adapters: Mapping[str, Adapter]) -> int:
    """The most common rank of ``adapters`` (1 when none shows one)."""
    ranks = Counter(a.rank for a in adapters.values() if a.rank is not None)
    return ranks.most_common(1)[0][0] if ranks else 1


def cast(tensor: Tensor, dtype: torch.dtype | None) -> Tensor:
    """``tensor`` in ``dtype`` (as it is when None)."""
    return tensor if dtype is None else tensor.to(dtype)
