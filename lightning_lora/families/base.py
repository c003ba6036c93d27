"""What a model family must provide.

A *family* (FLUX.1, SDXL, Z-Image...) is everything that differs between diffusion models from the trainer's point of
view: which classes to load from which subfolder, how prompts and images become tensors, how a noisy latent and a
timestep become a prediction and a loss, which layers LoRA targets, and which diffusers pipeline draws sample images.
The rest of lightning-lora (assembly, cache, module, callbacks, export) talks to a family only through
:class:`DiffusionFamily`, so no code outside ``families/`` asks "is this FLUX?".

A family declares its *facts* in frozen dataclasses (:mod:`lightning_lora.families.facts`): ``architecture`` (the
hub's pipeline classes, denoiser and text encoders, whose identities key the text cache; image sides; LoRA presets),
``compiling``, ``planning`` and ``lora_files`` (the LoRA file layouts it writes, each a layout of
:mod:`lightning_lora.formats` bound to its names; who loads them; what names it in a file made elsewhere), and for an
edit model ``editing`` (the control images it takes beside the prompt). The class keeps the *behaviour*: loading,
encoding, the loss, the sampling pipeline, the planner's inputs, and the interop that is code
(:meth:`DiffusionFamily.lora_coverage`, :meth:`DiffusionFamily.claims_lora_keys`).

Families are chosen in the YAML by class path, with their own typed options::

    model:
      family:
        class_path: lightning_lora.families.Flux
        init_args: {guidance: 1.0, timestep_sampling: flux_shift}

:class:`ModelSource` says where the weights come from (a hub id, a local diffusers folder, a single file for the
denoiser), is checked before any heavy work, and is identified by its files' content: all of it in
:mod:`lightning_lora.families.source` (its names are importable from here too).
"""

from __future__ import annotations

import contextlib
import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

import torch
from torch import nn

from lightning_lora.errors import ConfigError
from lightning_lora.families.facts import Architecture, Compiling, Editing, LoraFiles, Planning, RandomModels
from lightning_lora.families.source import (
    ModelSource,
    build_from_config,
    check_source,
    compute_dtype,
    content_digest,
    load_component,
    load_weights,
    looks_local,
    source_problem,
)
from lightning_lora.objectives import Prediction, Reference, masked_mse, per_sample_mse, preserved_target

if TYPE_CHECKING:
    from lightning_lora.formats import LoraLayout
    from lightning_lora.formats.adapters import Adapter
    from lightning_lora.formats.clients import Coverage

__all__ = [
    "DiffusersModel",
    "DiffusionFamily",
    "ModelSource",
    "PromptLimit",
    "SampleSettings",
    "SampleText",
    "build_from_config",
    "check_source",
    "compute_dtype",
    "content_digest",
    "load_component",
    "load_weights",
    "looks_local",
    "source_problem",
    "FAMILIES",
]


DiffusersModel = Any
"""A diffusers model (``ModelMixin``: a transformer, UNet or VAE). Typed ``Any`` on purpose: its ``config`` fields and
methods (``encode``, ``enable_gradient_checkpointing``...) are attributes that ``nn.Module``'s typing cannot see."""

FAMILIES: dict[str, type[DiffusionFamily]] = {}
"""The registry: family name -> class. Filled by :meth:`DiffusionFamily.__init_subclass__`."""


@dataclass(frozen=True)
class SampleSettings:
    """How one sample image is drawn besides its prompt, for every family (``SampleImages``'s options)."""

    seed: int
    """The seed of the starting noise (drawn on the CPU: the same on any device)."""
    height: int
    width: int
    steps: int
    """Denoising steps."""
    guidance_scale: float
    """The guidance as the family's pipeline reads it: classifier-free guidance's scale, or a guidance-distilled
    model's guidance input (FLUX.1-dev)."""
    controls: tuple[Any, ...] = ()
    """The control / reference images (PIL, in order) an edit model draws from (:meth:`DiffusionFamily.
    control_inputs`); none for a text-to-image sample."""


class SampleText(NamedTuple):
    """One prompt's cached embeddings (a batch of 1) to draw a sample from, the empty prompt's (the negative side of
    classifier-free guidance; None when not given), and where the pipeline's denoiser runs."""

    embeddings: dict[str, torch.Tensor]
    negative: dict[str, torch.Tensor] | None
    device: torch.device
    dtype: torch.dtype

    def to_denoiser(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` on the denoiser's device, in its compute dtype."""
        return tensor.to(device=self.device, dtype=self.dtype)


class PromptLimit(NamedTuple):
    """How much of a prompt a family's text encoder reads: its ``tokenizer``, the number of ``tokens`` it reads
    (special tokens included; the rest of a longer prompt is cut off), and the encoder's ``name`` for messages."""

    tokenizer: Any
    tokens: int
    name: str

    def truncated(self, prompts: list[str]) -> list[bool]:
        """Whether each prompt is longer than the encoder reads (so it is cut)."""
        ids = self.tokenizer(prompts, truncation=False).input_ids
        return [len(i) > self.tokens for i in ids]

    def __str__(self) -> str:
        return f"{self.tokens} {self.name} tokens"


class DiffusionFamily(ABC):
    """The seam between lightning-lora and one kind of diffusion model. See the module docstring.

    Subclasses are registered by ``name`` and declare their facts (:mod:`lightning_lora.families.facts`). Batches are
    dicts of tensors: ``latents`` (normalized VAE latents, ``[B, C, h, w]``) plus whatever :meth:`encode_prompts`
    returns per prompt.
    """

    name: ClassVar[str]
    """The family's name in the registry (:data:`FAMILIES`), in messages and in ``--family``."""
    architecture: ClassVar[Architecture]
    """The model as the hub ships it: pipeline classes, denoiser, text encoders, image sides, LoRA presets."""
    compiling: ClassVar[Compiling] = Compiling()
    """How ``model.compile_blocks``, checkpointing and ``model.attention: auto`` treat the denoiser."""
    planning: ClassVar[Planning] = Planning()
    """What the memory planner knows of the family's models without a download."""
    lora_files: ClassVar[LoraFiles] = LoraFiles()
    """The LoRA files the family writes and who loads them."""
    editing: ClassVar[Editing] = Editing()
    """The control / reference images the model takes beside the prompt (none for a text-to-image family)."""
    drift_prompts: ClassVar[tuple[str, ...]] = (
        "a photo of a man standing in a park",
        "a photo of a woman reading a book in a cafe",
        "a red car parked on a city street",
        "a bowl of fruit on a wooden table",
    )
    """Prompts without any trigger, in the way the family's models are prompted: the fixed evaluation's default for
    ``eval/drift``, how far the LoRA moves the model's predictions away from the base on what it was not trained on
    (:class:`~lightning_lora.callbacks.evaluation.FixedEvalLoss`). People, a thing and a scene: where a subject or a
    style bleeds first."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "name" in cls.__dict__:
            FAMILIES[cls.name] = cls

    # -- loading -----------------------------------------------------------------------------------------------
    def check_source(self, source: ModelSource) -> None:
        check_source(source, self.architecture.pipeline_classes)

    def denoiser_cls(self) -> Any:
        """The diffusers class of the denoiser (``architecture.denoiser_class``, imported now)."""
        import diffusers

        return getattr(diffusers, self.architecture.denoiser_class)

    def load_denoiser(self, source: ModelSource) -> nn.Module:
        """The trainable backbone (transformer or UNet) in ``source.dtype``, frozen, in eval mode (by default
        :meth:`load_denoiser_weights` of ``architecture.denoiser_class``; families whose single files need more override
        it)."""
        return self.load_denoiser_weights(self.denoiser_cls(), source)

    def load_vae(self, source: ModelSource) -> nn.Module:
        """The VAE (``vae/`` of ``source``), frozen, in eval mode."""
        from diffusers import AutoencoderKL

        vae = load_weights(AutoencoderKL.from_pretrained, source, "vae", torch_dtype=source.dtype)
        return vae.requires_grad_(False).eval()

    def load_denoiser_weights(self, cls: Any, source: ModelSource) -> nn.Module:
        """``cls`` (the denoiser class) from ``source``, frozen, in eval mode: from the single ``denoiser_file``
        when one is given (diffusers converts the original layout; its config comes from ``source``), else from the
        ``denoiser_subfolder`` of the folder or hub repository."""
        if source.denoiser_file is not None:
            model = cls.from_single_file(
                source.denoiser_file,
                config=source.local_path,
                subfolder=self.architecture.denoiser_subfolder,
                torch_dtype=source.dtype,
                local_files_only=source.is_local,
            )
        else:
            model = load_weights(
                cls.from_pretrained, source, self.architecture.denoiser_subfolder, torch_dtype=source.dtype
            )
        return model.requires_grad_(False).eval()

    @abstractmethod
    def load_text_encoders(self, source: ModelSource) -> Any:
        """Whatever :meth:`encode_prompts` needs (text encoders and tokenizers), frozen, in eval mode."""

    # -- encoding (cache time) ---------------------------------------------------------------------------------
    @abstractmethod
    def encode_prompts(self, encoders: Any, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Encode prompts; every returned tensor has the batch as its first dimension."""

    @abstractmethod
    def encode_images(self, vae: DiffusersModel, pixels: torch.Tensor) -> torch.Tensor:
        """Encode images in [-1, 1], ``[B, 3, H, W]``, to normalized latents ``[B, C, H/8, W/8]`` (float32)."""

    def prompt_limit(self, encoders: Any) -> PromptLimit | None:
        """How much of a prompt the text encoder that carries it reads, for reporting captions that are cut (the
        cache counts them instead of the pipelines' per-batch warnings). Default: the CLIP tokenizer
        (``encoders.tokenizer``) and its ``model_max_length`` (77); ``None`` when ``encoders`` has none."""
        tokenizer = getattr(encoders, "tokenizer", None)
        return None if tokenizer is None else PromptLimit(tokenizer, int(tokenizer.model_max_length), "CLIP")

    def encode_prompts_with_controls(
        self, encoders: Any, prompts: list[str], controls: list[list[Any]]
    ) -> dict[str, torch.Tensor]:
        """Encode prompts whose embeddings depend on control images (``editing.prompt_sees_controls``): ``controls[i]``
        are the PIL images of prompt ``i``, as the pipeline's own prompt encoder sees them. Only edit families whose
        prompt encoder reads images implement it."""
        raise NotImplementedError(f"the {self.name} family's prompts do not see control images")

    @property
    def text_tokens(self) -> int:
        """The length of the prompt embeddings the denoiser sees, in tokens (CLIP's 77 by default)."""
        return 77

    @abstractmethod
    def text_cache_tag(self) -> str:
        """The options that change prompt embeddings (e.g. the max token length); part of the text cache key."""

    # -- training ----------------------------------------------------------------------------------------------
    @abstractmethod
    def sample_timesteps(self, latents: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Draw one timestep per sample of ``latents`` (on the CPU; the caller moves it)."""

    def sample_noise(self, latents: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """The training noise for ``latents`` (float32, same shape), on the generator's device, or on the latents'
        device when drawn from the global random state."""
        device = generator.device if generator is not None else latents.device
        return torch.randn(latents.shape, generator=generator, dtype=torch.float32, device=device)

    @abstractmethod
    def predict(
        self, denoiser: DiffusersModel, batch: dict[str, torch.Tensor], noise: torch.Tensor, timesteps: torch.Tensor
    ) -> Prediction:
        """The denoiser's prediction for the batch noised with ``noise`` at ``timesteps``, and its training target, in
        the denoiser's layout (:meth:`prediction_layout`), with the family's weight per sample (min-SNR) if it has
        one."""

    def prediction_layout(self, latent_map: torch.Tensor) -> torch.Tensor:
        """A map of the latents' shape ``[B, C, h, w]`` (a mask's loss weights) in the layout of :meth:`predict`'s
        tensors, packed as the family packs its latents. Default: the latents' own layout (UNets, Z-Image)."""
        return latent_map

    def loss(
        self,
        denoiser: DiffusersModel,
        batch: dict[str, torch.Tensor],
        noise: torch.Tensor,
        timesteps: torch.Tensor,
        reference: Reference | None = None,
    ) -> torch.Tensor:
        """The per-sample training loss ``[B]`` for given noise and timesteps (see :mod:`lightning_lora.objectives`):
        :meth:`predict`'s prediction against its target, or against ``reference`` for its rows (DOP); weighted per
        element by the batch's ``loss_mask`` (``[B, 1, h, w]`` loss weights of the latents' grid, when the data has
        masks), packed by :meth:`prediction_layout`; times the family's weight per sample."""
        out = self.predict(denoiser, batch, noise, timesteps)
        target = out.target if reference is None else preserved_target(out.target, reference)
        mask = batch.get("loss_mask")
        if mask is None:
            losses = per_sample_mse(out.prediction, target)
        else:
            latents = batch["latents"]
            weights = self.prediction_layout(mask.to(latents.device).expand(latents.shape))
            losses = masked_mse(out.prediction, target, weights)
        return losses if out.sample_weights is None else losses * out.sample_weights

    # -- sampling ----------------------------------------------------------------------------------------------
    def pipeline(self, denoiser: DiffusersModel, vae: DiffusersModel, source: ModelSource) -> Any:
        """A diffusers pipeline around the (LoRA-carrying) denoiser that generates from prompt embeddings: the family's
        :attr:`pipeline_class` with ``vae``, the :meth:`sampling_scheduler`, no text encoders or tokenizers (the
        prompts come cached), whatever else the class needs (:meth:`pipeline_options`), its progress bar off."""
        import diffusers

        text = self.architecture.text_encoders + self.architecture.tokenizers
        parts: dict[str, Any] = dict.fromkeys(text)
        parts.update(vae=vae, scheduler=self.sampling_scheduler(source), **self.pipeline_options(source))
        parts[self.architecture.denoiser_subfolder] = denoiser
        pipe: Any = getattr(diffusers, self.pipeline_class)(**parts)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    @property
    def pipeline_class(self) -> str:
        """The diffusers pipeline class samples are drawn with (the first of ``architecture.pipeline_classes``)."""
        return self.architecture.pipeline_classes[0]

    def is_distilled(self, source: ModelSource) -> bool:
        """Whether ``source`` is a step-distilled model (a few steps, no guidance). Default: one of
        ``architecture.step_distilled``'s hub ids; a family whose pipeline records it (FLUX.2 klein's and Krea 2's
        ``is_distilled`` in ``model_index.json``) reads a folder's too."""
        return not source.is_local and source.pretrained in self.architecture.step_distilled

    def pipeline_options(self, source: ModelSource) -> dict[str, Any]:
        """What :attr:`pipeline_class` needs besides its denoiser, VAE, scheduler and text components (none by
        default)."""
        return {}

    def sampling_scheduler(self, source: ModelSource) -> Any:
        """The scheduler samples are drawn with. Default: the model's own ``scheduler/`` as diffusers' flow-matching
        Euler scheduler (what the flow-matching pipelines load)."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        return load_component(FlowMatchEulerDiscreteScheduler.from_pretrained, source, "scheduler")

    def generate(
        self,
        pipeline: Any,
        embeddings: dict[str, torch.Tensor],
        settings: SampleSettings,
        negative: dict[str, torch.Tensor] | None = None,
    ) -> Any:
        """One image (PIL) for one prompt's embeddings (batch of 1), drawn by ``pipeline`` (:meth:`pipeline`) as
        ``settings`` say, reproducible from its seed: a CPU generator draws the same starting noise on any device.

        ``negative`` holds the empty prompt's embeddings (same keys), the negative side of classifier-free guidance
        for the families that use it; a family without CFG (FLUX.1-dev) ignores it. The family turns the embeddings
        and the guidance into the pipeline's arguments (:meth:`sampling_inputs`).
        """
        denoiser = getattr(pipeline, self.architecture.denoiser_subfolder)
        text = SampleText(embeddings, negative, denoiser.device, compute_dtype(denoiser))
        inputs = {**self.sampling_inputs(pipeline, text, settings), **self.control_inputs(list(settings.controls))}
        generator = torch.Generator(device="cpu").manual_seed(settings.seed)
        return pipeline(
            **inputs,
            height=settings.height,
            width=settings.width,
            num_inference_steps=settings.steps,
            generator=generator,
            output_type="pil",
        ).images[0]

    @abstractmethod
    def sampling_inputs(self, pipeline: Any, text: SampleText, settings: SampleSettings) -> dict[str, Any]:
        """The pipeline's arguments for one prompt besides the image size, the steps and the seed: the prompt's (and the
        negative's, where the family guides with one) cached embeddings as the pipeline takes them, where its denoiser
        runs (:meth:`SampleText.to_denoiser`), and the guidance as the pipeline takes it (``guidance_scale``...). Raises
        for a guidance that needs a negative it did not get."""

    def control_inputs(self, images: list[Any]) -> dict[str, Any]:
        """The pipeline's arguments for a sample's control images (PIL, in order, each of the sample's size), so that
        the pipeline takes them at that size: an edit family's ``image=...`` and what keeps its pipeline from resizing
        them. None for no images; a text-to-image family takes none."""
        if images:
            raise ConfigError(f"SampleImages controls: the {self.name} family takes no control images; remove them.")
        return {}

    # -- interop: LoRA files (lightning_lora.formats, lightning_lora.export) ------------------------------------------
    def lora_layout(self, format: str) -> LoraLayout:
        """The layout of ``format`` this family writes (one of ``lora_files.layouts``: a layout module's code bound to
        the family's names); :meth:`format_refused` for a format it does not write."""
        for layout in self.lora_files.layouts:
            if layout.format == format:
                return layout
        raise self.format_refused(format)

    def lora_coverage(self, format: str, variants: Mapping[str, str]) -> Coverage:
        """Which layers of a LoRA file of ``format`` each loader (diffusers, ComfyUI, kohya's sd-scripts) applies, for
        a file whose layers (diffusers names) have these ``variants``: the loaders' rules for this family's files
        (:mod:`lightning_lora.formats.clients`). Default: none known but diffusers' for its own layout."""
        from lightning_lora.formats.clients import rules_unknown

        return rules_unknown(self.name, format, variants)

    def file_coverage(self, format: str, adapters: Mapping[str, Adapter]) -> Coverage:
        """:meth:`lora_coverage` for the file of these ``adapters`` (diffusers names -> their tensors): by default what
        their variants decide; a family whose loaders also depend on the layers' widths checks those too (FLUX's
        kohya files in diffusers, :meth:`lightning_lora.families.Flux.file_coverage`)."""
        return self.lora_coverage(format, {module: adapter.variant for module, adapter in adapters.items()})

    def format_refused(self, format: str) -> ConfigError:
        """The error for a LoRA file ``format`` this family does not write; it names the formats it does write."""
        instead = " or ".join(f"--format {f}" for f in self.lora_files.formats)
        return ConfigError(
            f"--format {format}: there is no {format} layout for the {self.name!r} family yet; use {instead}."
        )

    # -- recognising LoRA files made elsewhere (lightning_lora.export.read_lora_file) ----------------------------------
    @classmethod
    def claims_lora_metadata(cls, metadata: Mapping[str, str]) -> int:
        """How specifically the header of a LoRA file names this family: the length of the longest of its
        ``lora_files.markers`` found in kohya's ``ss_base_model_version`` or ModelSpec's ``modelspec.architecture``, 0
        for none. The longest wins, so FLUX.2's ``flux-2`` outranks FLUX.1's ``flux``, which it contains."""
        named = metadata.get("ss_base_model_version", "") + " " + metadata.get("modelspec.architecture", "")
        return max((len(marker) for marker in cls.lora_files.markers if marker in named), default=0)

    @classmethod
    def claims_lora_keys(cls, tensors: Mapping[str, torch.Tensor]) -> int:
        """How surely the tensors of a LoRA file (their module names in any layout, their shapes) are this family's: 2
        for names or widths only this family's model has, 1 for names it shares with another family's (taken when no
        family claims 2), 0 for none of its own. Default 0: such files are known by their metadata or ``--family``."""
        return 0

    # -- tests and the demo ----------------------------------------------------------------------------------------
    @classmethod
    def save_tiny(cls, folder: Path, seed: int = 0) -> Path:
        """Save a tiny random pipeline of this family (a few MB, built from a config, offline) to ``folder`` and return
        it: what the CPU demo trains and what the family contract test (tests/families/test_contract.py) runs every
        registered family on. See :mod:`lightning_lora.tiny`."""
        raise NotImplementedError(f"the {cls.name} family has no tiny pipeline for tests yet")

    @classmethod
    def random_models(cls) -> RandomModels:
        """What the benchmark (``tools/bench.py``) builds for this family with random weights, at the real size and
        tiny (:class:`~lightning_lora.families.facts.RandomModels`, kept beside the family's tiny pipeline in
        :mod:`lightning_lora.tiny`). The family contract test asks every registered family for it."""
        raise NotImplementedError(f"the {cls.name} family has no random models for the benchmark yet")

    # -- memory planning (lightning_lora.plan) -------------------------------------------------------------------
    def denoiser_config(self, source: ModelSource, load_config: Callable[..., Any]) -> dict[str, Any]:
        """The denoiser's config, with no weights read: a local folder's ``<denoiser_subfolder>/config.json``; for a hub
        id the shipped facts (``planning.known_denoisers``) when it is a known model, else the hub's file (downloaded or
        cached). Offline without it: a :class:`ConfigError` saying which few-KB files to download."""
        if not source.is_local and source.pretrained in self.planning.known_denoisers:
            return dict(self.planning.known_denoisers[source.pretrained])
        try:
            return dict(load_component(load_config, source, self.architecture.denoiser_subfolder))
        except ConfigError:
            if source.is_local:
                raise
            raise ConfigError(
                f"model.pretrained: the architecture of {source.pretrained!r} is not known offline, and its config "
                "could not be read. Download its configs (a few KB, no weights): hf download "
                f"{source.pretrained} --include '*.json', or point model.pretrained at a local folder."
            ) from None

    def text_encoder_configs(self, source: ModelSource) -> dict[str, dict[str, Any]] | None:
        """The configs of the text encoders the cache loads (``architecture.text_encoders``), with no weights read: a
        local folder's ``<component>/config.json``, else the shipped facts of a known hub id; None when unknown."""
        if source.is_local:
            configs = {}
            for component in self.architecture.text_encoders:
                path = Path(source.local_path) / component / "config.json"
                try:
                    config = json.loads(path.read_text())
                except (OSError, json.JSONDecodeError):
                    return None
                configs[component] = {"_class": (config.get("architectures") or [""])[0], **config}
            return configs
        known = self.planning.known_text_encoders.get(source.pretrained)
        return None if known is None else {component: dict(config) for component, config in known.items()}

    def vae_config_for(self, source: ModelSource) -> dict[str, Any] | None:
        """The VAE's config, with no weights read and no download: a local folder's ``vae/config.json``, else the
        family's ``planning.vae_architecture``; None for a family that declares no VAE architecture."""
        if self.planning.vae_architecture is None:
            return None
        if source.is_local:
            with contextlib.suppress(OSError, json.JSONDecodeError):
                return dict(json.loads((Path(source.local_path) / "vae" / "config.json").read_text()))
        return dict(self.planning.vae_architecture)

    def sampling_vae_dtype(self, vae_config: dict[str, Any], dtype: torch.dtype) -> torch.dtype:
        """The dtype the family's pipeline decodes in, for a VAE loaded in ``dtype`` (the load dtype; SDXL's pipeline
        upcasts a float16 VAE whose config says ``force_upcast``)."""
        return dtype

    def sampling_latent_shape(self, vae_config: dict[str, Any], height: int, width: int) -> tuple[int, ...]:
        """The shape of the latents the family's pipeline decodes for one ``height x width`` sample image (the planner
        measures that decode): ``[1, latent_channels, H/s, W/s]`` for an image VAE, ``s`` its downscale (2x per level
        after the first of ``block_out_channels``). A video VAE's family adds the frame axis."""
        scale = 2 ** (len(vae_config["block_out_channels"]) - 1)
        return (1, vae_config["latent_channels"], height // scale, width // scale)

    def denoiser_skeleton(self, source: ModelSource) -> nn.Module:
        """The denoiser built from its config on the ``meta`` device: real shapes, no memory, no weights."""
        cls = self.denoiser_cls()
        return build_from_config(cls, self.denoiser_config(source, cls.load_config), source.dtype)

    # -- cached batches without data (tools/bench.py) -------------------------------------------------------------
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
        """A batch as the latent cache serves it to the training step, random values of the cached shapes and dtypes:
        ``batch`` images of ``height x width`` pixels (``latents`` as :meth:`encode_images` returns them, float32, and
        their size conditioning), ``controls`` control images of the same size each (``controls [B, N, C, h, w]``, an
        edit family's) and prompts of ``text_len`` tokens (:meth:`example_text`), for the denoiser of ``config`` (its
        ``config.json``). What the benchmark trains on with no data and no encoders."""
        shape = self.cached_latent_shape(config, height, width)
        latents = torch.randn(batch, *shape, generator=generator)
        size = torch.tensor([height, width]).expand(batch, 2)
        example = {
            "latents": latents,
            **self.example_text(config, batch, text_len, generator),
            "original_size": size,
            "crop_top_left": torch.zeros(batch, 2, dtype=torch.int64),
            "target_size": size,
        }
        if controls:
            example["controls"] = torch.randn(batch, controls, *shape, generator=generator)
        return example

    def cached_latent_shape(self, config: Mapping[str, Any], height: int, width: int) -> tuple[int, int, int]:
        """The shape of one image's cached latents (:meth:`encode_images`), ``[C, h, w]``, for the denoiser of
        ``config``. Default: its ``in_channels`` at an eighth of the image's sides (the VAE's downscale)."""
        return (config["in_channels"], height // 8, width // 8)

    def example_text(
        self, config: Mapping[str, Any], batch: int, text_len: int, generator: torch.Generator | None = None
    ) -> dict[str, torch.Tensor]:
        """Random cached prompt embeddings of ``batch`` prompts of ``text_len`` tokens, as :meth:`encode_prompts` gives
        them to the text cache (bf16), for the denoiser of ``config``."""
        raise NotImplementedError(f"the {self.name} family describes no cached text")

    @classmethod
    def text_length_options(cls, text_len: int) -> tuple[dict[str, Any], int]:
        """The family's options for prompts of ``text_len`` tokens, and the text length the denoiser then sees.
        Default: a fixed length, CLIP's 77 (no option changes it)."""
        return {}, 77

    def example_inputs(
        self, model: DiffusersModel, batch: int, height: int, width: int, text_len: int, device: str, dtype: torch.dtype
    ) -> dict[str, Any]:
        """Keyword arguments of one forward pass of ``model`` at this image size, batch and text length."""
        raise NotImplementedError(f"the memory planner does not support the {self.name} family yet")

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
        """:meth:`example_inputs` with ``controls`` control images of the target's size per sample, as an edit
        family's loss and pipeline give them to the denoiser (their tokens appended to the image's: a 1024² target with
        one 1024² reference is twice the image tokens). A family that takes none plans without them."""
        if controls and not self.editing.takes_controls:
            raise ConfigError(f"data.images: the {self.name} family takes no control images; remove controls.")
        return self.example_inputs(model, batch, height, width, text_len, device, dtype)

    def block_count(self, model: DiffusersModel) -> int:
        """Number of repeated blocks (the unit of gradient checkpointing)."""
        raise NotImplementedError(f"the memory planner does not support the {self.name} family yet")

    def sampling_bytes(self, model: DiffusersModel, height: int, width: int, text_len: int) -> float:
        """Activation bytes of one inference forward pass (plus the VAE decode) at this size: a hand estimate, used
        by the planner only for a family without ``planning.vae_architecture`` (else both are measured on the meta
        device: :func:`lightning_lora.plan.sampling.sampling_pieces`)."""
        raise NotImplementedError(f"the memory planner does not support the {self.name} family yet")

    # -- shared helpers ----------------------------------------------------------------------------------------
    def check_resolution(self, height: int, width: int, option: str) -> None:
        d = self.architecture.latent_divisor
        if height % d or width % d or height <= 0 or width <= 0:
            h, w = max(d, round(height / d) * d), max(d, round(width / d) * d)
            raise ConfigError(
                f"{option}: {height}x{width} is not a multiple of {d} pixels, which {self.name} needs "
                f"(VAE downscale x latent packing). Use {h}x{w}."
            )
