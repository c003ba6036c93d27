"""A training adapter: a LoRA merged into the frozen base for training only, for step-distilled bases.

Why
---
A step-distilled model (Z-Image-Turbo, FLUX.1-schnell: a few steps, no guidance) is a teacher's sampler squeezed into
the weights. A LoRA trained on it directly learns the subject *and* undoes part of that squeeze: the model drifts off
its distillation, and its few-step samples break (the reports issue 51 gathers). ai-toolkit's answer, which
lightning-lora takes: a *training adapter*, a LoRA made by training the distilled model back towards ordinary
flow-matching (a de-distillation), merged into the frozen base while the user's LoRA trains, and left out afterwards.
The user's LoRA then learns only the subject on top of a model that behaves like an undistilled one, and applied to the
distilled model without the adapter it keeps the distillation. Where an undistilled base exists (Tongyi-MAI/Z-Image
for Z-Image-Turbo), training on it is the other answer.

What it is here
---------------
``model.training_adapter``: a LoRA file of the family (any layout ``lightning-lora export`` reads: diffusers, kohya,
ComfyUI's ``diffusion_model.`` keys, as ostris' adapters are) of plain LoRA layers. When the model is built
(:func:`lightning_lora.model.assembly.build_lora_model`) each of its layers is merged into the base weight, ``W + B A``
in float32, *before* the base is quantized: the quantized base is that of the merged model. It is never exported
(the exported LoRA is the trained peft adapter alone), and it is part of what the model is: the run's checkpoints record
its file's digest (:meth:`~lightning_lora.families.base.ModelSource.model_identity`), so a resume with another adapter
is refused. The latent and text caches do not depend on it (the VAE and the text encoders are not adapted), so their
keys do not change. The start summary names it.

Sampling without it
-------------------
The samples drawn during training are what users will run: the distilled model with the trained LoRA, no adapter.
Merged before quantization, the adapter cannot be un-merged cheaply: the stored weight is ``Q(W + B A)``; getting ``W``
back needs a bf16 copy of every adapted layer (most of the base) or dequantizing, subtracting and quantizing again (a
second rounding, a pass over every adapted layer at every sample). Instead the adapter's factors stay beside the model
(:class:`TrainingAdapter`, a few MB: not parameters, not in checkpoints) and, while the samples are drawn
(:func:`adapter_removed`), a forward hook on each adapted layer subtracts ``B (A x)`` from its output. With a bf16 base
that is exactly ``W x``; with a quantized one ``Q(W + B A) x - B A x``, off ``W x`` by the quantization's own error of
the merged weight (the same size as the base's). It costs two thin matmuls per adapted layer while sampling, nothing
while training.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from lightning_lora.errors import ConfigError, first_line

if TYPE_CHECKING:
    from lightning_lora.families.base import DiffusionFamily, ModelSource

__all__ = [
    "TrainingAdapter",
    "adapter_removed",
    "distillation_note",
    "merge_training_adapter",
    "read_training_adapter",
    "summary_line",
]

OPTION = "model.training_adapter"


@dataclass
class TrainingAdapter:
    """A merged training adapter: its file and each adapted layer's factors ``(A [r, in], B [out, r])`` (float32, the
    scale folded into ``B``), kept to take it out of the samples (:func:`adapter_removed`)."""

    path: str
    factors: dict[str, tuple[Tensor, Tensor]]
    _placed: dict[tuple[str, torch.device, torch.dtype], tuple[Tensor, Tensor]] = field(default_factory=dict)

    def on(self, module: str, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """``module``'s factors on ``device`` in ``dtype``, copied there once."""
        key = (module, device, dtype)
        if key not in self._placed:
            a, b = self.factors[module]
            self._placed[key] = (a.to(device=device, dtype=dtype), b.to(device=device, dtype=dtype))
        return self._placed[key]


def read_training_adapter(path: str, family: DiffusionFamily) -> dict[str, tuple[Tensor, Tensor]]:
    """The LoRA file ``path`` of ``family`` (any layout the family reads) as ``{module: (A, B)}``, float32, the scale
    folded into ``B``; a :class:`ConfigError` naming the option for a file it cannot use."""
    from lightning_lora.export import read_lora_file
    from lightning_lora.formats.adapters import adapters_from_peft

    try:
        lora = read_lora_file(path, family)
        adapters = adapters_from_peft(lora.state)
    except (ConfigError, ValueError) as e:
        raise ConfigError(f"{OPTION}: {first_line(e)}") from None
    other = next(((m, a.variant) for m, a in adapters.items() if a.variant != "LoRA"), None)
    if other is not None:
        raise ConfigError(
            f"{OPTION}: {path} holds a {other[1]} layer ({other[0]}); a training adapter is merged as plain LoRA "
            "layers."
        )
    if not adapters:
        raise ConfigError(f"{OPTION}: {path} holds no LoRA layers.")
    return {m: (a["lora_A"].float(), a["lora_B"].float()) for m, a in adapters.items()}


def merge_training_adapter(denoiser: nn.Module, family: DiffusionFamily, path: str) -> TrainingAdapter:
    """Merge the training adapter in ``path`` into ``denoiser`` (loaded, not yet quantized or adapted): ``W += B A`` for
    each of its layers, computed in float32. Returns the :class:`TrainingAdapter`, also kept as
    ``denoiser._lora_training_adapter`` for :func:`adapter_removed`."""
    factors = read_training_adapter(path, family)
    for module, (a, b) in factors.items():
        try:
            layer = denoiser.get_submodule(module)
        except AttributeError:
            raise ConfigError(
                f"{OPTION}: {path} adapts {module!r}, a layer this {family.name} model does not have: an adapter of "
                "another model? Use the training adapter made for model.pretrained."
            ) from None
        weight = getattr(layer, "weight", None)
        if not isinstance(layer, nn.Linear) or weight is None or tuple(weight.shape) != (b.shape[0], a.shape[1]):
            shape = tuple(weight.shape) if isinstance(weight, Tensor) else None
            raise ConfigError(
                f"{OPTION}: {path} adapts {module!r} as a {b.shape[0]}x{a.shape[1]} linear layer, but the model's is "
                f"{type(layer).__name__} {shape}: an adapter of another model?"
            )
        with torch.no_grad():
            weight.copy_((weight.float() + b @ a).to(weight.dtype))
    adapter = TrainingAdapter(str(path), factors)
    denoiser._lora_training_adapter = adapter  # type: ignore[assignment]
    return adapter


@contextlib.contextmanager
def adapter_removed(denoiser: nn.Module) -> Iterator[None]:
    """Inside, ``denoiser`` computes as if its training adapter were not merged: each adapted layer's output less
    ``B (A x)`` (module docstring). Nothing changes for a model without one."""
    adapter: TrainingAdapter | None = getattr(denoiser, "_lora_training_adapter", None)
    if adapter is None:
        yield
        return
    handles = []
    for module in adapter.factors:

        def subtract(layer: nn.Module, args: Any, output: Tensor, name: str = module) -> Tensor:
            x = args[0]
            a, b = adapter.on(name, output.device, output.dtype)
            return output - nn.functional.linear(nn.functional.linear(x.to(output.dtype), a), b)

        handles.append(denoiser.get_submodule(module).register_forward_hook(subtract))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def distillation_note(family: DiffusionFamily, source: ModelSource) -> str | None:
    """One line for ``fit`` to say when the base is step-distilled (:meth:`~lightning_lora.families.base.
    DiffusionFamily.is_distilled`: a hub id of ``architecture.step_distilled``, or a folder whose pipeline says so)
    and no training adapter is given: what will happen and what to do."""
    if source.training_adapter is not None or not family.is_distilled(source):
        return None
    undistilled = "" if source.is_local else family.architecture.step_distilled.get(source.pretrained, "")
    instead = f", or train the undistilled {undistilled} instead" if undistilled else ""
    return (
        f"model.pretrained: {source.pretrained} is step-distilled, and a LoRA trained on it directly pulls it off its "
        f"distillation (its few-step samples drift and break); set {OPTION} to a de-distillation LoRA for it (merged "
        f"for training only, never exported){instead}."
    )


def summary_line(adapter: str) -> str:
    """The start summary's line for a run with the training adapter ``adapter``."""
    return (
        f"Training adapter: {Path(adapter).name} merged into the base for training only (the samples draw without it; "
        "the exported LoRA does not hold it)"
    )
