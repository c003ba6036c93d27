"""Tiny trainable models and their inputs, for any family.

A fresh LoRA is a no-op (``lora_B`` starts at zero, and ``lora_A`` then gets no gradient): a test that compares outputs
or gradients gives ``lora_B`` random values first (:func:`nonzero_lora_b`). :func:`random_inputs` fills the family's
own :meth:`~lightning_lora.families.base.DiffusionFamily.example_inputs` (what the memory planner runs), so a new
family gets inputs without a test knowing its signature.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_lora.families.base import DiffusionFamily, ModelSource
from lightning_lora.lora import LoraOptions
from lightning_lora.model.assembly import build_lora_model
from lightning_lora.model.recipe import ModelRecipe
from lightning_lora.precision import BF16, FP8, NF4, BasePrecision, FP8Compute, dtype_name

RANK, ALPHA = 4, 8.0
"""The LoRA of :func:`lora_model`: alpha / rank = 2, so a scale that is dropped or applied twice shows."""


PLUGINS: dict[str, type[BasePrecision]] = {"none": BF16, "fp8": FP8, "fp8_compute": FP8Compute, "nf4": NF4}
"""The precision plugins by the short names tests are parametrized with."""


def precision_for(mode: str, dtype: torch.dtype = torch.bfloat16, **options: Any) -> BasePrecision:
    """The precision plugin ``mode`` names (:data:`PLUGINS`) with base dtype ``dtype``."""
    return PLUGINS[mode](dtype=dtype_name(dtype), **options)


def build_model(
    family: DiffusionFamily, source: ModelSource, lora: LoraOptions, device: Any = None, **options: Any
) -> nn.Module:
    """The trainable model of a :class:`ModelRecipe` with these options, as ``LoraModule`` builds it (the base in
    ``source.dtype`` unless ``precision`` says otherwise)."""
    options.setdefault("precision", BF16(dtype=dtype_name(source.dtype)))
    return build_lora_model(ModelRecipe(family, source, lora, **options), device)


def nonzero_lora_b(model: nn.Module, seed: int = 0, scale: float = 0.2) -> nn.Module:
    """Give every ``lora_B`` weight ``scale * N(0, 1)`` values (drawn in parameter order from ``seed``); return
    ``model``."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(scale * torch.randn(p.shape, generator=generator))
    return model


def lora_model(
    family: DiffusionFamily,
    model_dir: Path,
    targets: str | list[str] = "attention",
    seed: int = 0,
    *,
    rank: int = RANK,
    alpha: float | None = ALPHA,
    scale: float = 0.2,
    dtype: torch.dtype = torch.float32,
    train: bool = False,
    **options: Any,
) -> nn.Module:
    """The tiny model of ``family`` in ``model_dir`` with a LoRA whose B matrices are random (:func:`nonzero_lora_b`),
    in ``eval()`` mode unless ``train``. ``options`` are :class:`ModelRecipe` options (``offload_blocks=3``...).

    The global RNG is seeded with ``seed`` first (peft draws ``lora_A`` from it): the same arguments give the same
    model, so two builds that differ in one option can be compared.
    """
    torch.manual_seed(seed)
    model = build_model(
        family,
        ModelSource(str(model_dir), dtype=dtype),
        LoraOptions(rank=rank, alpha=alpha, targets=targets),
        **options,
    )
    return nonzero_lora_b(model, seed, scale).train(train)


def build_tiny(
    folder: Path,
    offload: int,
    checkpointing: bool = False,
    every: int = 1,
    family: DiffusionFamily | None = None,
    offload_activations: bool = False,
) -> nn.Module:
    """The model of the offloading and checkpointing tests: rank 2 (alpha = rank), non-zero ``lora_B``, in
    ``train()`` mode, with ``offload`` blocks offloaded and checkpointing every ``every`` blocks (FLUX by default)."""
    from lightning_lora.families.flux import Flux

    return lora_model(
        family or Flux(),
        folder,
        rank=2,
        alpha=None,
        scale=0.1,
        train=True,
        gradient_checkpointing=checkpointing,
        checkpoint_every=every,
        offload_blocks=offload,
        offload_activations=offload_activations,
    )


def random_inputs(
    family: DiffusionFamily,
    model: nn.Module,
    batch: int = 1,
    *,
    seed: int = 0,
    size: tuple[int, int] | None = None,
    text_len: int = 8,
    dtype: torch.dtype = torch.float32,
) -> dict[str, Any]:
    """Keyword arguments of one forward pass of ``model`` (the family's denoiser) with random values.

    The family's :meth:`~lightning_lora.families.base.DiffusionFamily.example_inputs` gives the names and shapes;
    floating-point tensors get ``N(0, 1)`` values, integer tensors (the UNets' discrete timesteps) values in
    ``[0, 1000)``, drawn from ``seed``. ``size`` is the image size in pixels (default: about 32 x 48, rounded up to
    the family's ``latent_divisor``). The call returns ``(prediction,)`` (``return_dict=False``).
    """
    d = family.architecture.latent_divisor
    height, width = size or (math.ceil(32 / d) * d, math.ceil(48 / d) * d)
    inputs = family.example_inputs(model, batch, height, width, text_len, device="cpu", dtype=dtype)
    generator = torch.Generator().manual_seed(seed)

    def fill(value: Any) -> Any:  # example_inputs are torch.empty / zeros: give them values
        if isinstance(value, dict):
            return {k: fill(v) for k, v in value.items()}
        if torch.is_tensor(value) and value.is_floating_point():
            return torch.randn(value.shape, generator=generator).to(value.dtype)
        if torch.is_tensor(value):
            return torch.randint(0, 1000, value.shape, generator=generator).to(value.dtype)
        return value

    return fill(inputs)


def on_device(value: Any, device: str | torch.device) -> Any:
    """``value`` (:func:`random_inputs`' keyword arguments: tensors, nested dicts, anything else) with every tensor
    moved to ``device``."""
    if isinstance(value, dict):
        return {k: on_device(v, device) for k, v in value.items()}
    return value.to(device) if torch.is_tensor(value) else value


def two_step_grads(model: nn.Module, family: DiffusionFamily | None = None) -> list[dict[str, torch.Tensor]]:
    """The gradients of two backward passes of ``model`` (FLUX by default) on :func:`random_inputs` of seeds 1 and 3
    (loss: the mean square of the prediction), one dict ``{name: grad}`` of the trainable parameters per step."""
    from lightning_lora.families.flux import Flux

    grads = []
    for seed in (1, 3):
        model.zero_grad()
        model(**random_inputs(family or Flux(), model, seed=seed))[0].square().mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})  # type: ignore[union-attr]
    return grads


@torch.no_grad()
def denoiser_output(denoiser: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
    """The prediction of ``denoiser`` for :func:`random_inputs` (no gradient); one tensor also for a denoiser that
    returns a list of per-sample predictions (Z-Image)."""
    prediction = denoiser(**inputs)[0]
    return torch.stack(prediction) if isinstance(prediction, list) else prediction


def lora_layers(model: nn.Module) -> set[str]:
    """Names of the modules that carry a LoRA adapter."""
    return {n for n, m in model.named_modules() if hasattr(m, "lora_A") and len(getattr(m, "lora_A", {})) > 0}


def other_weights(model_dir: Path, component: str = "transformer") -> None:
    """Every weight of ``component`` in the saved pipeline ``model_dir`` changed, the shapes kept: another model (a
    fine-tune) that the same config loads."""
    from safetensors.torch import load_file, save_file

    for file in (model_dir / component).glob("*.safetensors"):
        save_file({k: v + 0.01 for k, v in load_file(file).items()}, file)
