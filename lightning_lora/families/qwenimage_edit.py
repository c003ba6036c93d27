"""Qwen-Image-Edit (``QwenImageEditPipeline``) and Qwen-Image-Edit-Plus (2509 / 2511, ``QwenImageEditPlusPipeline``):
Qwen-Image's transformer (:mod:`lightning_lora.families.qwenimage`) trained to edit, its control images' tokens after
the image's, its prompt read by Qwen2.5-VL *with* the control images.

What the pipelines do with the control images, and so what the training step does (shapes for a target of ``H x W``
pixels and ``N`` controls of ``H_i x W_i``; here each control sits in its target's bucket, so ``H_i x W_i = H x W``):

* **The transformer** sees the noisy target's packed tokens, then each control's (the same VAE, the same per-channel
  normalisation, the same 2x2 packing): ``hidden_states [B, (H/16)(W/16) + sum (H_i/16)(W_i/16), 64]``, with
  ``img_shapes = [[(1, H/16, W/16), (1, H_1/16, W_1/16), ...]] * B``: the transformer builds each image's rotary
  positions from it, the ``i``-th image on frame ``i`` (rows and columns centred on 0 for each). Only the target's
  outputs are predicted (the pipeline drops the rest). Qwen-Image-Edit-2511's transformer (``zero_cond_t``) also
  modulates the control tokens with timestep 0: the transformer does it from ``img_shapes``, in training as in the
  pipeline. The timestep shift follows the target's tokens, as the pipelines' schedule does.
* **The prompt** is wrapped in the edit template (a system turn asking to describe the input image and how the
  instruction changes it) and read by Qwen2.5-VL together with the control images, whose vision tokens become part of
  the prompt embeddings (the first 64 template tokens are dropped). Qwen-Image-Edit shows the VL model its one control
  resized to about 1024² pixels inside the user turn; Edit-Plus shows each control resized to about 384² pixels, as
  ``Picture 1: <image>Picture 2: <image>...`` before the instruction, and also reads a prompt without any image. So a
  caption's embeddings depend on its controls: the text cache keeps one entry per (caption, controls) pair
  (``editing.prompt_sees_controls``), made by the pipeline's own ``encode_prompt``. The embeddings' length varies with
  the images (a 384² control adds about 200 tokens): they are cached at their length, padded per batch with their mask
  (:func:`lightning_lora.data.datamodule.collate`), and the loss cuts the batch to its longest, as Qwen-Image's does.
  Edit prompts are never cut (the pipelines read them whole).
* **At inference** the pipelines VAE-encode the control at about 1024² pixels whatever the output size; training
  encodes it in its target's bucket (what musubi-tuner does by default). At a training resolution of 1024 the two
  agree; at 512 the LoRA learns from 512² controls.

Caption dropout trains the empty instruction *with* the controls (the pipelines' negative prompt is the empty prompt
read with the images); mirrored images (``data.random_flip``) are refused, since a pair's cached embedding shows the
unmirrored controls. Qwen-Image-Edit needs a control for every target (its template holds one image); Edit-Plus trains
targets without controls as text-to-image items, but its pipeline draws only with an image, so every sample prompt
needs one.

LoRA files: the transformer is Qwen-Image's, module for module, so the files are Qwen-Image's layouts and load where
they do: the edit pipelines' ``load_lora_weights`` (the same ``QwenImageLoraLoaderMixin``) and ComfyUI, which builds
every Qwen-Image-Edit model as its ``QwenImage`` model (the control images are a ``reference_latents`` conditioning)
and maps ``transformer.<module>`` and ``lora_unet_<module>`` keys onto it (``comfy/lora.py``, ``isinstance(model,
QwenImage)``). Their ModelSpec says ``Qwen-Image-Edit/lora`` / ``Qwen-Image-Edit-Plus/lora`` (musubi-tuner's
names), their kohya files' ``ss_base_model_version`` ``qwen_image_edit`` / ``qwen_image_edit_plus``.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import torch
from typing_extensions import override

from lightning_lora.errors import ConfigError
from lightning_lora.families.base import DiffusersModel, ModelSource, PromptLimit, load_component, load_weights
from lightning_lora.families.encoders import QWEN25_VL_7B
from lightning_lora.families.facts import Architecture, Editing, LoraFiles, Planning, RandomModels
from lightning_lora.families.qwenimage import QWEN_IMAGE_TRANSFORMER, QwenImage, pack_latents
from lightning_lora.formats.kohya import with_base_model_version

__all__ = [
    "QWEN_IMAGE_EDIT_2511_TRANSFORMER",
    "QwenImageEdit",
    "QwenImageEditPlus",
    "edit_controls",
    "images_processor_class",
]

QWEN_IMAGE_EDIT_2511_TRANSFORMER: dict[str, Any] = {**QWEN_IMAGE_TRANSFORMER, "zero_cond_t": True}
"""Qwen/Qwen-Image-Edit-2511's ``transformer/config.json``: Qwen-Image's, with the control tokens modulated at timestep
0 (``zero_cond_t``). Qwen-Image-Edit and -2509 ship Qwen-Image's config unchanged."""


def images_processor_class() -> Any:
    """:class:`transformers.Qwen2VLProcessor` without its video processor: what the edit pipelines call their
    ``processor`` for (the prompt's text and the control images; never a video). transformers 5 builds the whole
    processor only with torchvision installed (its video processor needs it); this one reads the same ``processor``
    folder (the tokenizer and the image processor, the Pillow one without torchvision) and gives the same
    ``input_ids``, ``pixel_values`` and ``image_grid_thw`` for images. Made on first use (importing transformers is
    slow)."""
    return _images_processor()


@functools.cache
def _images_processor() -> Any:
    from transformers import Qwen2VLProcessor
    from transformers.processing_utils import ProcessorMixin

    class Qwen2VLImagesProcessor(Qwen2VLProcessor):
        """Qwen2VLProcessor for text and images only (:func:`images_processor_class`)."""

        def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None) -> None:
            self.image_token = getattr(tokenizer, "image_token", "<|image_pad|>")
            self.video_token = getattr(tokenizer, "video_token", "<|video_pad|>")
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    return Qwen2VLImagesProcessor


_VISION_PATCH = 28
"""Qwen2.5-VL's pixels per vision token a side (14-pixel patches, merged 2x2)."""


def edit_controls(controls: torch.Tensor) -> torch.Tensor:
    """Control latents ``[B, N, C, h, w]`` as the edit pipelines append them: packed ``[B, N (h/2)(w/2), 4C]``, one
    control after the other."""
    b, n, c, h, w = controls.shape
    return pack_latents(controls.reshape(b * n, c, h, w)).reshape(b, n * (h // 2) * (w // 2), 4 * c)


@functools.cache
def _edit_facts(pipeline: str) -> tuple[str, int, float, float]:
    """The edit pipeline's prompt template, the number of its tokens it drops, and the areas (pixels) its VAE and its
    VL model see a control at: read from diffusers, so a release that changes them changes the text cache key."""
    import importlib

    import diffusers

    cls = getattr(diffusers, pipeline)
    module = importlib.import_module(cls.__module__)
    pipe: Any = cls(scheduler=None, vae=None, text_encoder=None, tokenizer=None, processor=None, transformer=None)
    vae_area = float(getattr(module, "VAE_IMAGE_SIZE", 1024 * 1024))
    condition_area = float(getattr(module, "CONDITION_IMAGE_SIZE", vae_area))  # Edit: the VL sees the VAE's image
    return pipe.prompt_template_encode, pipe.prompt_template_encode_start_idx, vae_area, condition_area


class QwenImageEdit(QwenImage):
    """Qwen-Image-Edit (``Qwen/Qwen-Image-Edit``): one control per target, read by the prompt encoder too.

    Args:
        max_sequence_length: the instruction tokens the memory planner plans for beside the control images' vision
            tokens (the edit pipelines read a prompt whole; at most 1024, their limit).
        timestep_sampling: ``qwen_shift`` (logit-normal, shifted by the target's size as Qwen-Image's scheduler
            shifts), ``logit_normal`` (SD3) or ``uniform``.
        logit_mean: mean of the logit-normal draw.
        logit_std: standard deviation of the logit-normal draw.
        shift: a fixed shift for ``qwen_shift``; null means Qwen-Image's resolution-dependent value.
    """

    name: ClassVar[str] = "qwenimage_edit"
    architecture: ClassVar[Architecture] = dataclasses.replace(
        QwenImage.architecture, pipeline_classes=("QwenImageEditPipeline",)
    )
    planning: ClassVar[Planning] = dataclasses.replace(
        QwenImage.planning,
        known_denoisers={"Qwen/Qwen-Image-Edit": QWEN_IMAGE_TRANSFORMER},
        known_text_encoders={"Qwen/Qwen-Image-Edit": {"text_encoder": QWEN25_VL_7B}},
    )
    lora_files: ClassVar[LoraFiles] = dataclasses.replace(
        QwenImage.lora_files,
        layouts=with_base_model_version(QwenImage.lora_files.layouts, "qwen_image_edit"),
        modelspec={"architecture": "Qwen-Image-Edit/lora", "implementation": "https://github.com/QwenLM/Qwen-Image"},
        markers=("Qwen-Image-Edit/", "qwen_image_edit"),  # musubi-tuner's ModelSpec, our ss_base_model_version
    )
    editing: ClassVar[Editing] = Editing(max_controls=1, needs_controls=True, prompt_sees_controls=True)
    drift_prompts: ClassVar[tuple[str, ...]] = ()
    """None: a prompt is read only with its control images, so ``eval/drift`` has no trigger-free prompt to read."""

    # -- loading -----------------------------------------------------------------------------------------------
    @override
    def load_text_encoders(self, source: ModelSource) -> Any:
        """The edit pipeline with its text parts: Qwen2.5-VL, its tokenizer and its processor (which resizes and
        patches the control images for the vision tower)."""
        import diffusers
        from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
        te = load_weights(
            Qwen2_5_VLForConditionalGeneration.from_pretrained, source, "text_encoder", dtype=source.dtype
        )
        return getattr(diffusers, self.pipeline_class)(
            scheduler=None,
            vae=None,
            text_encoder=te.requires_grad_(False).eval(),
            tokenizer=load_component(Qwen2Tokenizer.from_pretrained, source, "tokenizer"),
            processor=load_component(images_processor_class().from_pretrained, source, "processor"),
            transformer=None,
        )

    @classmethod
    @override
    def save_tiny(cls, folder: Path, seed: int = 0) -> Path:
        from lightning_lora.tiny.qwenimage_edit import save_tiny_qwenimage_edit

        return save_tiny_qwenimage_edit(folder, seed=seed, plus=cls.editing.max_controls != 1)

    # -- encoding ----------------------------------------------------------------------------------------------
    def condition_images(self, encoders: Any, images: list[Any]) -> Any:
        """The control images (PIL) as the pipeline of ``encoders`` shows them to its VL model: each resized by its
        image processor to about the pipeline's condition area, sides multiples of 32 (its ``calculate_dimensions``);
        Qwen-Image-Edit's one image alone, Edit-Plus's as a list."""
        import importlib

        module = importlib.import_module(type(encoders).__module__)
        _, _, _, area = _edit_facts(self.pipeline_class)
        resized = []
        for image in images:
            width, height = module.calculate_dimensions(area, image.size[0] / image.size[1])[:2]
            resized.append(encoders.image_processor.resize(image, height, width))
        return resized[0] if self.editing.max_controls == 1 else resized

    @classmethod
    @override
    def random_models(cls) -> RandomModels:
        from lightning_lora.tiny.qwenimage_edit import RANDOM_QWENIMAGE_EDIT, RANDOM_QWENIMAGE_EDIT_PLUS

        return RANDOM_QWENIMAGE_EDIT if cls.editing.max_controls == 1 else RANDOM_QWENIMAGE_EDIT_PLUS

    @torch.no_grad()
    @override
    def encode_prompts(self, encoders: Any, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Prompts without images (Edit-Plus's text-to-image items): the edit pipeline's ``encode_prompt``."""
        if self.editing.needs_controls:
            raise ConfigError(f"the {self.name} family encodes a prompt only with its control image")
        return self._encoded(encoders, prompts, [None] * len(prompts))

    @torch.no_grad()
    @override
    def encode_prompts_with_controls(
        self, encoders: Any, prompts: list[str], controls: list[list[Any]]
    ) -> dict[str, torch.Tensor]:
        """``prompt_embeds [B, L, D]`` and ``prompt_embeds_mask [B, L]`` (int64, 1 for the embedded tokens: the
        vision tokens of the controls and the prompt's) of the pipeline's ``encode_prompt`` for each prompt with its
        control images, resized as the pipeline resizes them (:meth:`condition_images`); ``L`` the batch's longest."""
        return self._encoded(encoders, prompts, [self.condition_images(encoders, c) for c in controls])

    def _encoded(self, encoders: Any, prompts: list[str], images: list[Any]) -> dict[str, torch.Tensor]:
        """One ``encode_prompt`` per prompt (a batch would show every prompt all the images), padded to the longest."""
        device = encoders.text_encoder.device
        parts = []
        for prompt, image in zip(prompts, images, strict=True):
            embeds, mask = encoders.encode_prompt(prompt=[prompt], image=image, device=device)
            if mask is None:  # the pipeline's "every position is the prompt's"
                mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
            parts.append((embeds[0], mask[0]))
        n = max(e.shape[0] for e, _ in parts)
        embeds = torch.stack([torch.nn.functional.pad(e, (0, 0, 0, n - e.shape[0])) for e, _ in parts])
        mask = torch.stack([torch.nn.functional.pad(m.long(), (0, n - m.shape[0])) for _, m in parts])
        return {"prompt_embeds": embeds, "prompt_embeds_mask": mask}

    @override
    def text_cache_tag(self) -> str:
        template, drop, vae_area, condition_area = _edit_facts(self.pipeline_class)
        digest = hashlib.sha256(json.dumps([template, drop, vae_area, condition_area]).encode()).hexdigest()[:8]
        return f"{self.name}-template{digest}"

    @override
    def prompt_limit(self, encoders: Any) -> PromptLimit | None:
        return None  # the edit pipelines read a prompt whole

    # -- training ----------------------------------------------------------------------------------------------
    @override
    def with_controls(
        self, tokens: torch.Tensor, shapes: list[list[tuple[int, int, int]]], controls: torch.Tensor | None
    ) -> tuple[torch.Tensor, list[list[tuple[int, int, int]]]]:
        if controls is None:
            return tokens, shapes
        appended = edit_controls(controls.to(tokens.device)).to(tokens.dtype)
        return torch.cat([tokens, appended], dim=1), [shapes[0] * (1 + controls.shape[1])] * tokens.shape[0]

    # -- sampling ----------------------------------------------------------------------------------------------
    @override
    def pipeline_options(self, source: ModelSource) -> dict[str, Any]:
        return {"processor": None}  # the prompts come cached, seen with their controls

    @override
    def control_inputs(self, images: list[Any]) -> dict[str, Any]:
        """The controls as ``image`` (the one image for Qwen-Image-Edit, a list for Edit-Plus); the pipeline encodes
        them at about 1024² pixels whatever the sample's size. It draws only with a control."""
        if not images:
            raise ConfigError(
                f"SampleImages controls: {self.pipeline_class} draws only from a control image; give every prompt one."
            )
        return {"image": images[0] if self.editing.max_controls == 1 else list(images)}

    # -- interop -----------------------------------------------------------------------------------------------
    @classmethod
    @override
    def claims_lora_keys(cls, tensors: Mapping[str, torch.Tensor]) -> int:
        """0: an edit LoRA's names are Qwen-Image's (its header tells them apart)."""
        return 0

    # -- memory planning ---------------------------------------------------------------------------------------
    @override
    def example_batch(
        self,
        config: Mapping[str, Any],
        batch: int,
        height: int,
        width: int,
        text_len: int,
        generator: torch.Generator | None = None,
        controls: int = 0,
    ) -> dict[str, torch.Tensor]:
        """Qwen-Image's example batch with ``controls`` controls, the prompt longer by their vision tokens
        (:meth:`control_text_tokens`), as the planner counts it (:meth:`example_inputs_with_controls`)."""
        text_len += controls * self.control_text_tokens()
        return super().example_batch(config, batch, height, width, text_len, generator, controls)

    @override
    def example_text(
        self, config: Mapping[str, Any], batch: int, text_len: int, generator: torch.Generator | None = None
    ) -> dict[str, torch.Tensor]:
        """Qwen2.5-VL's last hidden state of ``text_len`` tokens, all of them the prompt's (an edit prompt is cached at
        its own length, never cut to ``max_sequence_length``), and an int64 mask."""
        embeds = torch.randn(batch, text_len, config["joint_attention_dim"], generator=generator)
        return {"prompt_embeds": embeds.bfloat16(), "prompt_embeds_mask": torch.ones(batch, text_len, dtype=torch.long)}

    def control_text_tokens(self) -> int:
        """The prompt embeddings' tokens one control adds: the vision tokens of the image the VL model sees (about the
        pipeline's condition area, in 28-pixel tokens) and the few around them."""
        _, _, _, area = _edit_facts(self.pipeline_class)
        return round(math.sqrt(area) / _VISION_PATCH) ** 2 + 8

    @override
    def example_inputs_with_controls(
        self,
        model: DiffusersModel,
        batch: int,
        height: int,
        width: int,
        text_len: int,
        controls: int,
        device: str,
        dtype: torch.dtype,
    ) -> dict[str, Any]:
        """Qwen-Image's inputs with ``controls`` controls of the target's size appended, and the prompt longer by their
        vision tokens (:meth:`control_text_tokens`)."""
        inputs = self.example_inputs(
            model, batch, height, width, text_len + controls * self.control_text_tokens(), device, dtype
        )
        if controls:
            hidden = inputs["hidden_states"]
            inputs["hidden_states"] = hidden.new_empty(batch, hidden.shape[1] * (1 + controls), hidden.shape[2])
            inputs["img_shapes"] = [inputs["img_shapes"][0] * (1 + controls)] * batch
        return inputs


class QwenImageEditPlus(QwenImageEdit):
    """Qwen-Image-Edit-Plus (``Qwen/Qwen-Image-Edit-2509``, ``-2511``): several controls per target in order, or none
    (text-to-image items); the options are :class:`QwenImageEdit`'s."""

    name: ClassVar[str] = "qwenimage_edit_plus"
    architecture: ClassVar[Architecture] = dataclasses.replace(
        QwenImage.architecture, pipeline_classes=("QwenImageEditPlusPipeline",)
    )
    planning: ClassVar[Planning] = dataclasses.replace(
        QwenImage.planning,
        known_denoisers={
            "Qwen/Qwen-Image-Edit-2509": QWEN_IMAGE_TRANSFORMER,
            "Qwen/Qwen-Image-Edit-2511": QWEN_IMAGE_EDIT_2511_TRANSFORMER,
        },
        known_text_encoders=dict.fromkeys(
            ("Qwen/Qwen-Image-Edit-2509", "Qwen/Qwen-Image-Edit-2511"), {"text_encoder": QWEN25_VL_7B}
        ),
    )
    lora_files: ClassVar[LoraFiles] = dataclasses.replace(
        QwenImage.lora_files,
        layouts=with_base_model_version(QwenImage.lora_files.layouts, "qwen_image_edit_plus"),
        modelspec={
            "architecture": "Qwen-Image-Edit-Plus/lora",
            "implementation": "https://github.com/QwenLM/Qwen-Image",
        },
        # musubi-tuner's ModelSpecs, our ss_base_model_version
        markers=("Qwen-Image-Edit-Plus/", "Qwen-Image-Edit-2511/", "qwen_image_edit_plus"),
    )
    editing: ClassVar[Editing] = Editing(max_controls=None, prompt_sees_controls=True)
