"""A fixed evaluation: the same images, prompts, timesteps and noise every time, so the curves are comparable.

The training loss of a diffusion model is very noisy (each step draws a new timestep and new noise), which makes it
a poor signal of progress. This callback evaluates at (timestep, noise) pairs drawn from a generator seeded the same
way every time, before training, every N steps and at the end:

* ``eval/loss`` on the first few training images (``data.eval_samples``): is the LoRA learning?
* ``val/loss`` on the held-out images (``data.val_images`` / ``data.val_fraction``), when there are any: is it
  still generalising, or memorising the training set?
* ``eval/drift``, the bleed: on prompts *without* the trigger (``drift_prompts``, by default the family's
  ``drift_prompts``), paired with the evaluation images' latents, the mean squared difference between the prediction
  of the model with the LoRA and without it (peft's adapter turned off: the frozen base), per element. It is 0 before
  the first step (``lora_B`` starts at zero) and grows as far as the LoRA changes what the model does for prompts it
  was not trained on: the "identity bleeding into other prompts" users judge by eye. The base's predictions are the
  same at every evaluation (the base is frozen): they are computed once per fit.
* with a :class:`~lightning_lora.callbacks.ema.LoraEMA`, each of them again with the EMA of the LoRA
  (``eval/loss_ema``, ``val/loss_ema``, ``eval/drift_ema``).

They are logged to TensorBoard and, at the end, beside the run's options in its HParams table (``hp/eval_loss``,
``hp/eval_drift``...: :class:`~lightning_lora.callbacks.monitor.ConfigSummary`).

**The best LoRA and early stopping.** ``monitor`` names the metric that judges the LoRA (by default ``val/loss`` with
held-out images, else ``eval/loss``; lower is better). The evaluations at step 0 and every ``every_n_steps`` steps
(without ``every_n_steps``: at the end) count; the step of the best is :attr:`FixedEvalLoss.best_step`, and
:class:`~lightning_lora.callbacks.lora_export.LoraExport` with ``best: true`` writes ``<name>.best.safetensors`` then
(in every layout it writes; the EMA weights for an ``*_ema`` metric). With ``patience``, a run whose metric has not
improved by ``min_delta`` for that many counted evaluations stops (``trainer.should_stop``). The best value, its step
and the count are in every checkpoint, so a resumed run judges as the uninterrupted one did (an evaluation at another
step, such as the end of a run stopped early by ``--trainer.max_steps``, is logged but judges nothing: with
``every_n_steps``, make ``trainer.max_steps`` a multiple of it for the last steps to be judged).

**A LoRA trained on a quantized base, checked on the base people run.** When the base trained in FP8 or NF4 (the
trainer's precision plugin), the end of the run also measures ``eval/loss`` with the LoRA on the bf16 base loaded
from the same files (``eval/loss_unquantized``) and prints both: a LoRA learns to correct its base's quantization
error, which the bf16 base people run does not have. The bf16 base is loaded beside the training model only where the
memory planner says it fits in the free memory; otherwise one line says so.

It draws from its own generator, never the global RNG, so observing a run does not change it; every callback that
needs an evaluation of the current step asks :meth:`FixedEvalLoss.evaluate_if_due`, so their order does not matter.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from typing import Any, Literal

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from torch import nn
from typing_extensions import override

from lightning_lora.callbacks.ema import LoraEMA, configured, lora_ema
from lightning_lora.data.datamodule import LatentDataModule
from lightning_lora.data.recipe import DEFAULT_RESOLUTION, data_recipe
from lightning_lora.errors import ConfigError, first_line
from lightning_lora.families.base import DiffusionFamily
from lightning_lora.lora import adapter_disabled
from lightning_lora.model.assembly import uncompiled
from lightning_lora.model.recipe import ModelRecipe
from lightning_lora.module import LoraModule, lora_module

__all__ = ["FixedEvalLoss", "Monitor", "denoiser_prediction", "drift_prompts", "fixed_evaluation", "with_prompt"]

log = logging.getLogger(__name__)

Monitor = Literal["auto", "eval/loss", "val/loss", "eval/drift", "eval/loss_ema", "val/loss_ema", "eval/drift_ema"]


class FixedEvalLoss(Callback):
    """Log ``eval/loss``, ``val/loss`` and ``eval/drift`` on fixed (image, prompt, timestep, noise) draws.

    Args:
        every_n_steps: evaluate every this many optimizer steps (0: only before and after training).
        seed: seed of the (timestep, noise) draws.
        drift_prompts: prompts without the trigger for ``eval/drift``; null: the family's own set; an empty list: no
            drift.
        monitor: the metric that judges the LoRA, lower is better: the best LoRA (``LoraExport.best``) and early
            stopping. ``auto``: ``val/loss`` with held-out images, else ``eval/loss``; the ``*_ema`` metrics need a
            ``LoraEMA`` callback.
        patience: stop training after this many counted evaluations without a new best ``monitor`` (0: never stop
            early); needs ``every_n_steps``.
        min_delta: an improvement of ``monitor`` smaller than this is no new best.
        check_bf16_base: when the base trains in FP8 or NF4, measure ``eval/loss`` on the bf16 base too at the end,
            where it fits in memory.
    """

    def __init__(
        self,
        every_n_steps: int = 0,
        seed: int = 1234,
        drift_prompts: list[str] | None = None,
        monitor: Monitor = "auto",
        patience: int = 0,
        min_delta: float = 0.0,
        check_bf16_base: bool = True,
    ) -> None:
        if patience < 0 or min_delta < 0:
            raise ConfigError(f"FixedEvalLoss: patience ({patience}) and min_delta ({min_delta}) must be 0 or more.")
        if patience and every_n_steps <= 0:
            raise ConfigError(
                f"FixedEvalLoss.patience: {patience} evaluations, but every_n_steps is {every_n_steps}: there is no "
                "evaluation before the end to stop at. Set every_n_steps (e.g. 100), or patience: 0."
            )
        self.every_n_steps = every_n_steps
        self.seed = seed
        self.drift_prompts = None if drift_prompts is None else list(drift_prompts)
        self.monitor: Monitor = monitor
        self.patience = patience
        self.min_delta = min_delta
        self.check_bf16_base = check_bf16_base
        self.history: list[tuple[int, float]] = []
        self.val_history: list[tuple[int, float]] = []
        self.metrics: dict[str, float] = {}
        """The metrics of the latest evaluation."""
        self.evaluated_step = -1
        self.watched: str = "eval/loss"
        """The metric ``monitor`` means for this run (resolved when the fit starts)."""
        self.best: float | None = None
        self.best_step: int | None = None
        self.wait = 0
        """Counted evaluations since the best."""
        self.stopped_early_at: int | None = None
        self._drift_texts: list[dict[str, torch.Tensor]] = []
        self._base_predictions: list[torch.Tensor] | None = None

    # -- set-up -------------------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Encode the drift prompts (through the text cache, before the model is built) and resolve ``monitor``."""
        if stage != "fit":
            return
        module = lora_module(pl_module, "FixedEvalLoss")
        datamodule = trainer.datamodule  # type: ignore[attr-defined]
        prompts = self.prompts_for(module.family)
        if prompts and module.family.editing.prompt_sees_controls:
            raise ConfigError(
                f"FixedEvalLoss drift_prompts: the {module.family.name} family reads a prompt only with its control "
                "images, so eval/drift has no trigger-free prompt to read; set drift_prompts: []."
            )
        self._base_predictions = None
        if isinstance(datamodule, LatentDataModule) and prompts:
            self._drift_texts = _encode(trainer, datamodule, prompts)
        has_val = isinstance(datamodule, LatentDataModule) and bool(datamodule.val_entries)
        has_ema = any(isinstance(cb, LoraEMA) for cb in trainer.callbacks)  # type: ignore[attr-defined]
        self.watched = self._resolve_monitor(has_val, has_ema)

    def prompts_for(self, family: DiffusionFamily) -> list[str]:
        """The drift prompts of a run of ``family``: this callback's, or the family's when unset."""
        return list(self.drift_prompts) if self.drift_prompts is not None else list(family.drift_prompts)

    def _resolve_monitor(self, has_val: bool, has_ema: bool) -> str:
        if self.monitor == "auto":
            return "val/loss" if has_val else "eval/loss"
        option = f"FixedEvalLoss.monitor: {self.monitor}"
        if self.monitor.endswith("_ema") and not has_ema:
            raise ConfigError(f"{option} needs a LoraEMA callback in trainer.callbacks (or monitor the raw weights).")
        if self.monitor.startswith("val/") and not has_val:
            raise ConfigError(f"{option} needs held-out images: set data.val_images or data.val_fraction.")
        if self.monitor.startswith("eval/drift") and not self._drift_texts:
            raise ConfigError(f"{option} needs drift prompts: leave drift_prompts unset (the family's) or give some.")
        return self.monitor

    # -- measuring ----------------------------------------------------------------------------------------------
    def measure(
        self, trainer: Trainer, module: LoraModule, denoiser: nn.Module | None = None, drift: bool = True
    ) -> dict[str, float]:
        """``eval/loss``, ``val/loss`` (with held-out images) and ``eval/drift`` (with drift prompts) of the model as
        it is now (``denoiser``: another model with the same LoRA)."""
        datamodule = trainer.datamodule  # type: ignore[attr-defined]
        if not isinstance(datamodule, LatentDataModule):
            raise TypeError(f"FixedEvalLoss reads a LatentDataModule's fixed loaders, not {type(datamodule).__name__}")
        model = denoiser if denoiser is not None else module.denoiser
        assert model is not None  # built in configure_model, before training starts
        with fixed_evaluation(trainer, model):
            metrics = {"eval/loss": self._mean_loss(module, model, datamodule.eval_dataloader())}
            val_loader = datamodule.val_dataloader_fixed()
            if val_loader is not None:
                metrics["val/loss"] = self._mean_loss(module, model, val_loader)
            if drift and self._drift_texts:
                metrics["eval/drift"] = self._drift(module, model, datamodule)
        return metrics

    def _mean_loss(self, module: LoraModule, denoiser: nn.Module, loader: Any) -> float:
        generator = torch.Generator().manual_seed(self.seed)
        total, count = 0.0, 0
        for batch in loader:
            losses = module.fixed_loss(_on(batch, module.device), generator, denoiser)
            total += float(losses.sum())
            count += losses.numel()
        return total / max(count, 1)

    def _drift(self, module: LoraModule, denoiser: nn.Module, datamodule: LatentDataModule) -> float:
        """The mean squared difference per element between the adapted and the adapter-off predictions, over the drift
        prompts, each with the latents of an evaluation batch (in turn) and its own fixed timestep and noise."""
        batches = [_on(b, module.device) for b in datamodule.eval_dataloader()]
        if not batches:
            return math.nan
        generator = torch.Generator().manual_seed(self.seed + 1)  # other draws than eval/loss's, the same each time
        fresh = self._base_predictions is None
        base: list[torch.Tensor] = [] if fresh else list(self._base_predictions or [])
        total, count = 0.0, 0
        for j, text in enumerate(self._drift_texts):
            batch = with_prompt(batches[j % len(batches)], text)
            latents, n = batch["latents"], batch["latents"].shape[0]
            noise = torch.randn(latents.shape, generator=generator, dtype=torch.float32).to(latents.device)
            timesteps = module.family.sample_timesteps(latents, generator=generator).to(latents.device)
            adapted = denoiser_prediction(module.family, denoiser, batch, noise, timesteps)
            if fresh:
                with adapter_disabled(denoiser):
                    base.append(denoiser_prediction(module.family, denoiser, batch, noise, timesteps))
            squared = (adapted - base[j]).square().reshape(n, -1).mean(dim=1)
            total += float(squared.sum())
            count += n
        if fresh and denoiser is module.denoiser:
            self._base_predictions = base
        return total / max(count, 1)

    # -- evaluating ---------------------------------------------------------------------------------------------
    def evaluate(self, trainer: Trainer, pl_module: LightningModule) -> float:
        """Measure and log every metric at the trainer's step (the EMA's too, with a ``LoraEMA``), judge the LoRA when
        the step counts; return ``eval/loss``."""
        module = lora_module(pl_module, "FixedEvalLoss")
        step = trainer.global_step
        metrics = self.measure(trainer, module)
        ema = lora_ema(trainer)
        if ema is not None:
            if ema.moved:
                with ema.applied():
                    averaged = self.measure(trainer, module)
            else:  # the EMA is still the raw weights
                averaged = dict(metrics)
            metrics.update({f"{k}_ema": v for k, v in averaged.items()})
        self.metrics, self.evaluated_step = metrics, step
        self.history.append((step, metrics["eval/loss"]))
        if "val/loss" in metrics:
            self.val_history.append((step, metrics["val/loss"]))
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
        if self._counts(trainer, step):
            self._judge(trainer, step, metrics)
        return metrics["eval/loss"]

    def _counts(self, trainer: Trainer, step: int) -> bool:
        """Whether the evaluation at ``step`` judges the LoRA: step 0 and every ``every_n_steps`` (without
        ``every_n_steps``, the end of the run too). Only these, so that a run stopped anywhere and resumed judges at the
        steps the uninterrupted run judged at (an evaluation at the end of a stopped run is in no checkpoint)."""
        if self.every_n_steps > 0:
            return step % self.every_n_steps == 0
        return step == 0 or (trainer.max_steps is not None and 0 < trainer.max_steps <= step)

    def _judge(self, trainer: Trainer, step: int, metrics: dict[str, float]) -> None:
        value = metrics.get(self.watched)
        if value is None or math.isnan(value):
            return
        if self.best is None or value < self.best - self.min_delta:
            self.best, self.best_step, self.wait = value, step, 0
            return
        self.wait += 1
        if self.patience and self.wait >= self.patience:
            self._stop(trainer, step)

    def _stop(self, trainer: Trainer, step: int) -> None:
        trainer.should_stop = True
        if self.stopped_early_at is None:
            self.stopped_early_at = step
            rank_zero_info(
                f"Early stopping at step {step}: {self.watched} has not improved on {self.best:.4f} (step "
                f"{self.best_step}) for {self.wait} evaluations (FixedEvalLoss.patience {self.patience})"
            )

    def evaluate_if_due(self, trainer: Trainer, pl_module: LightningModule, end: bool = False) -> None:
        """Evaluate the trainer's step if it is one to evaluate (step 0, every ``every_n_steps``, the end) and has not
        been yet: every callback that reads this step's evaluation calls this first."""
        step = trainer.global_step
        due = end or step == 0 or (self.every_n_steps > 0 and step % self.every_n_steps == 0)
        if due and self.evaluated_step != step:
            self.evaluate(trainer, pl_module)

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.evaluated_step != trainer.global_step:  # a resumed run has evaluated its step already
            self.evaluate(trainer, pl_module)
        if self.patience and self.wait >= self.patience:  # resumed at the step it stopped at: stop again
            self._stop(trainer, trainer.global_step)

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        self.evaluate_if_due(trainer, pl_module)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.evaluate_if_due(trainer, pl_module, end=True)
        (s0, first), (s1, last) = self.history[0], self.history[-1]
        rank_zero_info(f"Fixed evaluation loss: {first:.4f} at step {s0} -> {last:.4f} at step {s1}")
        if self.val_history:
            (s0, first), (s1, last) = self.val_history[0], self.val_history[-1]
            rank_zero_info(f"Held-out validation loss: {first:.4f} at step {s0} -> {last:.4f} at step {s1}")
        if self.check_bf16_base:
            self._check_bf16_base(trainer, lora_module(pl_module, "FixedEvalLoss"))

    # -- the bf16 base ------------------------------------------------------------------------------------------
    def _check_bf16_base(self, trainer: Trainer, module: LoraModule) -> None:
        """With a quantized training base, ``eval/loss`` with the LoRA on the bf16 base too, where it fits."""
        from lightning_lora.precision import BF16

        precision = module.recipe.precision
        if isinstance(precision, BF16) or "eval/loss" not in self.metrics:
            return
        name = type(precision).__name__
        recipe = module.recipe.with_precision(BF16(dtype=precision.dtype, skip=precision.skip)).replace(
            compile_blocks=False,
            cuda_graphs=False,
            gradient_checkpointing=False,
            offload_blocks=0,
            offload_activations=False,
        )
        data = data_recipe(trainer)
        room = bf16_room(recipe, module.device, data.resolution if data is not None else DEFAULT_RESOLUTION)
        if room is not None:
            rank_zero_info(f"Fixed evaluation loss on the bf16 base not measured: {room}")
            return
        from lightning_lora.model.assembly import build_lora_model

        other = build_lora_model(recipe, module.device).to(module.device)
        try:
            trained = dict(module.trainable_state_dict())
            with torch.no_grad():
                for n, p in other.named_parameters():
                    if p.requires_grad:
                        p.copy_(trained[f"denoiser.{n}"])
            loss = self.measure(trainer, module, other, drift=False)["eval/loss"]
        finally:
            del other
            if module.device.type == "cuda":
                torch.cuda.empty_cache()
        trained_on = self.metrics["eval/loss"]
        self.metrics["eval/loss_unquantized"] = loss
        for logger in trainer.loggers:
            logger.log_metrics({"eval/loss_unquantized": loss}, step=trainer.global_step)
        change = 100.0 * (loss - trained_on) / trained_on if trained_on else math.nan
        rank_zero_info(
            f"Fixed evaluation loss on the {name} base it trained on: {trained_on:.4f}; on the unquantized "
            f"{precision.dtype} base: {loss:.4f} ({change:+.1f}%)"
        )

    # -- checkpoints --------------------------------------------------------------------------------------------
    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "evaluated_step": self.evaluated_step,
            "history": [list(h) for h in self.history],
            "val_history": [list(h) for h in self.val_history],
            "watched": self.watched,
            "best": self.best,
            "best_step": self.best_step,
            "wait": self.wait,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.evaluated_step = int(state_dict.get("evaluated_step", -1))
        self.history = [(int(s), float(v)) for s, v in state_dict.get("history", [])]
        self.val_history = [(int(s), float(v)) for s, v in state_dict.get("val_history", [])]
        if state_dict.get("watched") == self.watched:  # judged on the same metric: carry on
            self.best, self.best_step = state_dict.get("best"), state_dict.get("best_step")
            self.wait = int(state_dict.get("wait", 0))


def bf16_room(recipe: ModelRecipe, device: torch.device, side: int = DEFAULT_RESOLUTION) -> str | None:
    """None when the bf16 base of ``recipe`` (its weights, and a forward without gradients at ``side`` pixels) fits in
    the free memory of ``device`` beside what is there now, as the memory planner sizes them; else why not, in a few
    words."""
    if device.type != "cuda":
        return None  # host memory: the planner plans GPUs; a CPU run is a tiny one
    from lightning_lora.plan import weight_bytes
    from lightning_lora.plan.estimate import GIB, denoiser_skeleton
    from lightning_lora.plan.sampling import sampling_pieces

    try:
        skeleton = denoiser_skeleton(recipe)  # the planner's, built once per process
        need = weight_bytes(skeleton, recipe.precision)
        pieces = sampling_pieces(recipe, skeleton, side, side, recipe.family.text_tokens)
        need += pieces.denoiser if pieces is not None else 0.0
    except (ConfigError, NotImplementedError, OSError) as e:
        return f"the planner cannot size it ({e})"
    free = torch.cuda.mem_get_info(device)[0]
    if need > free * 0.95:
        return f"it needs {need / GIB:.1f} GiB beside the training model, {free / GIB:.1f} GiB are free on {device}"
    return None


def with_prompt(batch: dict[str, torch.Tensor], text: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``batch`` with one prompt's embeddings (``text``: batch 1, the text cache's keys) for every sample in it: its
    text entries replaced, its latents and the rest (SDXL's sizes...) kept."""
    n, device = batch["latents"].shape[0], batch["latents"].device
    return {**batch, **{k: v.to(device).expand(n, *v.shape[1:]) for k, v in text.items()}}


def denoiser_prediction(
    family: DiffusionFamily,
    denoiser: nn.Module,
    batch: dict[str, torch.Tensor],
    noise: torch.Tensor,
    timesteps: torch.Tensor,
) -> torch.Tensor:
    """What ``denoiser`` predicts for ``batch`` at this noise and timestep, as the family's loss feeds it: the output of
    the denoiser's one forward inside :meth:`~DiffusionFamily.loss`, caught by a forward hook (a tensor, the first of a
    tuple, or a per-sample list stacked), in float32."""
    outputs: list[Any] = []
    handle = denoiser.register_forward_hook(lambda _module, _args, output: outputs.append(output))
    try:
        family.loss(denoiser, batch, noise, timesteps)
    finally:
        handle.remove()
    if len(outputs) != 1:
        raise RuntimeError(f"the {family.name} loss ran the denoiser {len(outputs)} times, not once")
    output = outputs[0]
    if isinstance(output, tuple) or hasattr(output, "to_tuple"):
        output = output[0]
    if isinstance(output, list):
        output = torch.stack(output)
    return output.float()


@contextlib.contextmanager
def fixed_evaluation(trainer: Trainer, denoiser: nn.Module) -> Iterator[None]:
    """No gradients, ``denoiser`` in eval mode (no LoRA dropout), the precision's autocast, the blocks uncompiled (no
    graphs of their own for a few batches); the mode as it was afterwards."""
    was_training = denoiser.training
    denoiser.eval()
    try:
        with torch.no_grad(), trainer.precision_plugin.forward_context(), uncompiled():
            yield
    finally:
        denoiser.train(was_training)


def _on(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}


def drift_prompts(entries: Any, family: DiffusionFamily) -> list[str]:
    """The drift prompts a config's ``trainer.callbacks`` entries make ``fit`` encode at its start (its
    :class:`FixedEvalLoss`, or the one ``fit`` adds), none for a family that reads a prompt only with its controls:
    what ``lightning-lora cache`` caches beside the images so that ``fit`` reads only the cache."""
    evaluator = (configured(entries, FixedEvalLoss) if entries else None) or FixedEvalLoss()
    return [] if family.editing.prompt_sees_controls else evaluator.prompts_for(family)


def _encode(trainer: Trainer, datamodule: LatentDataModule, prompts: list[str]) -> list[dict[str, torch.Tensor]]:
    """The prompts' embeddings through the data's text cache (global rank 0 encodes what is missing first; the other
    ranks then read them), kept on the CPU. Out of GPU memory while encoding: none, with a warning (the run goes on
    without ``eval/drift``)."""
    cache = datamodule.cache()
    device = trainer.strategy.root_device
    texts: list[dict[str, torch.Tensor]] = []
    encoded = True
    if trainer.is_global_zero:
        try:
            texts = cache.text_embeddings(prompts, device)
        except torch.OutOfMemoryError as e:
            encoded = False
            log.warning(
                "FixedEvalLoss: out of GPU memory while encoding the drift prompts (%s); no eval/drift in this run. "
                "Set data.text_encoder_quantization: nf4 (or fp8).",
                first_line(e, 200),
            )
    if trainer.world_size > 1:
        trainer.strategy.barrier("FixedEvalLoss.setup")
        encoded = trainer.strategy.broadcast(encoded)
        if encoded and not trainer.is_global_zero:
            texts = cache.text_embeddings(prompts, device)
    return [{k: v.cpu() for k, v in t.items()} for t in texts] if encoded else []
