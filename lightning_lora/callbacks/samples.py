"""Sample images during training: fixed prompts and seeds, every N steps, to TensorBoard and PNG files.

What a user watches to know whether the LoRA is learning. The same prompts and seeds at every step make the images
comparable over time. The images come from the family's diffusers pipeline around the training model itself, so they
are what inference with the exported LoRA gives.

Memory: the prompts (and the empty prompt, the negative side of classifier-free guidance for SDXL and SD1.5) are
encoded once, through the text cache, in ``setup``: before the model is built, so the text encoders never share the
GPU with it; they are then freed (they are not needed while training). The VAE stays on the CPU between samples
and moves to the GPU only for the decode (``offload_vae``). Generation runs under ``no_grad`` in eval mode, and
training mode is restored after; with ``model.compile_blocks`` the blocks run uncompiled unless ``compiled``; a
training adapter merged into the base is taken out (:func:`~lightning_lora.model.training_adapter.adapter_removed`:
the samples are what users run, the base and the LoRA). Only
global rank 0 generates and writes; the other ranks wait at a barrier (under ``trainer.strategy: fsdp`` every rank
generates in step, as the sharded model's forward needs every rank).

Edit models (FLUX.1 Kontext, FLUX.2 with references, Qwen-Image-Edit) draw from fixed control images too, given per
prompt (``controls``): each is scaled to cover the sample's size and center-cropped to it (as a training control is to
its target's bucket), then handed to the family's pipeline, which encodes it as inference does
(:meth:`~lightning_lora.families.base.DiffusionFamily.control_inputs`). For a family whose prompt encoder sees the
controls (Qwen-Image-Edit), each prompt and the empty prompt are encoded with its controls, through the text cache.

With a :class:`~lightning_lora.callbacks.ema.LoraEMA`, every prompt is drawn a second time with the EMA of the LoRA
(``step000500_00_ema.png``, TensorBoard tag ``samples_ema/...``), once the EMA differs from the raw weights.

A sample never ends a run: running out of GPU memory while generating skips that step's images with a warning that
says what to lower, frees what the attempt allocated, and training goes on. The generation's own peak GPU memory is
logged as ``vram/sample_peak_GiB`` (and kept out of the training windows of :class:`VRAMMonitor`).
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from PIL import Image
from typing_extensions import override

from lightning_lora.callbacks.ema import lora_ema
from lightning_lora.data.buckets import cover
from lightning_lora.data.cache import ControlImage, file_digest
from lightning_lora.data.images import BadImage, probe
from lightning_lora.data.recipe import DEFAULT_RESOLUTION, data_recipe
from lightning_lora.errors import ConfigError, first_line
from lightning_lora.families.base import SampleSettings
from lightning_lora.io import atomic_write
from lightning_lora.model.assembly import uncompiled
from lightning_lora.model.parallel import runs_forward_on_every_rank
from lightning_lora.model.training_adapter import adapter_removed
from lightning_lora.module import lora_module

__all__ = ["SampleImages"]

log = logging.getLogger(__name__)


class SampleImages(Callback):
    """Generate sample images from fixed prompts and seeds.

    Args:
        prompts: the prompts to draw, one image each.
        every_n_steps: draw every this many optimizer steps (0: only before and after training).
        seed: image ``i`` uses seed ``seed + i``.
        steps: denoising steps (28 is FLUX.1-dev's usual value).
        guidance_scale: guidance for sampling (3.5 is FLUX.1-dev's usual value).
        height: image height in pixels; null uses the data resolution.
        width: image width in pixels; null uses the data resolution.
        at_start: also draw before the first training step (the base model, for comparison).
        offload_vae: keep the VAE on the CPU between samples.
        dirname: folder under the run folder for the PNG files.
        controls: the control / reference images of each prompt, in order (``controls[i]`` for ``prompts[i]``; an
            empty list for a prompt drawn without any), for an edit family; null: none.
        compiled: with ``model.compile_blocks``, draw through the compiled blocks too. Off, the samples run the
            blocks uncompiled (:func:`~lightning_lora.model.assembly.uncompiled`): no second set of graphs to compile
            for forwards without gradients at the samples' size before the first step (SDXL: 15 graphs, 54 s on an
            H200's host); on, each denoising step may be faster once they have compiled, for runs that draw many
            images often.
        ema: with a ``LoraEMA`` callback, also draw every prompt with the EMA weights (``*_ema.png``).
    """

    def __init__(
        self,
        prompts: list[str],
        every_n_steps: int = 250,
        seed: int = 0,
        steps: int = 28,
        guidance_scale: float = 3.5,
        height: int | None = None,
        width: int | None = None,
        at_start: bool = True,
        offload_vae: bool = True,
        dirname: str = "samples",
        compiled: bool = False,
        controls: list[list[str]] | None = None,
        ema: bool = True,
    ) -> None:
        if controls is not None and len(controls) != len(prompts):
            raise ConfigError(
                f"SampleImages controls: {len(controls)} lists of control images for {len(prompts)} prompts; give one "
                "list per prompt (an empty one for a prompt without controls)."
            )
        self.prompts = list(prompts)
        self.controls = [list(c) for c in controls] if controls is not None else [[] for _ in prompts]
        self.every_n_steps = every_n_steps
        self.seed = seed
        self.steps = steps
        self.guidance_scale = guidance_scale
        self.height = height
        self.width = width
        self.at_start = at_start
        self.offload_vae = offload_vae
        self.dirname = dirname
        self.compiled = compiled
        self.ema = ema
        self._embeddings: list[dict[str, torch.Tensor]] = []
        self._negatives: list[dict[str, torch.Tensor]] = []  # each prompt's empty prompt (seen with its controls)
        self._images: list[tuple[Any, ...]] = []  # each prompt's control images (PIL), placed at the sample's size
        self._vae: torch.nn.Module | None = None
        self._last_step = -1
        self.written: list[Path] = []
        self.skipped: list[int] = []  # steps whose samples ran out of memory

    def folder(self, trainer: Trainer) -> Path:
        return Path(trainer.default_root_dir) / self.dirname

    def _size(self, trainer: Trainer) -> tuple[int, int]:
        data = data_recipe(trainer)
        resolution = data.resolution if data is not None else DEFAULT_RESOLUTION
        return self.height or resolution, self.width or resolution

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit" or not self.prompts:
            return
        height, width = self._size(trainer)
        family = lora_module(pl_module, "SampleImages").family
        family.check_resolution(height, width, "SampleImages height/width")
        self._placed = [
            tuple(self._control(path, i, height, width) for path in paths) for i, paths in enumerate(self.controls)
        ]
        self._images = []
        for placed in self._placed:
            images = tuple(Image.fromarray(c.pixels(self._background(trainer))) for c in placed)
            family.control_inputs(list(images))  # what the pipeline refuses, refused before training
            self._images.append(images)
        if trainer.is_global_zero:
            self._encode_prompts(trainer, pl_module)
        if runs_forward_on_every_rank(trainer.strategy):  # a sharded model: every rank draws (see sample)
            trainer.strategy.barrier("SampleImages.setup")  # rank 0 has cached the prompts' embeddings: the others
            self.prompts = trainer.strategy.broadcast(self.prompts)  # read them (or none drew: rank 0 ran out)
            if self.prompts and not trainer.is_global_zero:
                self._encode_prompts(trainer, pl_module)

    def _encode_prompts(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Encode the prompts through the data's text cache (reusing cached ones) before the model is built, so that
        the text encoders never share the GPU with it; they are freed afterwards."""
        module = lora_module(pl_module, "SampleImages")
        cache = trainer.datamodule.cache()  # type: ignore[attr-defined]
        device, background = trainer.strategy.root_device, self._background(trainer)
        try:
            if module.family.editing.prompt_sees_controls:  # each prompt, and the empty one, seen with its controls
                n = len(self.prompts)
                (*prompts,) = cache.text_embeddings(self.prompts, device, self._placed, background)
                negatives = cache.text_embeddings([""] * n, device, self._placed, background)
            else:
                *prompts, negative = cache.text_embeddings([*self.prompts, ""], device)
                negatives = [negative] * len(prompts)
        except torch.OutOfMemoryError as e:
            log.warning(
                "SampleImages: out of GPU memory while encoding the sample prompts (%s); no samples in this run. Set "
                "data.text_encoder_quantization: nf4 (or fp8).",
                first_line(e, 200),
            )
            self.prompts = []
            return
        self._embeddings = [{k: v.cpu() for k, v in e.items()} for e in prompts]
        self._negatives = [{k: v.cpu() for k, v in e.items()} for e in negatives]
        self._vae = module.family.load_vae(module.source)

    def _control(self, path: str, index: int, height: int, width: int) -> ControlImage:
        """The control image ``path`` of prompt ``index``, placed at the sample's size (scaled to cover it, center-
        cropped); a :class:`ConfigError` naming it when it cannot be read."""
        file = Path(path).expanduser()
        try:
            w, h = probe(file)
            digest = file_digest(file)
        except (BadImage, OSError) as e:
            reason = e.reason if isinstance(e, BadImage) else (e.strerror or str(e))
            raise ConfigError(f"SampleImages controls[{index}]: {path!r} cannot be used ({reason}).") from None
        return ControlImage(file, digest, cover(w, h, (width, height)))

    @staticmethod
    def _background(trainer: Trainer) -> tuple[int, int, int]:
        data = data_recipe(trainer)
        return data.background if data is not None else (255, 255, 255)

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.at_start and trainer.global_step == 0:
            self.sample(trainer, pl_module)

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        step = trainer.global_step
        if self.every_n_steps > 0 and step % self.every_n_steps == 0 and step != self._last_step:
            self.sample(trainer, pl_module)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        stopped_by_signal = any(getattr(cb, "stopped_by_signal", False) for cb in trainer.callbacks)  # type: ignore[attr-defined]
        if trainer.global_step != self._last_step and not stopped_by_signal:
            self.sample(trainer, pl_module)
        self._vae = None

    def sample(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Draw every prompt at the current step (rank 0), log and save the images.

        Under ``trainer.strategy: fsdp`` every rank holds a shard of the model and each forward gathers the weights
        from all ranks, so every rank draws the same images (same seeds) in step; only rank 0 keeps them."""
        self._last_step = trainer.global_step
        if self.prompts and (trainer.is_global_zero or runs_forward_on_every_rank(trainer.strategy)):
            cuda = pl_module.device.type == "cuda"
            if cuda:
                torch.cuda.reset_peak_memory_stats(pl_module.device)
            ema = lora_ema(trainer) if self.ema else None
            try:
                images = self._generate(trainer, pl_module)
                if ema is not None and ema.moved:
                    with ema.applied():
                        images += [(image, "_ema") for image, _ in self._generate(trainer, pl_module)]
            except torch.OutOfMemoryError as e:
                images = []
                self.skipped.append(trainer.global_step)
                log.warning(
                    "SampleImages: out of GPU memory while drawing the samples of step %d (%s); training goes on "
                    "without them. Lower the sample height/width or steps, keep offload_vae: true, or sample less "
                    "often (every_n_steps).",
                    trainer.global_step,
                    first_line(e, 200),
                )
            if cuda:
                peak = torch.cuda.max_memory_allocated(pl_module.device) / 2**30
                for logger in trainer.loggers:
                    logger.log_metrics({"vram/sample_peak_GiB": peak}, step=trainer.global_step)
                torch.cuda.reset_peak_memory_stats(pl_module.device)  # the training window starts afresh
            if images and trainer.is_global_zero:
                self._publish(trainer, images)
        trainer.strategy.barrier("SampleImages")

    @torch.no_grad()
    def _generate(self, trainer: Trainer, pl_module: LightningModule) -> list[tuple[Any, str]]:
        """Every prompt's image, each with the suffix of its file name ("" for the raw weights)."""
        module = lora_module(pl_module, "SampleImages")
        denoiser = module.denoiser
        assert self._vae is not None and denoiser is not None
        vae = self._vae.to(pl_module.device)
        height, width = self._size(trainer)
        was_training = denoiser.training
        denoiser.eval()
        try:
            pipe = module.family.pipeline(denoiser, vae, module.source)
            images = []
            with trainer.precision_plugin.forward_context(), uncompiled(not self.compiled), adapter_removed(denoiser):
                for i, emb in enumerate(self._embeddings):
                    settings = SampleSettings(
                        self.seed + i, height, width, self.steps, self.guidance_scale, controls=self._images[i]
                    )
                    images.append((module.family.generate(pipe, emb, settings, negative=self._negatives[i]), ""))
        finally:
            denoiser.train(was_training)
            if self.offload_vae:
                self._vae = vae.to("cpu")
            if pl_module.device.type == "cuda":
                torch.cuda.empty_cache()
        return images

    def _publish(self, trainer: Trainer, images: list[tuple[Any, str]]) -> None:
        step = trainer.global_step
        folder = self.folder(trainer)
        for j, (image, suffix) in enumerate(images):
            i = j % len(self.prompts)  # the raw weights' images, then the EMA's
            path = folder / f"step{step:06d}_{i:02d}{suffix}.png"
            atomic_write(path, functools.partial(_save_png, image))
            self.written.append(path)
            for logger in trainer.loggers:
                if isinstance(logger, TensorBoardLogger):
                    chw = np.asarray(image.convert("RGB")).transpose(2, 0, 1)
                    logger.experiment.add_image(f"samples{suffix}/{i:02d} {self.prompts[i][:80]}", chw, step)
        log.info("wrote %d sample images for step %d to %s", len(images), step, folder)


def _save_png(image: Any, path: Path) -> None:
    image.save(path, format="PNG")
