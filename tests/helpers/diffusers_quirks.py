"""Two places where diffusers (0.42) hard-codes FLUX.1's widths, made to work with the tiny FLUX of the tests, and the
Qwen-Image-Edit processor that transformers 5 builds only with torchvision.

* Its single-file converter (BFL layout -> diffusers, ``from_single_file``) splits ``single_blocks.i.linear1`` with
  ``torch.split(..., [3072, 3072, 3072, 12288])``: :func:`allow_any_flux_width` translates that one split to the
  model's widths.
* Its kohya LoRA converter (``_convert_kohya_flux_lora_to_diffusers``, used by ``load_lora_weights``) splits the
  ``linear1`` LoRA with the literal ``dims=[3072, 3072, 3072, 12288]`` and asserts they add up to its rows, so any
  narrower model fails: :func:`diffusers_kohya_reads_flux_widths` rebuilds that function from diffusers' own source
  with the widths read from the file instead. Files of other families never reach that function.

Everything else in both converters is width-agnostic.

* ``QwenImageEdit(Plus)Pipeline.from_pretrained`` loads its ``processor`` as ``transformers.Qwen2VLProcessor``, whose
  video processor needs torchvision (not installed here): :func:`qwen_processor_without_torchvision` loads the same
  folder with the image-only processor the family itself uses
  (:func:`lightning_lora.families.qwenimage_edit.images_processor_class`), which gives the same inputs for images.

* The edit pipelines (``QwenImageEdit(Plus)Pipeline``) encode a control image at about 1024² pixels whatever the
  output size (their ``calculate_dimensions`` of ``1024 * 1024``): with the tiny models on the CPU that is 20 s a
  draw. :func:`small_edit_images` divides the area their ``calculate_dimensions`` is asked for by 256 (1024² -> 64²,
  Edit-Plus's 384² for its VL model -> 24²); the family reads the same function when it encodes a prompt with its
  controls, so a test that patches it sees one consistent pipeline.

Each patch goes through ``monkeypatch``: it ends with the test.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping

import pytest
import torch

from lightning_lora.formats.bfl import FluxDims

FLUX1_LINEAR1 = (3072, 3072, 3072, 12288)
"""FLUX.1's ``single_blocks.i.linear1`` rows: q, k, v (inner width each) and the MLP input."""


def allow_any_flux_width(monkeypatch: pytest.MonkeyPatch, dims: FluxDims) -> None:
    """Let diffusers' single-file converter load a BFL-layout FLUX narrower than FLUX.1 (see the module docstring)."""
    real_split = torch.split
    ours = (dims.inner_dim, dims.inner_dim, dims.inner_dim, dims.mlp_hidden_dim)

    def split(tensor: torch.Tensor, sizes: int | list[int] | tuple[int, ...], dim: int = 0) -> tuple[torch.Tensor, ...]:
        if isinstance(sizes, (tuple, list)) and tuple(sizes) == FLUX1_LINEAR1:
            sizes = ours
        return real_split(tensor, sizes, dim)  # type: ignore[arg-type]  # a tuple of sizes, as torch takes it too

    monkeypatch.setattr(torch, "split", split)


def _linear1_widths(state: Mapping[str, torch.Tensor], name: str) -> list[int]:
    """The q, k, v and MLP widths of a kohya ``linear1`` LoRA: ``lora_down`` is ``[R, inner]``, ``lora_up``'s rows are
    ``3 * inner + mlp``."""
    down, up = state.get(f"{name}.lora_down.weight"), state.get(f"{name}.lora_up.weight")
    if down is None or up is None:
        return list(FLUX1_LINEAR1)  # diffusers skips a module the file does not have
    inner = down.shape[1]
    return [inner, inner, inner, up.shape[0] - 3 * inner]


def diffusers_kohya_reads_flux_widths(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let ``load_lora_weights`` convert a kohya FLUX LoRA of any width (see the module docstring), and say so where
    lightning-lora decides which tools load a file (``families.flux.DIFFUSERS_KOHYA_WIDTHS``: any)."""
    from diffusers.loaders import lora_conversion_utils, lora_pipeline

    from lightning_lora.families import flux

    monkeypatch.setattr(flux, "DIFFUSERS_KOHYA_WIDTHS", None)

    original = lora_conversion_utils._convert_kohya_flux_lora_to_diffusers
    source = inspect.getsource(original)
    literal = f"dims={list(FLUX1_LINEAR1)}"
    assert source.count(literal) == 1, "diffusers' kohya converter changed: revisit this workaround"
    read = 'dims=_linear1_widths(sds_sd, f"lora_unet_single_blocks_{i}_linear1")'
    namespace = {**vars(lora_conversion_utils), "_linear1_widths": _linear1_widths}
    exec(compile(source.replace(literal, read), inspect.getsourcefile(original) or "<diffusers>", "exec"), namespace)
    monkeypatch.setattr(lora_pipeline, original.__name__, namespace[original.__name__])


def qwen_processor_without_torchvision(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let diffusers load an edit pipeline's ``processor`` without torchvision (see the module docstring); nothing
    changes where torchvision is installed."""
    import importlib.util

    import transformers

    from lightning_lora.families.qwenimage_edit import images_processor_class

    if importlib.util.find_spec("torchvision") is None:
        monkeypatch.setattr(transformers.Qwen2VLProcessor, "from_pretrained", images_processor_class().from_pretrained)


def small_edit_images(monkeypatch: pytest.MonkeyPatch) -> None:
    """The edit pipelines' control sizes divided by 16 a side (see the module docstring)."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit, pipeline_qwenimage_edit_plus

    for module in (pipeline_qwenimage_edit, pipeline_qwenimage_edit_plus):
        original = module.calculate_dimensions
        monkeypatch.setattr(module, "calculate_dimensions", lambda area, ratio, f=original: f(area / 256, ratio))
