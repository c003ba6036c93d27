"""The LightningModule: a frozen diffusion backbone carrying a LoRA adapter.

Lifecycle (during ``fit`` Lightning calls these in this order):

* ``__init__`` only stores and validates options (cheap): it builds the
  :class:`~lightning_lora.model.recipe.ModelRecipe`, so a wrong path or an impossible combination fails here, before any
  weights load.
* ``configure_model`` loads the backbone and injects LoRA (:mod:`lightning_lora.model.assembly`). It runs before a
  checkpoint is restored and is idempotent, as Lightning requires.
* On a resume, ``on_load_checkpoint`` checks that every LoRA tensor is present with the right shape (the non-strict
  loading that a partial checkpoint needs would otherwise hide a missing or mismatched key).
* ``configure_optimizers`` builds the injected optimizer and scheduler over the *trainable* parameters only (the CLI
  runs with ``auto_configure_optimizers=False`` because its automatic optimizer would be built before
  ``configure_model``, over every parameter), and makes a restored checkpoint continue under this run's settings
  (:func:`lightning_lora.checkpoint.reconcile_training_state`).
* ``training_step`` takes the batch's per-sample noise and timesteps and asks the family for the loss. Batches
  come from the latent cache: no VAE or text encoder runs while training. With ``preservation.mode: dop`` the
  batch's preservation samples first get their target, the frozen base's own prediction with the adapter off
  (:meth:`preservation_reference`: one forward without gradients); per-sample loss weights (a folder's
  ``loss_weight``) and masks come with the batch (:mod:`lightning_lora.objectives`).
* Checkpoints hold only the trainable tensors: ``on_save_checkpoint`` drops the frozen base, and stamps what the base
  model is (:meth:`model_identity`) for a resume to compare, however its path is spelled then.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

import torch
from jsonargparse import lazy_instance
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_lora import objectives
from lightning_lora.checkpoint import STAMP, configured_record, reconcile_training_state
from lightning_lora.errors import ConfigError
from lightning_lora.families.base import DiffusionFamily, ModelSource
from lightning_lora.families.flux import Flux
from lightning_lora.hardware import limit_host_threads
from lightning_lora.lora import LoraOptions, adapters_disabled, set_lora_input_casts, trainable_parameters
from lightning_lora.model.assembly import build_lora_model, gradients_outside_graphs
from lightning_lora.model.parallel import prepare_model
from lightning_lora.model.recipe import AttentionBackend, ModelRecipe
from lightning_lora.model.training_adapter import distillation_note
from lightning_lora.objectives import Preservation, Reference
from lightning_lora.precision import BasePrecision, precision_of

__all__ = ["LoraModule", "lora_module", "primitive_hparams"]


def _default_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4, weight_decay=1e-4)


class LoraModule(LightningModule):
    """Train a LoRA adapter on a frozen diffusion model.

    Args:
        pretrained: hub id (``black-forest-labs/FLUX.1-dev``) or local diffusers folder.
        family: the model family and its objective options.
        denoiser_file: a single ``.safetensors`` file that replaces the transformer/UNet of ``pretrained`` (e.g. a
            ``flux1-dev.safetensors`` downloaded for ComfyUI).
        revision: hub revision of ``pretrained``.
        training_adapter: a LoRA file merged into the frozen base for training only, never exported: a
            de-distillation LoRA for a step-distilled base (Z-Image-Turbo, FLUX.1-schnell), so that the LoRA learns
            the subject, not to undo the distillation. The samples draw without it
            (:mod:`lightning_lora.model.training_adapter`).
        lora: LoRA rank, alpha, targets, dropout, init.
        preservation: keep what the base model draws where the LoRA should not change it: regularization images
            against their own target (``mode: prior``) or, with ``mode: dop``, preservation samples (regularization
            images; with ``every_image``, each image again with its trigger removed) against the base model's own
            prediction with the adapter off (one more forward without gradients per batch that holds them).
        gradient_checkpointing: recompute block activations in the backward pass (less memory, ~30% slower).
        checkpoint_every: with ``gradient_checkpointing``, recompute one in N repeated blocks (FLUX's transformer
            blocks, the UNet's attention blocks) and keep the others' activations: 1 (every block) saves the most;
            2 or 3 trade memory back for speed (``lightning-lora plan`` shows the peak for each).
        attention: attention kernel: ``auto`` (PyTorch SDPA's own choice: cuDNN's kernel on NVIDIA GPUs that have
            it, twice FlashAttention-2's speed on an H100 / H200), ``sdpa`` (the same, on every family), ``flash``,
            ``efficient``, ``cudnn``, ``math``, or ``xformers`` (CUDA, optional extra).
        compile_blocks: ``torch.compile`` each repeated transformer block (regional compilation): faster steps after
            a compile of a minute or two at the start.
        cuda_graphs: with ``compile_blocks``, replay each compiled block as a CUDA graph (``torch.compile``'s
            ``reduce-overhead`` mode): for steps bound by the host's CPU (the UNets on a fast GPU: ``sdxl_24gb`` 2.8x
            faster a step on an H100: BENCHMARKS.md, "CUDA graphs"); no gain where the GPU is the bound. One graph
            per image size, recorded at its first steps. Not with a sharding strategy (FSDP).
        offload_blocks: keep the frozen weights of this many repeated blocks (spread over the model) in CPU memory
            and copy each to the GPU while it runs; they are recomputed in the backward pass. Frees their weights'
            GPU memory (less two blocks in flight) for two copies per block and step: how FLUX in bf16 fits a 24 GB
            card (``lightning-lora plan`` shows the peak). bf16 / FP8 bases; not with NF4 or ``compile_blocks``.
        offload_activations: with ``gradient_checkpointing``, keep the inputs each checkpointed block saves for its
            recomputation in pinned CPU memory instead of on the GPU (copied out while the forward goes on, back
            when the backward reaches the block): FLUX at 512x768 keeps 0.67 GiB less on the GPU. Any base, NF4 too.
        memory: ``auto``: when ``fit`` starts, measure the GPU's free memory and take the fastest settings the memory
            planner says fit: less checkpointing and fewer copies to CPU memory than configured where there is room;
            where there is too little, gradient checkpointing, checkpointed inputs in CPU memory, an FP8 or NF4 base
            (the precision plugin), offloaded blocks (never a smaller batch or image: that would be another
            training). The choice is printed,
            written into the run's config.yaml and kept by a resume. A number: the same for that many GiB.
            ``as_configured``: the options as written.
        optimizer: built over the LoRA parameters only, e.g. ``torch.optim.AdamW`` or
            ``bitsandbytes.optim.AdamW8bit``. Default: AdamW, lr 1e-4, weight decay 1e-4.
        scheduler: optional learning-rate schedule, stepped every optimizer step, e.g.
            ``lightning_lora.schedules.CosineWithWarmup``.
    """

    def __init__(
        self,
        pretrained: str,
        family: DiffusionFamily = lazy_instance(Flux),
        denoiser_file: str | None = None,
        revision: str | None = None,
        training_adapter: str | None = None,
        lora: LoraOptions = LoraOptions(),
        preservation: Preservation = Preservation(),
        gradient_checkpointing: bool = False,
        checkpoint_every: int = 1,
        attention: AttentionBackend = "auto",
        compile_blocks: bool = False,
        cuda_graphs: bool = False,
        offload_blocks: int = 0,
        offload_activations: bool = False,
        memory: Literal["as_configured", "auto"] | float = "as_configured",
        optimizer: OptimizerCallable = _default_optimizer,
        scheduler: LRSchedulerCallable | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["optimizer", "scheduler"])
        source = ModelSource(pretrained, denoiser_file, revision, training_adapter=training_adapter)
        #: Everything that decides how the model is built, checked once (lightning_lora.model.recipe). The base format
        #: is the trainer's precision plugin: BF16 until ``fit`` starts (:meth:`use_precision`).
        self.recipe = ModelRecipe(
            family=family,
            source=source,
            lora=lora,
            preservation=preservation,
            gradient_checkpointing=gradient_checkpointing,
            checkpoint_every=checkpoint_every,
            attention=attention,
            compile_blocks=compile_blocks,
            cuda_graphs=cuda_graphs,
            offload_blocks=offload_blocks,
            offload_activations=offload_activations,
        )
        self.hparams["precision"] = self.recipe.precision.spec()
        if not isinstance(memory, str) and not (math.isfinite(memory) and memory > 0):
            raise ConfigError(f"model.memory: {memory} GiB must be positive (or auto, or as_configured).")
        self.memory = memory
        self.memory_settings: dict[str, Any] | None = None
        """What ``model.memory`` chose (:meth:`use_memory_settings`), kept in checkpoints for a resume."""
        self._optimizer_factory = optimizer
        self._scheduler_factory = scheduler
        self.denoiser: torch.nn.Module | None = None
        self._configured: tuple[dict[str, Any], list[Any], list[Any]] | None = None
        self._resume_checkpoint: dict[str, Any] | None = None
        self._host_threads: int | None = None  # torch's CPU threads before training limited them (on_train_start)
        self.resume_notes: list[str] = []
        """What a resume took from the config instead of the checkpoint, one line each (the start summary prints)."""
        self._model_identity: dict[str, str | None] | None = None
        # A partial checkpoint (LoRA only) must load into the full model; on_load_checkpoint does the strict check.
        self.strict_loading = False

    @property
    def family(self) -> DiffusionFamily:
        return self.recipe.family

    @property
    def source(self) -> ModelSource:
        return self.recipe.source

    @property
    def lora(self) -> LoraOptions:
        return self.recipe.lora

    @property
    def preservation(self) -> Preservation:
        return self.recipe.preservation

    def model_identity(self) -> dict[str, str | None]:
        """What the base model is (:meth:`ModelSource.model_identity`: its files, not its path), read once."""
        if self._model_identity is None:
            self._model_identity = self.source.model_identity()
        return self._model_identity

    def use_memory_settings(self, settings: dict[str, Any]) -> None:
        """Build with these memory settings (``model.memory``'s choice:
        :data:`~lightning_lora.model.recipe.MEMORY_SETTINGS` by name), before ``configure_model``; the hyper-parameters
        (and so checkpoints) say them too."""
        if self.denoiser is not None:
            raise RuntimeError("model.memory: the model is built already; choose its settings before fit")
        self.recipe = self.recipe.with_memory_settings(settings)
        self.memory_settings = dict(settings)
        for name in ("gradient_checkpointing", "checkpoint_every", "offload_activations", "offload_blocks"):
            self.hparams[name] = getattr(self.recipe, name)
        self.hparams["precision"] = self.recipe.precision.spec()

    def use_precision(self, precision: BasePrecision) -> None:
        """Build the base in ``precision``'s format (the trainer's plugin: ``fit`` calls this when it starts, and
        :meth:`setup` for a Trainer made in Python). A :class:`ConfigError` if the model options cannot go with it."""
        if precision is self.recipe.precision:
            return
        if self.denoiser is not None and precision != self.recipe.precision:
            raise RuntimeError(f"the model is built in {self.recipe.precision!r} already; {precision!r} comes too late")
        self.recipe = self.recipe.with_precision(precision)
        self.hparams["precision"] = precision.spec()

    @property
    def optimizer_name(self) -> str:
        """The class name of the optimizer this module builds (the memory planner sizes its state by it)."""
        from lightning_lora.plan import optimizer_name

        default = self._optimizer_factory is _default_optimizer
        return optimizer_name(torch.optim.AdamW if default else self._optimizer_factory)

    # -- model -------------------------------------------------------------------------------------------------
    @override
    def setup(self, stage: str) -> None:
        """Before any weight loads: take rank 0's ``model.memory`` choice (:meth:`_take_rank_zero_memory_choice`), the
        trainer's base format (a trainer precision that would cast the LoRA is refused), and autocast on the trainer's
        device; say once what training a step-distilled base without a training adapter does (one line)."""
        if self.memory != "as_configured" and self.trainer.world_size > 1:
            self._take_rank_zero_memory_choice()
        precision = precision_of(self.trainer)
        precision.bind(self.trainer.strategy.root_device)
        self.use_precision(precision)
        note = distillation_note(self.family, self.source)
        if note is not None:
            rank_zero_info(note)

    def _take_rank_zero_memory_choice(self) -> None:
        """Every rank builds what global rank 0's ``model.memory`` chose. ``fit`` chooses before the process group
        exists, each process from its own GPU's free memory: the ranks Lightning starts inherit rank 0's choice (an
        environment variable), but processes a cluster launcher starts (torchrun, SLURM) each choose their own, and
        ranks that build different models (another base format, other checkpointing) cannot train together. Here the
        group is up and nothing is built yet: rank 0's choice is broadcast, and a rank that chose otherwise takes it,
        its precision plugin included (the trainer runs that one)."""
        chosen = self.trainer.strategy.broadcast(self.memory_settings, src=0)
        if chosen is None or chosen == self.memory_settings:
            return
        self.use_memory_settings(chosen)
        self.hand_precision_to(self.trainer)

    def hand_precision_to(self, trainer: Trainer) -> None:
        """Make ``trainer`` run the recipe's base format: ``model.memory`` may have chosen another plugin than the
        configured one (:meth:`setup` then binds it to the trainer's device)."""
        if self.recipe.precision is not trainer.strategy.precision_plugin:
            trainer.strategy.precision_plugin = self.recipe.precision

    @override
    def configure_model(self) -> None:
        if self._trainer is None:
            self.build(torch.device("cpu"))
            return
        if self.denoiser is not None:  # idempotent, as Lightning requires
            return
        self.model_identity()  # read while the files are surely there; every checkpoint of the run records it
        denoiser = self.build(self.trainer.strategy.root_device)
        # Under autocast (every forward: training, samples, evaluation) the LoRA layers need no input casts.
        set_lora_input_casts(denoiser, enabled=not self.recipe.precision.autocasts)
        prepare_model(self.trainer.strategy, denoiser)  # trainer.strategy: fsdp shards it (model.parallel)

    def build(self, device: torch.device) -> torch.nn.Module:
        """Load the backbone on ``device`` and inject LoRA, once (``configure_model`` calls this with the trainer's
        device; a script without a Trainer can call it directly)."""
        if self.denoiser is not None:
            return self.denoiser
        self.denoiser = build_lora_model(self.recipe, device)
        return self.denoiser

    def _require_model(self) -> torch.nn.Module:
        if self.denoiser is None:
            raise RuntimeError("LoraModule.configure_model() has not run yet")
        return self.denoiser

    @override
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        if (
            self.recipe.cuda_graphs
        ):  # each micro-batch one generation of the graphs' memory (model.assembly.CUDA_GRAPHS_MODE)
            torch.compiler.cudagraph_mark_step_begin()
        latents = batch["latents"]
        # The datamodule draws them per sample (independent of rank count); other batches use the global RNG.
        noise = batch["noise"] if "noise" in batch else self.family.sample_noise(latents)
        timesteps = batch.get("timesteps")
        if timesteps is None:
            timesteps = _to_device(self.family.sample_timesteps(latents), latents.device)
        denoiser = self._require_model()
        reference = self.preservation_reference(batch, noise, timesteps)
        losses = self.family.loss(denoiser, batch, noise, timesteps, reference)
        loss = objectives.weighted_mean(losses, batch.get("loss_weight"))
        self.log("train/loss", loss, prog_bar=True, batch_size=latents.shape[0])
        self.log("train/lr", self.optimizers().param_groups[0]["lr"], batch_size=latents.shape[0])  # type: ignore[union-attr]
        return loss

    def preservation_reference(
        self, batch: dict[str, Any], noise: torch.Tensor, timesteps: torch.Tensor
    ) -> Reference | None:
        """DOP's target for the batch's preservation samples (``batch["role"]``,
        :func:`~lightning_lora.objectives.preserved_rows`): the frozen base's own prediction for the same noisy latents
        and captions with the adapter off (:func:`~lightning_lora.lora.adapters_disabled`), without gradients, for
        those rows only. None without ``preservation.mode: dop`` or without such samples in the batch. The roles are
        strings (the data loader leaves them on the host): choosing the rows waits for nothing on the GPU."""
        rows = objectives.preserved_rows(batch.get("role") or [], self.preservation.mode)
        if not rows:
            return None
        latents = batch["latents"]
        index = None
        if len(rows) < latents.shape[0]:
            index = _to_device(torch.tensor(rows), latents.device)
            batch = {k: v.index_select(0, index) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
            noise, timesteps = noise.index_select(0, index), timesteps.index_select(0, index)
        denoiser = self._require_model()
        with torch.no_grad(), adapters_disabled(denoiser):
            prediction = self.family.predict(denoiser, batch, noise, timesteps).prediction
        if self.recipe.cuda_graphs:  # the training forward replays other graphs: a new generation of their memory
            torch.compiler.cudagraph_mark_step_begin()
        return Reference(prediction, index)

    @torch.no_grad()
    def fixed_loss(
        self, batch: dict[str, torch.Tensor], generator: torch.Generator, denoiser: torch.nn.Module | None = None
    ) -> torch.Tensor:
        """The per-sample loss at (timestep, noise) pairs drawn from ``generator``: comparable across steps and runs.

        Draws on the CPU so the pairs are the same on any device, and never touches the global RNG (a fixed
        evaluation must not change the training run it observes). ``denoiser``: another model with this LoRA (the
        bf16 base of a quantized run); default the training model.
        """
        latents = batch["latents"]
        noise = torch.randn(latents.shape, generator=generator, dtype=torch.float32).to(latents.device)
        timesteps = self.family.sample_timesteps(latents, generator=generator).to(latents.device)
        return self.family.loss(denoiser if denoiser is not None else self._require_model(), batch, noise, timesteps)

    # -- optimization ------------------------------------------------------------------------------------------
    @override
    def configure_optimizers(self) -> Any:
        params = trainable_parameters(self._require_model())
        optimizer = _build("model.optimizer", self._optimizer_factory, params)
        scheduler = (
            None if self._scheduler_factory is None else _build("model.scheduler", self._scheduler_factory, optimizer)
        )
        if scheduler is not None and getattr(scheduler, "total_steps", 0) is None:
            # Sized from max_steps, not trainer.estimated_stepping_batches (LT#20550: reading that here skips the
            # restore of the dataloader state on resume).
            if self.trainer.max_steps is None or self.trainer.max_steps < 1:
                raise ConfigError(
                    "model.scheduler: total_steps is null, which means trainer.max_steps, but trainer.max_steps is not "
                    "set. Set trainer.max_steps (the run length in optimizer steps) or the scheduler's total_steps."
                )
            scheduler.total_steps = self.trainer.max_steps
        schedulers = [] if scheduler is None else [scheduler]
        # What the config asked for, before a checkpoint is restored into these objects (see checkpoint.py).
        self._configured = (configured_record([optimizer], schedulers), [optimizer], schedulers)
        if self._resume_checkpoint is not None:
            self._reconcile(self._resume_checkpoint)
        if scheduler is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1}}

    def _reconcile(self, checkpoint: dict[str, Any]) -> None:
        """Take the settings this run's config changed since ``checkpoint`` was written (learning rate, a longer
        ``trainer.max_steps``...) from the config; keep the rest of the optimizer and scheduler state."""
        assert self._configured is not None
        record, optimizers, schedulers = self._configured
        self.resume_notes = reconcile_training_state(checkpoint, optimizers, schedulers, record)
        self._resume_checkpoint = None

    # -- checkpoints -------------------------------------------------------------------------------------------
    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        names = {f"denoiser.{n}" for n, p in self._require_model().named_parameters() if p.requires_grad}
        return {k: v for k, v in self.state_dict().items() if k in names}

    # -- the host -----------------------------------------------------------------------------------------------
    @override
    def on_train_start(self) -> None:
        """On a GPU, one thread for torch's CPU operators while training (:func:`lightning_lora.hardware.
        limit_host_threads`: the pool's idle threads spin on the cores the two threads driving the GPU need). With
        ``cuda_graphs`` the LoRA's gradients are allocated now, outside the graphs' memory
        (:func:`~lightning_lora.model.assembly.gradients_outside_graphs`)."""
        self._host_threads = limit_host_threads(self.device.type)
        if self.recipe.cuda_graphs:
            gradients_outside_graphs(trainable_parameters(self._require_model()))

    @override
    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: torch.optim.Optimizer) -> None:
        """Gradients set to ``None`` between optimizer steps (torch's default), or zeroed in place with
        ``cuda_graphs``: kept outside the graphs' memory
        (:func:`~lightning_lora.model.assembly.gradients_outside_graphs`)."""
        optimizer.zero_grad(set_to_none=not self.recipe.cuda_graphs)

    @override
    def on_train_end(self) -> None:
        if self._host_threads is not None:
            torch.set_num_threads(self._host_threads)
            self._host_threads = None

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        trainable = {n for n, p in self.named_parameters() if p.requires_grad}
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in trainable}
        checkpoint["hyper_parameters"] = primitive_hparams(checkpoint.get("hyper_parameters", {}))
        if self._configured is not None:
            checkpoint.setdefault(STAMP, {})["configured"] = self._configured[0]
        if self.memory_settings is not None:
            checkpoint.setdefault(STAMP, {})["memory"] = dict(self.memory_settings)
        checkpoint.setdefault(STAMP, {})["model"] = self.model_identity()

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Lightning restores the optimizer and scheduler from this same dict later; configure_optimizers (which runs
        # in between, except under strategies that restore after set-up) reconciles their settings with the config.
        if self._configured is not None:
            self._reconcile(checkpoint)
        else:
            self._resume_checkpoint = checkpoint
        expected = {n: tuple(p.shape) for n, p in self.named_parameters() if p.requires_grad}
        saved = checkpoint.get("state_dict", {})
        missing = sorted(set(expected) - set(saved))
        unexpected = sorted(k for k in saved if k not in expected)
        wrong = sorted(k for k in expected if k in saved and tuple(saved[k].shape) != expected[k])
        if missing or unexpected or wrong:
            details = []
            if wrong:
                k = wrong[0]
                details.append(f"{len(wrong)} with another shape (e.g. {k}: {tuple(saved[k].shape)} vs {expected[k]})")
            if missing:
                details.append(f"{len(missing)} missing (e.g. {missing[0]})")
            if unexpected:
                details.append(f"{len(unexpected)} unexpected (e.g. {unexpected[0]})")
            raise ConfigError(
                "--ckpt_path: the checkpoint's LoRA tensors do not fit this model: " + "; ".join(details) + ". "
                "It was written with other model.lora.rank / model.lora.targets / model.pretrained settings: "
                "resume with the settings of that run, or start a new run folder."
            )


def lora_module(pl_module: LightningModule, user: str) -> LoraModule:
    """``pl_module`` as the :class:`LoraModule` that ``user`` (a callback) reads; a :class:`TypeError` for another
    module."""
    if not isinstance(pl_module, LoraModule):
        raise TypeError(f"{user} works with a lightning_lora LoraModule, not a {type(pl_module).__name__}")
    return pl_module


def _build(option: str, factory: Any, argument: Any) -> Any:
    """Call an injected optimizer / scheduler factory; the class's refusal of a setting names the option."""
    try:
        return factory(argument)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{option}: {e}. Fix {option}.init_args.") from None


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a small CPU tensor to the GPU without a stream synchronisation (a blocking copy would make the CPU wait
    for every queued kernel each step, and the GPU then idles while Python prepares the next one)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def primitive_hparams(value: Any) -> Any:
    """Hyper-parameters as plain containers, so checkpoints load with ``torch.load(weights_only=True)``."""
    if isinstance(value, dict):
        return {str(k): primitive_hparams(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [primitive_hparams(v) for v in value]
    if value is None or isinstance(value, str | int | float | bool):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return primitive_hparams(dataclasses.asdict(value))
    if isinstance(value, DiffusionFamily):
        cls = type(value)
        return {"class_path": f"{cls.__module__}.{cls.__qualname__}", "init_args": primitive_hparams(vars(value))}
    return str(value)
