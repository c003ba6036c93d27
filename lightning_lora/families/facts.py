"""What a family declares about its model, in four small groups: the facts, apart from the behaviour.

A :class:`~lightning_lora.families.base.DiffusionFamily` subclass declares four frozen dataclasses beside its methods,
one per part of lightning-lora that reads them (and an edit family a fifth, :class:`Editing`)::

    class Flux(DiffusionFamily):
        name = "flux"
        architecture = Architecture(pipeline_classes=("FluxPipeline",), denoiser_class="FluxTransformer2DModel", ...)
        compiling = Compiling(stream_sources=("x_embedder", "context_embedder"), ...)
        planning = Planning(known_denoisers={...}, vae_architecture=FLUX1_VAE)
        lora_files = LoraFiles(layouts=(DiffusersLayout("transformer"), KohyaLayout(...)), modelspec={...})

* :class:`Architecture`: the hub's facts (which pipeline folders it loads, the denoiser's class and subfolder, the text
  encoders) and what follows from the model's shapes (image sides, LoRA target presets): loading, the cache, the data;
* :class:`Compiling`: how ``model.compile_blocks`` and the attention backend treat the model (:mod:`.model.assembly`);
* :class:`Planning`: what the memory planner needs without a download (:mod:`lightning_lora.plan`);
* :class:`LoraFiles`: the LoRA files the family writes (the layouts of :mod:`lightning_lora.formats` it serves, bound to
  its names), who loads them, and how a file made elsewhere names the family (:mod:`lightning_lora.export`);
* :class:`Editing`: whether the model takes control / reference images beside the prompt (FLUX.1 Kontext, FLUX.2,
  Qwen-Image-Edit), how many, and whether its prompt encoder sees them: the data, the cache and the samples;
* :class:`RandomModels`: what the benchmark (``tools/bench.py``) builds with random weights, at the real size and tiny
  (``DiffusionFamily.random_models``, beside the family's tiny pipeline in :mod:`lightning_lora.tiny`).

A subclass that shares most of its parent's facts replaces what differs (``dataclasses.replace(UNetFamily.compiling,
stream_sources=...)``). This module imports nothing heavy.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_lora.formats import LoraFormat, LoraLayout

__all__ = ["Architecture", "Compiling", "Editing", "LoraFiles", "Planning", "RandomModels"]


@dataclass(frozen=True)
class Architecture:
    """The model as the hub ships it, and what its shapes decide."""

    pipeline_classes: tuple[str, ...]
    """``_class_name`` values of ``model_index.json`` the family can load."""
    denoiser_class: str
    """The denoiser's diffusers class, by name (``FluxTransformer2DModel``): loading, single files, the planner."""
    denoiser_subfolder: str
    """The denoiser's folder in the pipeline (``transformer``, ``unet``): loading, and the prefix of its LoRA keys."""
    text_encoders: tuple[str, ...]
    """The pipeline components (subfolders) whose weights the prompt embeddings depend on: every one the family's
    ``encode_prompts`` runs. The text cache key is made from their identities, so a changed encoder never serves
    stale embeddings; a family that forgets one would."""
    latent_divisor: int
    """Image sides must be multiples of this many pixels (VAE downscale x latent patch size)."""
    lora_presets: Mapping[str, str]
    """Named LoRA target sets: preset name -> regular expression over module names (peft ``target_modules``)."""
    step_distilled: Mapping[str, str] = field(default_factory=dict)
    """The hub ids of the family's step-distilled models (a few steps, no guidance), each with the undistilled model to
    train instead ("" where there is none): a LoRA trained on a distilled base directly pulls it off its distillation,
    so ``fit`` says once what to do when no ``model.training_adapter`` is given
    (:func:`lightning_lora.model.training_adapter.distillation_note`)."""

    @property
    def tokenizers(self) -> tuple[str, ...]:
        """The tokenizer components beside :attr:`text_encoders` (``text_encoder_2`` -> ``tokenizer_2``, diffusers'
        layout): their files (vocabulary, chat template) shape the embeddings too, so the text cache key covers them."""
        return tuple(c.replace("text_encoder", "tokenizer", 1) for c in self.text_encoders)


@dataclass(frozen=True)
class Compiling:
    """How ``model.compile_blocks``, gradient checkpointing and ``model.attention: auto`` treat the denoiser."""

    regions: tuple[str, ...] = ()
    """Module classes ``model.compile_blocks`` compiles besides the model's repeated blocks (``_repeated_blocks``)."""
    stream_sources: tuple[str, ...] = ()
    """The modules whose outputs feed the first repeated block (a container: each module in it), e.g. FLUX's image and
    text embedders, or the UNets' first attention's ``proj_in``. Under ``model.compile_blocks`` their outputs are made
    to require gradients while training, as every later block's inputs do, so that dynamo compiles one graph for the
    first block and the rest, not two (it guards on ``requires_grad``): a quarter of FLUX's graphs and a third of the
    UNets' (with the ``attention`` preset) less to compile and to trace again at each start (BENCHMARKS.md). The
    price is the first block's input gradient, one block's worth of input-gradient matmuls. Where the module is itself
    trained (a LoRA on ``proj_in``), its output has a gradient already and nothing changes."""
    joined_streams: tuple[str, ...] = ()
    """Containers of repeated blocks whose last block hands its two streams ``(text, image)`` to blocks that pass
    them to each other as slices of one tensor (FLUX's double-stream blocks, before its single-stream ones). Under
    ``model.compile_blocks`` that last block's outputs come in the same layout, so that dynamo, which guards on
    strides, compiles one graph for the first single-stream block and the rest, not two."""
    checkpoints_only_repeated_blocks: bool = True
    """Whether diffusers' gradient checkpointing of the denoiser recomputes exactly its repeated blocks
    (``_repeated_blocks``: FLUX's double and single blocks, Z-Image's refiners and layers), so that checkpointing
    inside each of those blocks is the same checkpointing. Compiled blocks are checkpointed that way
    (:func:`lightning_lora.model.assembly.apply_gradient_checkpointing`); the UNets' checkpointing also recomputes their
    ResNets, which are no repeated blocks."""
    checkpoints_in_blocks: bool = False
    """Whether ``gradient_checkpointing`` checkpoints inside each repeated block always, as compiled blocks are, never
    through diffusers' own checkpointing: for a model whose own checkpointing runs a block otherwise than its forward
    does (diffusers 0.42's ``ChromaTransformer2DModel`` calls its single blocks without the attention mask then)."""
    cudnn_attention_in_auto: bool = True
    """Whether ``model.attention: auto`` may use PyTorch's cuDNN SDPA backend with this family's model."""


@dataclass(frozen=True)
class Planning:
    """What the memory planner reads besides the model's own config files."""

    known_denoisers: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """The denoiser's ``config.json`` (the fields that decide its shapes) for the hub ids the shipped configs use: the
    memory planner needs no download for them (``DiffusionFamily.denoiser_config``)."""
    known_text_encoders: Mapping[str, Mapping[str, Mapping[str, Any]]] = field(default_factory=dict)
    """The text encoders' configs (:mod:`lightning_lora.families.encoders`) for the same hub ids, by component."""
    vae_architecture: Mapping[str, Any] | None = None
    """The ``vae/config.json`` of the family's models (the fields that decide shapes: fine-tunes keep the VAE's
    architecture): the planner measures the sample images' decode from it (``DiffusionFamily.vae_config_for``); a
    family without it plans sampling with ``DiffusionFamily.sampling_bytes`` alone."""
    sampling_batch: int = 1
    """The denoiser's batch per sample image: 2 where the pipeline runs classifier-free guidance as one batch (the
    prompt and the negative, SDXL and SD1.5); 1 for guidance-distilled models (FLUX.1-dev)."""
    compiled_saved_fraction: float = 0.72
    """The share of the eager forward's saved tensors that blocks compiled by ``model.compile_blocks`` keep for the
    backward (inductor fuses elementwise chains and recomputes them): the planner scales the eager count it makes on
    the meta device by it, for blocks that are not checkpointed. 0.72: calibrated on the two compiled FLUX rank-16 rows
    without checkpointing (bf16 and NF4, on an H200: 0.78 of the eager count as it was then made, without autocast
    and with rms_norm decomposed; 0.72 of the count made as the GPU runs)."""


@dataclass(frozen=True)
class LoraFiles:
    """The LoRA files of the family: the layouts it writes, who loads them, what they say about the model."""

    layouts: tuple[LoraLayout, ...] = ()
    """The LoRA file layouts this family writes, in the order a training run writes them by default: each a layout
    module's object bound to the family's names (``DiffusersLayout("transformer")``, a ``KohyaLayout`` with the
    family's kohya names, network and reader: :mod:`lightning_lora.formats`)."""
    tools: tuple[str, ...] = ("diffusers", "ComfyUI", "kohya")
    """The tools (:data:`lightning_lora.formats.clients.TOOLS`) that load LoRAs of this family at all. A run warns about
    trained layers a listed tool will not apply; a tool left out (kohya's sd-scripts has no network for the newer
    families) is said once in the log instead of warning on every run."""
    modelspec: Mapping[str, str] = field(default_factory=dict)
    """``modelspec.*`` entries every LoRA file of this family carries (``architecture``, ``implementation``: the IDs
    kohya's sd-scripts writes, ``library/sai_model_spec.py``); empty: no ModelSpec."""
    markers: tuple[str, ...] = ()
    """Text that names this family in the header of a LoRA file made elsewhere: in kohya's ``ss_base_model_version``
    or ModelSpec's ``modelspec.architecture`` (``DiffusionFamily.claims_lora_metadata``)."""

    @property
    def formats(self) -> tuple[LoraFormat, ...]:
        """The names of :attr:`layouts` (:data:`lightning_lora.formats.FORMATS`), in their order."""
        return tuple(layout.format for layout in self.layouts)


@dataclass(frozen=True)
class Editing:
    """The control / reference images a model takes beside its prompt (``data.images[].controls``). A text-to-image
    family takes none (the default)."""

    max_controls: int | None = 0
    """How many control images one target may have: 0 for a text-to-image model, None for no limit of the model's
    (FLUX.2 and Qwen-Image-Edit-Plus take several, in order)."""
    needs_controls: bool = False
    """Whether every item needs its controls (Qwen-Image-Edit's prompt template holds one image): a folder without
    ``controls`` is refused. False: items without controls train text-to-image, as the pipeline draws without an
    image."""
    prompt_sees_controls: bool = False
    """Whether the prompt's embeddings depend on the control images (Qwen-Image-Edit's vision-language encoder reads
    them): the text cache keys each (caption, controls) pair, and the empty prompt of caption dropout is encoded with
    each pair's controls. False: a caption is encoded once, whatever it edits."""

    @property
    def takes_controls(self) -> bool:
        return self.max_controls is None or self.max_controls > 0


@dataclass(frozen=True)
class RandomModels:
    """What the benchmark (``tools/bench.py``) builds for the family with random weights, without a download: the
    denoiser of a released model's size (or a tiny one for CPU runs), and for its sample images a VAE and the released
    scheduler. The real VAE is ``planning.vae_architecture``."""

    denoiser: str
    """The hub id in ``planning.known_denoisers`` whose config the benchmark builds by default."""
    tiny_denoiser: Mapping[str, Any]
    """What the tiny denoiser (``--tiny``) changes in that config: a few blocks of a few narrow heads."""
    tiny_vae: Mapping[str, Any]
    """What the tiny VAE changes in ``planning.vae_architecture``: its latent channels are the tiny denoiser's."""
    scheduler: str
    """The released model's scheduler, by diffusers class name (``FlowMatchEulerDiscreteScheduler``)."""
    scheduler_config: Mapping[str, Any]
    """Its ``scheduler/scheduler_config.json`` (the tiny pipeline's copy of it)."""
