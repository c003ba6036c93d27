"""An exponential moving average of the LoRA, never of the frozen base, in the exact-resume checkpoint.

Lightning's own weight averaging (``WeightAveraging``, ``EMAWeightAveraging``) keeps an averaged copy of the whole
module: for FLUX.1 that is another 24 GB of frozen weights that never change. :class:`LoraEMA` averages only the LoRA's
parameters (a few MB to a few hundred MB in float32), on the device they train on, after every optimizer step
(:func:`lightning_lora.ema.update`: one fused lerp per tensor list):

* **the EMA** of ``decay`` (:func:`lightning_lora.ema.classic_beta`: a running mean for the first ``1 / (1 - decay)``
  steps, then the weights of about the last ``1 / (1 - decay)`` steps). The fixed evaluation loss and drift
  (``eval/loss_ema``, ``eval/drift_ema``, ``val/loss_ema``), the sample images (``*_ema.png``) and the exported LoRA
  (``<name>.ema.safetensors``, ``LoraExport.weights``) are made with it as well as with the raw weights: they copy it
  into the LoRA's parameters for the time they draw (:meth:`LoraEMA.applied`) and copy the raw weights back, bit for
  bit;
* with ``snapshot_every``, **power-function EMAs** of the widths ``sigma_rels`` (Karras et al. 2024, see
  :mod:`lightning_lora.ema`), saved every ``snapshot_every`` steps to ``<run folder>/<dirname>/`` as small safetensors
  files: ``lightning-lora export --ema-sigma-rel 0.08`` reconstructs the EMA of any width after training, in any
  layout, from them and the checkpoint, without training again.

GPU memory: one float32 copy of the LoRA for the EMA, one more per ``sigma_rels`` width with snapshots (``lightning-lora
plan`` counts them); the snapshots go to disk. Every average is in the callback's state in each checkpoint, with the
step it was last updated and the snapshots written, so a resumed run continues the same averages, bit for bit (a
snapshot written after the checkpoint a run resumes from is written again, the same). Every rank keeps the same
averages (DDP trains the same LoRA on each); rank 0 writes the snapshots. Not with a sharded LoRA
(``trainer.strategy: fsdp``).

Every callback that reads the average asks :func:`lora_ema` for it, which first brings it up to the trainer's step, so
the callbacks' order in the config does not matter.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_lora import ema
from lightning_lora.errors import ConfigError
from lightning_lora.model.parallel import runs_forward_on_every_rank
from lightning_lora.module import lora_module

__all__ = ["STATE_KEY", "LoraEMA", "configured", "configured_ema", "ema_copies", "lora_ema"]

_C = TypeVar("_C")

STATE_KEY = "LoraEMA"
"""Where a checkpoint keeps the callback's state (``checkpoint["callbacks"][STATE_KEY]``): ``lightning-lora export``
reads it there."""


class LoraEMA(Callback):
    """Keep exponential moving averages of the LoRA (see the module docstring).

    Args:
        decay: the EMA's decay per optimizer step: the weights of about the last ``1 / (1 - decay)`` steps count
            (0.99: about 100; a running mean of every step until then).
        sigma_rels: with ``snapshot_every``, the widths of the power-function EMAs to keep, as a fraction of the run
            (0.05: about its last tenth; 0.10: its last fifth); ``lightning-lora export --ema-sigma-rel`` makes any
            width from them. Each costs one more float32 copy of the LoRA on the GPU.
        snapshot_every: save the power-function EMAs every this many optimizer steps (0: keep none, no post-hoc EMA).
            Post-hoc EMA reconstructs a width well from a few dozen snapshots over the run.
        dirname: folder under the run folder for the snapshots.
    """

    def __init__(
        self,
        decay: float = 0.99,
        sigma_rels: tuple[float, ...] = (0.05, 0.10),
        snapshot_every: int = 0,
        dirname: str = "ema",
    ) -> None:
        ema.check_decay(decay, "LoraEMA.decay")
        for sigma_rel in sigma_rels:
            ema.check_sigma_rel(sigma_rel, "LoraEMA.sigma_rels")
        if snapshot_every < 0:
            raise ConfigError(f"LoraEMA.snapshot_every: {snapshot_every} must be 0 (no snapshots) or a step count.")
        if snapshot_every > 0 and not sigma_rels:
            raise ConfigError(
                "LoraEMA.sigma_rels: empty, so there is nothing to snapshot; give widths or set snapshot_every: 0."
            )
        if len(set(sigma_rels)) != len(sigma_rels):
            raise ConfigError(f"LoraEMA.sigma_rels: {list(sigma_rels)} names a width twice.")
        self.decay = decay
        self.sigma_rels = tuple(float(s) for s in sigma_rels)
        self.snapshot_every = snapshot_every
        self.dirname = dirname
        self.gammas = [ema.sigma_rel_to_gamma(s) for s in self.sigma_rels]
        self.start = 0
        """The global step the averages start from (0, or the step a run without EMA was resumed at)."""
        self.step = 0
        """The global step of the last update."""
        self.names: list[str] = []
        """The LoRA parameters' names in the denoiser (``...lora_A.default.weight``), in the order of the tensors."""
        self.average: list[torch.Tensor] = []
        self.power: list[list[torch.Tensor]] = []
        """One list of tensors per ``sigma_rels`` width (empty without snapshots)."""
        self.snapshots: list[int] = []
        """The global steps whose snapshot files this run wrote (before the step of its last checkpoint, or since)."""
        self.folder: Path | None = None
        self._params: list[torch.Tensor] = []
        self._pending: dict[str, Any] | None = None

    @property
    @override
    def state_key(self) -> str:
        return STATE_KEY

    @property
    def posthoc(self) -> bool:
        """Whether the power-function EMAs are kept (and snapshots written)."""
        return self.snapshot_every > 0

    @property
    def copies(self) -> int:
        """The float32 copies of the LoRA this keeps on the LoRA's device (the memory planner's count)."""
        return 1 + (len(self.sigma_rels) if self.posthoc else 0)

    @property
    def moved(self) -> bool:
        """Whether the EMA differs from the raw weights it started from (an update happened)."""
        return self.step > self.start

    # -- set-up and resume --------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if sum(isinstance(cb, LoraEMA) for cb in trainer.callbacks) > 1:  # type: ignore[attr-defined]
            raise ConfigError("trainer.callbacks: more than one LoraEMA; keep one (it keeps every average).")
        if runs_forward_on_every_rank(trainer.strategy):
            raise ConfigError(
                "LoraEMA: not with trainer.strategy: fsdp (each GPU holds a shard of the LoRA); use the ddp strategy "
                "or remove the LoraEMA callback."
            )
        self.folder = Path(trainer.default_root_dir) / self.dirname

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Start the averages at the LoRA as it is (the first update replaces them), then take a checkpoint's."""
        denoiser = lora_module(pl_module, "LoraEMA").denoiser
        assert denoiser is not None  # built in configure_model
        named = [(n, p) for n, p in denoiser.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self.average = [p.detach().clone() for p in self._params]
        self.power = [[p.detach().clone() for p in self._params] for _ in self.sigma_rels] if self.posthoc else []
        self.start = self.step = trainer.global_step
        self.snapshots = []
        if self._pending is not None:
            self._restore(self._pending)
            self._pending = None
        elif trainer.global_step > 0:
            rank_zero_info(f"LoraEMA: the checkpoint holds no EMA; averaging from step {trainer.global_step}")

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "decay": self.decay,
            "start": self.start,
            "step": self.step,
            "average": dict(zip(self.names, self.average, strict=True)),
            "sigma_rels": list(self.sigma_rels) if self.posthoc else [],
            "power": [dict(zip(self.names, tensors, strict=True)) for tensors in self.power],
            "snapshots": list(self.snapshots),
            "folder": str(self.folder.absolute()) if self.folder is not None else "",
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._pending = state_dict  # the model's tensors exist at on_fit_start: restored there

    def _restore(self, state: dict[str, Any]) -> None:
        saved = list(state["average"])
        if saved != self.names:
            raise ConfigError(
                f"LoraEMA: the checkpoint's EMA is of another LoRA ({len(saved)} tensors, this one has "
                f"{len(self.names)}); resume with that run's model.lora settings, or start a new run folder."
            )
        widths = [float(s) for s in state["sigma_rels"]]
        if widths != (list(self.sigma_rels) if self.posthoc else []):
            raise ConfigError(
                f"LoraEMA.sigma_rels / snapshot_every: the checkpoint kept the power-function EMAs {widths}, this "
                f"config {list(self.sigma_rels) if self.posthoc else []}: their averages cannot be continued. Resume "
                "with the run's settings, or start a new run folder."
            )
        with torch.no_grad():
            torch._foreach_copy_(self.average, [state["average"][n] for n in self.names])
            for tensors, saved_state in zip(self.power, state["power"], strict=True):
                torch._foreach_copy_(tensors, [saved_state[n] for n in self.names])
        self.start, self.step = int(state["start"]), int(state["step"])
        self.snapshots = [int(s) for s in state["snapshots"]]
        if float(state["decay"]) != self.decay:
            rank_zero_info(f"LoraEMA.decay: {state['decay']} -> {self.decay} from step {self.step} (the config's)")

    # -- updates ------------------------------------------------------------------------------------------------
    def catch_up(self, trainer: Trainer) -> None:
        """Update the averages with the LoRA of the trainer's step, once per optimizer step (idempotent)."""
        step = trainer.global_step
        if step <= self.step or not self._params:
            return
        k = step - self.start
        with torch.no_grad():
            ema.update(self.average, self._params, ema.classic_beta(self.decay, k))
            for gamma, tensors in zip(self.gammas, self.power, strict=False):
                ema.update(tensors, self._params, ema.power_beta(gamma, k))
        self.step = step
        if self.posthoc and k % self.snapshot_every == 0:
            self._write_snapshot(trainer, k)

    def _write_snapshot(self, trainer: Trainer, updates: int) -> None:
        if trainer.is_global_zero:
            assert self.folder is not None
            ema.write_snapshot(self.folder / ema.snapshot_name(self.step), self.step, self.profiles(updates))
        self.snapshots.append(self.step)

    def profiles(self, updates: int | None = None) -> list[ema.Profile]:
        """The power-function EMAs as they are now (``updates``: optimizer steps averaged)."""
        k = self.step - self.start if updates is None else updates
        return [
            ema.Profile(k, s, dict(zip(self.names, tensors, strict=True)))
            for s, tensors in zip(self.sigma_rels, self.power, strict=False)
        ]

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        self.catch_up(trainer)

    # -- reading ------------------------------------------------------------------------------------------------
    @contextmanager
    def applied(self) -> Iterator[None]:
        """Inside the block the LoRA's parameters hold the EMA; after it their own values again, bit for bit."""
        if not self._params:
            yield
            return
        with torch.no_grad():
            raw = [p.detach().clone() for p in self._params]
            torch._foreach_copy_(self._params, self.average)
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(self._params, raw)

    def average_state(self) -> dict[str, torch.Tensor]:
        """The EMA by parameter name."""
        return dict(zip(self.names, self.average, strict=True))


def lora_ema(trainer: Trainer) -> LoraEMA | None:
    """The trainer's :class:`LoraEMA`, brought up to the trainer's step (:meth:`LoraEMA.catch_up`); None without one."""
    found = next((cb for cb in trainer.callbacks if isinstance(cb, LoraEMA)), None)  # type: ignore[attr-defined]
    if found is not None:
        found.catch_up(trainer)
    return found


def ema_copies(trainer: Trainer) -> int:
    """The float32 copies of the LoRA the trainer's :class:`LoraEMA` keeps on the GPU (0 without one): the memory
    planner's ``ema_copies``."""
    found = next((cb for cb in trainer.callbacks if isinstance(cb, LoraEMA)), None)  # type: ignore[attr-defined]
    return found.copies if found is not None else 0


def configured_ema(entries: Any) -> LoraEMA | None:
    """The :class:`LoraEMA` a config's ``trainer.callbacks`` entries name (:func:`configured`), or None: what
    ``lightning-lora plan`` counts without building the callbacks."""
    return configured(entries, LoraEMA)


def configured(entries: Any, kind: type[_C]) -> _C | None:
    """The first callback of ``kind`` a config's ``trainer.callbacks`` entries name, built from its ``init_args``
    (for callbacks whose construction is cheap: no model), or None. The class paths were checked before
    (:func:`lightning_lora.cli.class_paths.check_class_paths`); an entry that does not import is skipped."""
    import importlib

    for entry in entries if isinstance(entries, list) else [entries]:
        class_path = _field(entry, "class_path")
        if not isinstance(class_path, str) or "." not in class_path:
            continue
        module, name = class_path.rsplit(".", 1)
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
        if isinstance(cls, type) and issubclass(cls, kind):
            init_args = _field(entry, "init_args") or {}
            return cls(**(init_args.as_dict() if hasattr(init_args, "as_dict") else dict(init_args)))
    return None


def _field(entry: Any, name: str) -> Any:
    return entry.get(name) if isinstance(entry, dict) else getattr(entry, name, None)
