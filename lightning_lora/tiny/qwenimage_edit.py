"""The tiny Qwen-Image-Edit and Qwen-Image-Edit-Plus pipelines (see :mod:`lightning_lora.tiny.qwenimage` for the parts
they share with the tiny Qwen-Image: the transformer, the video VAE, the Qwen2.5-VL text encoder, the byte-level BPE
tokenizer and the scheduler config).

What is new here is what an edit pipeline runs that Qwen-Image never does:

* the **vision tower** of Qwen2.5-VL (1 block, 16 wide, 2-pixel patches merged 2x2) and its ``image_token_id`` /
  ``vision_start_token_id`` set to the tiny vocabulary's ids, so the control images become vision tokens of the prompt;
* the **processor** (``processor/``): the tokenizer and a Qwen2-VL image processor that resizes an image to between
  16² and 32² pixels (multiples of 4) before patching it, so a control is at most 64 vision tokens (the real one's
  limits are far larger);
* a **tokenizer** whose vocabulary also holds the edit templates' words, each one token as in the real tokenizer
  (both templates' system turn and user header are exactly the 64 tokens the pipelines drop), and the vision
  specials ``<|vision_start|>``, ``<|vision_end|>``, ``<|image_pad|>`` (and ``<|video_pad|>``, which the processor
  looks up);
* Edit-Plus's transformer has ``zero_cond_t`` (Qwen-Image-Edit-2511's: the control tokens modulated at timestep 0).

The processor is :func:`~lightning_lora.families.qwenimage_edit.images_processor_class` (Qwen2VLProcessor without the
video processor, which transformers 5 builds only with torchvision); ``model_index.json`` names it
``Qwen2VLProcessor``, as the real repositories do, so ``DiffusionPipeline.from_pretrained`` of the folder needs
torchvision here as there (the tests load it through ``helpers.diffusers_quirks.qwen_processor_without_torchvision``).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from diffusers import FlowMatchEulerDiscreteScheduler, QwenImageEditPipeline, QwenImageEditPlusPipeline
from transformers import Qwen2Tokenizer
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from lightning_lora.families.qwenimage_edit import images_processor_class
from lightning_lora.tiny.qwenimage import (
    QWEN_IMAGE_SCHEDULER_CONFIG,
    RANDOM_QWENIMAGE,
    TEMPLATE_WORDS,
    make_qwen_tokenizer,
    tiny_qwen_transformer,
    tiny_qwen_vae,
    tiny_qwen_vl,
)
from lightning_lora.tiny.shared import CAPTION_WORDS, _save_tiny

__all__ = [
    "EDIT_TEMPLATE_WORDS",
    "RANDOM_QWENIMAGE_EDIT",
    "RANDOM_QWENIMAGE_EDIT_PLUS",
    "build_tiny_qwenimage_edit",
    "make_edit_tokenizer",
    "save_tiny_qwenimage_edit",
]

#: The words and punctuation of the edit pipelines' templates beyond Qwen-Image's (each one token, as in the real
#: tokenizer), and Edit-Plus's ``Picture <n>:`` labels.
EDIT_TEMPLATE_WORDS: tuple[str, ...] = (
    "key", "features", "input", "(", "),", "then", "explain", "how", "'s", "instruction", "should", "alter", "or",
    "modify", ".", "Generate", "new", "that", "meets", "requirements", "while", "maintaining", "consistency",
    "original", "where", "appropriate", "Picture", ":",
)  # fmt: skip

VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"


def make_edit_tokenizer() -> Qwen2Tokenizer:
    """The tiny Qwen2 tokenizer of the edit pipelines, in memory: :func:`~lightning_lora.tiny.qwenimage.
    make_qwen_tokenizer`'s words and the edit templates', its specials and the vision ones."""
    words = (*TEMPLATE_WORDS, *CAPTION_WORDS, *EDIT_TEMPLATE_WORDS)
    return make_qwen_tokenizer(words, (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD))


def build_tiny_qwenimage_edit(seed: int = 0, plus: bool = True) -> Any:
    """A ``QwenImageEditPlusPipeline`` (``plus``) or ``QwenImageEditPipeline`` with tiny random weights (fp32, every
    component in ``eval()``); see the module docstring."""
    tokenizer = make_edit_tokenizer()
    ids = {
        name: tokenizer.convert_tokens_to_ids(token)
        for name, token in (
            ("image_token_id", IMAGE_PAD),
            ("video_token_id", VIDEO_PAD),
            ("vision_start_token_id", VISION_START),
            ("vision_end_token_id", VISION_END),
        )
    }
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=16 * 16, max_pixels=32 * 32, patch_size=2, merge_size=2, temporal_patch_size=1
    )
    cls = QwenImageEditPlusPipeline if plus else QwenImageEditPipeline
    return cls(
        scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER_CONFIG),
        vae=tiny_qwen_vae(seed),
        text_encoder=tiny_qwen_vl(seed, tokenizer, **ids),
        tokenizer=tokenizer,
        processor=images_processor_class()(image_processor=image_processor, tokenizer=tokenizer),
        transformer=tiny_qwen_transformer(seed, **({"zero_cond_t": True} if plus else {})),
    )


class _Saved:
    """The pipeline to save, its ``model_index.json`` naming the processor as the real repositories do."""

    def __init__(self, pipeline: Any) -> None:
        self.pipeline = pipeline

    def save_pretrained(self, folder: Path, **options: Any) -> None:
        self.pipeline.save_pretrained(folder, **options)
        index = Path(folder) / "model_index.json"
        config = json.loads(index.read_text())
        config["processor"] = ["transformers", "Qwen2VLProcessor"]
        index.write_text(json.dumps(config, indent=2) + "\n")


def save_tiny_qwenimage_edit(folder: Path, seed: int = 0, plus: bool = True) -> Path:
    """Build the tiny edit pipeline and save it to ``folder`` (atomically, idempotent; see
    :func:`lightning_lora.tiny.flux.save_tiny_flux`)."""
    wanted = {"family": "qwenimage_edit_plus" if plus else "qwenimage_edit", "seed": seed}
    build = lambda: _Saved(build_tiny_qwenimage_edit(seed, plus))  # noqa: E731
    return _save_tiny(Path(folder), wanted, build, "Qwen-Image-Edit")


RANDOM_QWENIMAGE_EDIT = dataclasses.replace(RANDOM_QWENIMAGE, denoiser="Qwen/Qwen-Image-Edit")
"""What the benchmark builds for Qwen-Image-Edit with random weights: Qwen-Image's transformer and scheduler."""
RANDOM_QWENIMAGE_EDIT_PLUS = dataclasses.replace(
    RANDOM_QWENIMAGE,
    denoiser="Qwen/Qwen-Image-Edit-2511",
    tiny_denoiser={**RANDOM_QWENIMAGE.tiny_denoiser, "zero_cond_t": True},
)
"""The same for Qwen-Image-Edit-2511, whose transformer conditions the reference images at timestep zero."""
