"""The adapter's one home: its options, the one peft config, which parameters are the adapter's, and its keys.

Variants (``model.lora.variant``), each built by peft from the same options: ``lora`` (``scale * B @ A``, below);
``dora`` (DoRA: the weight split into a magnitude per output channel and a direction, the LoRA update added to the
direction, the magnitude learned too: peft's ``lora_magnitude_vector``); ``lokr`` (LoKr: the update is the Kronecker
product ``w1 ⊗ w2`` of two small matrices, ``w2`` low-rank when large: peft's ``lokr_w1``, ``lokr_w2`` or
``lokr_w2_a/_b``); ``loha`` (LoHa: the Hadamard product of two low-rank updates ``(w1a @ w1b) * (w2a @ w2b)``:
peft's ``hada_w1_a``... ). Which file formats hold which variant is :mod:`lightning_lora.formats`'.

A LoRA adapter adds ``scale * B @ A`` to a frozen linear layer's output (``A``: ``r x in``, ``B``: ``out x r``,
``scale = alpha / r``); a convolution gets ``A`` as an ``r x in x k x k`` convolution and ``B`` as ``out x r x 1 x 1``.
peft builds the adapters (:func:`inject_lora`) from :class:`LoraOptions` through one :func:`peft_config`, so the
training model, the memory planner and the exported file's ``lora_adapter_metadata`` can never disagree on what the
options mean.

Names. peft puts an adapter's tensors in the modules it wraps: the parameter ``lora_A.default.weight`` of the
module ``transformer_blocks.0.attn.to_q`` (``default`` is the adapter's name). Three spellings of the same tensor
meet here:

* the training model's parameter: ``transformer_blocks.0.attn.to_q.lora_A.default.weight``;
* a checkpoint's key: the same under the LightningModule's attribute, ``denoiser.transformer_blocks...``;
* a peft state dict (``get_peft_model_state_dict``, what LoRA files hold): the adapter name removed,
  ``transformer_blocks.0.attn.to_q.lora_A.weight``.

:func:`parse_key` reads all three into an :class:`AdapterKey` (module, tensor, adapter name) and
:func:`is_adapter_param` decides what is the adapter's (and so trainable, saved in checkpoints, exported) by the same
rule: a name component that starts with a peft adapter prefix (``lora_``, ``lokr_``, ``hada_``, ...). Tensors of
variants other than plain LoRA (DoRA's ``lora_magnitude_vector``, LoKr's ``lokr_*``, LoHa's ``hada_*``) are
recognized as the adapter's, and :func:`split_lora_state` refuses them by name instead of dropping them: a file
format that cannot hold a variant must say so.

Targets are a preset of the family (``attention``, ``attention_all``, ``all_linear``...), a regular expression over
module names, or a list of module-name suffixes (``to_q``, ``attn.to_out.0``). :func:`resolve_targets` checks each
against the model: peft would silently ignore a pattern that matches nothing, and the user would train fewer layers
than they think.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, Protocol

import torch
from torch import nn

from lightning_lora.errors import ConfigError

if TYPE_CHECKING:
    from peft import PeftConfig

__all__ = [
    "ADAPTER_PREFIXES",
    "VARIANTS",
    "Variant",
    "AdapterKey",
    "LoraOptions",
    "adapter_disabled",
    "adapter_state",
    "adapters_disabled",
    "inject_lora",
    "is_adapter_param",
    "parse_key",
    "peft_config",
    "resolve_targets",
    "set_lora_input_casts",
    "split_lora_state",
    "trainable_parameters",
]

Variant = Literal["lora", "dora", "lokr", "loha"]
VARIANTS: tuple[str, ...] = ("lora", "dora", "lokr", "loha")
"""The adapter kinds ``model.lora.variant`` builds (:func:`peft_config`)."""

ADAPTER_PREFIXES = ("lora_", "lokr_", "hada_", "oft_", "boft_", "ia3_", "vera_")
"""Prefixes of the tensor names peft's tuners give their adapters (LoRA and DoRA, LoKr, LoHa, OFT, BOFT, IA3,
VeRA)."""

_VARIANTS = {"lora_magnitude_vector": "DoRA", "lokr_": "LoKr", "hada_": "LoHa", "oft_": "OFT", "boft_": "BOFT"}

_KEY = re.compile(
    r"^(?:denoiser\.)?(?P<module>.+?)\.(?P<tensor>(?:" + "|".join(ADAPTER_PREFIXES) + r")[A-Za-z0-9_]*)"
    r"(?:\.(?P<adapter>(?!weight$)[^.]+))?(?:\.weight)?$"
)


class _Presets(Protocol):
    @property
    def lora_presets(self) -> Mapping[str, str]: ...


class TargetPresets(Protocol):
    """What target resolution needs of a model family (:class:`~lightning_lora.families.base.DiffusionFamily`): its
    name and its named target sets (``architecture.lora_presets``). The adapter is a lower layer than the families."""

    @property
    def name(self) -> str: ...

    @property
    def architecture(self) -> _Presets: ...


@dataclass
class LoraOptions:
    """LoRA adapter settings.

    Args:
        rank: the rank r of the update ``B @ A`` (A: r x in, B: out x r).
        alpha: the update is scaled by ``alpha / rank``; null means alpha = rank (scale 1).
        targets: a family preset (``attention``, ``attention_all``, ``all_linear``), a regular expression over module
            names, or a list of module-name suffixes.
        dropout: dropout on the LoRA input during training (``lora`` and ``dora``).
        init: ``gaussian`` (A ~ N(0, 1/r), B = 0, as the diffusers scripts) or ``kaiming`` (peft's default); for
            ``lora`` and ``dora`` (LoKr and LoHa start from a zero update their own way).
        variant: ``lora``; ``dora`` (weight-decomposed LoRA: a learned magnitude per output channel beside the low-rank
            direction; a little slower, often closer to full fine-tuning); ``lokr`` (a Kronecker product of two small
            matrices: far fewer parameters for the same rank); ``loha`` (a Hadamard product of two low-rank updates:
            rank r^2 expressiveness from 2r). All through peft.
    """

    rank: int = 16
    alpha: float | None = None
    targets: str | list[str] = "attention"
    dropout: float = 0.0
    init: Literal["gaussian", "kaiming"] = "gaussian"
    variant: Variant = "lora"

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ConfigError(f"model.lora.rank: {self.rank} must be a positive integer (typical: 4 to 64).")
        if self.alpha is not None and self.alpha <= 0:
            raise ConfigError(f"model.lora.alpha: {self.alpha} must be positive, or null for alpha = rank.")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.lora.dropout: {self.dropout} must be in [0, 1).")
        if self.variant not in VARIANTS:
            raise ConfigError(f"model.lora.variant: {self.variant!r} is not one of {', '.join(VARIANTS)}.")
        if self.dropout and self.variant in ("lokr", "loha"):
            raise ConfigError(
                f"model.lora.dropout: {self.dropout} drops LoRA inputs, which model.lora.variant: {self.variant} does "
                "not have; set model.lora.dropout: 0 (or use variant lora / dora)."
            )

    @property
    def scale_alpha(self) -> float:
        return float(self.alpha if self.alpha is not None else self.rank)

    @classmethod
    def from_saved(cls, saved: Mapping[str, Any] | None, rank: int) -> LoraOptions:
        """The options as a checkpoint's ``hyper_parameters["lora"]`` saved them (``rank`` when it has none)."""
        saved = dict(saved or {})
        return cls(
            rank=int(saved.get("rank") or rank),
            alpha=float(saved["alpha"]) if saved.get("alpha") is not None else None,
            targets=saved.get("targets") or "attention",
            dropout=float(saved.get("dropout") or 0.0),
            init=saved.get("init") or "gaussian",
            variant=saved.get("variant") or "lora",
        )


def peft_config(options: LoraOptions, target_modules: str | list[str]) -> PeftConfig:
    """The one peft config of ``options`` for ``target_modules`` (a regular expression peft full-matches, or a list of
    module-name suffixes): ``LoraConfig`` (``use_dora`` for DoRA), ``LoKrConfig`` or ``LoHaConfig``."""
    from peft import LoHaConfig, LoKrConfig, LoraConfig

    alpha: Any = options.scale_alpha  # peft's annotations say int; it takes a float (it divides by r)
    if options.variant == "lokr":
        return LoKrConfig(r=options.rank, alpha=alpha, target_modules=target_modules, init_weights=True)
    if options.variant == "loha":
        return LoHaConfig(r=options.rank, alpha=alpha, target_modules=target_modules, init_weights=True)
    return LoraConfig(
        r=options.rank,
        lora_alpha=alpha,
        lora_dropout=options.dropout,
        init_lora_weights="gaussian" if options.init == "gaussian" else True,
        target_modules=target_modules,
        use_dora=options.variant == "dora",
    )


def _is_quantized_linear(module: nn.Module) -> bool:
    return type(module).__name__ in ("Linear4bit", "Linear8bitLt", "FP8Linear")


def resolve_targets(targets: str | list[str], family: TargetPresets, model: nn.Module) -> str | list[str]:
    """Turn the user's ``targets`` into a peft ``target_modules`` value, checking that each part matches a layer."""
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear | nn.Conv2d) or _is_quantized_linear(m)]
    presets = family.architecture.lora_presets
    if isinstance(targets, str):
        pattern = presets.get(targets, targets)
        try:
            regex = re.compile(pattern)
        except re.error as e:
            raise ConfigError(
                f"model.lora.targets: {targets!r} is neither a preset ({', '.join(presets)}) nor a valid "
                f"regular expression ({e})."
            ) from e
        if not any(regex.fullmatch(n) for n in names):
            raise ConfigError(
                f"model.lora.targets: {targets!r} matches no linear or convolution layer of the {family.name} "
                f"model. Use a preset ({', '.join(presets)}) or a module-name pattern such as "
                f"{names[len(names) // 2]!r}."
            )
        return pattern
    unmatched = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if unmatched or not targets:
        example = sorted({n.rsplit(".", 1)[-1] for n in names})[:12]
        raise ConfigError(
            f"model.lora.targets: {unmatched or targets} match no linear or convolution layer of the "
            f"{family.name} model. Layer names end in e.g. {example}; or use a preset "
            f"({', '.join(presets)})."
        )
    return list(targets)


def inject_lora(model: nn.Module, family: TargetPresets, options: LoraOptions) -> str | list[str]:
    """Add the adapter to ``model`` (a frozen diffusers model, possibly on the meta device) and return the resolved
    ``target_modules``. Its parameters are created in the layers' dtype; the caller decides their training dtype."""
    target_modules = resolve_targets(options.targets, family, model)
    model.add_adapter(peft_config(options, target_modules))  # type: ignore[operator]
    return target_modules


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[int]:
    """Inside, ``model`` computes the frozen base's own output: every adapter layer runs its base layer alone (peft's
    ``enable_adapters(False)``, what peft's ``disable_adapter()`` context and diffusers' ``disable_adapters()`` do);
    afterwards each is on again and trainable, as before. For forward passes without gradients: DOP's target
    (:class:`~lightning_lora.objectives.Preservation`), a comparison with the base. Yields how many layers it turned
    off (none that were off already)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers: list[Any] = [m for m in model.modules() if isinstance(m, BaseTunerLayer) and not m.disable_adapters]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield len(layers)
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def is_adapter_param(name: str) -> bool:
    """Whether the parameter (or state-dict key) ``name`` belongs to the adapter rather than the frozen base."""
    return any(part.startswith(ADAPTER_PREFIXES) for part in name.split("."))


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters that train: the adapter's (the base is frozen)."""
    return [p for p in model.parameters() if p.requires_grad]


class AdapterKey(NamedTuple):
    """An adapter tensor's name, read by :func:`parse_key`: the wrapped ``module``, the ``tensor``'s name in it
    (``lora_A``, ``lora_B``, ``lora_magnitude_vector``, ``lokr_w1``...) and the ``adapter`` name (None in a peft
    state dict)."""

    module: str
    tensor: str
    adapter: str | None

    @property
    def variant(self) -> str:
        """``LoRA`` for ``lora_A`` / ``lora_B``, else the variant the tensor belongs to (``DoRA``, ``LoKr``...)."""
        if self.tensor in ("lora_A", "lora_B"):
            return "LoRA"
        return next((v for prefix, v in _VARIANTS.items() if self.tensor.startswith(prefix)), self.tensor)

    def peft(self) -> str:
        """The key in a peft state dict (``<module>.lora_A.weight``)."""
        weight = ".weight" if self.tensor in ("lora_A", "lora_B") else ""
        return f"{self.module}.{self.tensor}{weight}"


def parse_key(key: str) -> AdapterKey | None:
    """Read a parameter name, checkpoint key or peft state-dict key of an adapter tensor (see the module docstring);
    None for a key that is not the adapter's."""
    match = _KEY.match(key)
    if match is None:
        return None
    return AdapterKey(match["module"], match["tensor"], match["adapter"])


def adapter_state(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter tensors of a model state dict or checkpoint ``state_dict``, in peft state-dict keys."""
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        parsed = parse_key(key)
        if parsed is not None:
            out[parsed.peft()] = tensor
    return out


def split_lora_state(state: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{module: (lora_A [r, in], lora_B [out, r])}`` from a peft state dict (``<module>.lora_A.weight`` keys).

    A convolution's LoRA is 4-D (``lora_A [r, in, k, k]``, ``lora_B [out, r, 1, 1]``). Raises ``ValueError`` for keys
    that are not plain LoRA weights (a variant's tensors, LoRA biases, adapter names), naming the variant, and for
    modules that lack one of the two matrices or whose shapes do not chain.
    """
    found: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        parsed = parse_key(key)
        if parsed is None or parsed.adapter is not None or parsed.peft() != key:
            raise ValueError(
                f"{key!r} is not a plain LoRA weight (<module>.lora_A.weight / <module>.lora_B.weight); LoRA biases "
                "and adapter names in keys cannot be exported."
            )
        if parsed.variant != "LoRA":
            raise ValueError(f"{key!r} is a {parsed.variant} tensor; this file format holds plain LoRA only.")
        found.setdefault(parsed.module, {})[parsed.tensor[-1]] = tensor
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, parts in found.items():
        if set(parts) != {"A", "B"}:
            raise ValueError(f"{module}: has lora_{''.join(parts)} but not both lora_A and lora_B")
        a, b = parts["A"], parts["B"]
        chained = a.ndim == b.ndim and a.shape[0] == b.shape[1] and (a.ndim == 2 or b.shape[2:] == (1, 1))
        if a.ndim not in (2, 4) or not chained:
            raise ValueError(f"{module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not form B @ A")
        pairs[module] = (a, b)
    return pairs


def set_lora_input_casts(denoiser: nn.Module, enabled: bool) -> int:
    """Whether the LoRA layers cast their input to the adapter's float32; off only where every forward runs under
    autocast.

    peft casts each LoRA layer's input to the adapter's float32 (``cast_input_dtype_enabled``), and autocast casts
    it straight back to bf16 for the matmul: two copies of the activation per layer in the forward and two in the
    backward, the same values (~2,800 of a FLUX step's ~9,800 kernels). Without autocast the cast is needed (a bf16
    input would meet float32 adapter weights), so :class:`~lightning_lora.module.LoraModule` turns it off under a
    mixed-precision plugin and on under any other, each time it is fitted. Returns how many layers were set.
    """
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers: list[Any] = [m for m in denoiser.modules() if isinstance(m, BaseTunerLayer)]
    for layer in layers:
        layer.cast_input_dtype_enabled = enabled
    return len(layers)


@contextmanager
def adapter_disabled(model: nn.Module) -> Iterator[None]:
    """Inside the block ``model`` runs as its frozen base: every peft layer's adapter off (peft's
    ``enable_adapters(False)``, what ``disable_adapter()`` does for a ``PeftModel``), the LoRA's values untouched. peft
    clears the adapter's ``requires_grad`` when it turns it off and sets it on the active adapter when it turns it on
    again: each parameter's flag is put back as it was, so a frozen adapter tensor stays frozen."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers: list[Any] = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    flags = [(p, p.requires_grad) for layer in layers for name, p in layer.named_parameters() if is_adapter_param(name)]
    disabled = [layer for layer in layers if not layer.disable_adapters]
    for layer in disabled:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in disabled:
            layer.enable_adapters(True)
        for p, flag in flags:
            p.requires_grad_(flag)
