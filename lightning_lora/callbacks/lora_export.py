"""Write the LoRA file(s) at the end of training and, optionally, every N steps.

Files go to ``<run folder>/lora/``: ``<name>.safetensors`` at the end, ``<name>-step000500.safetensors`` for the
intermediate ones, in each of the chosen formats. By default a run writes every format its family has, so that a user
who knows nothing of layouts has a file their tool loads:

* ``<name>.safetensors`` -- the diffusers layout: ``pipe.load_lora_weights`` (and, for FLUX, ComfyUI: it maps
  diffusers names onto slices of its fused layers, so this is also the compact FLUX file for ComfyUI);
* ``<name>.kohya.safetensors`` -- the kohya layout: ComfyUI, Forge/A1111, kohya's sd-scripts (LyCORIS for DoRA, LoKr,
  LoHa), and diffusers too;
* ``<name>.comfyui.safetensors`` -- ComfyUI's own layout (``diffusion_model.<module>``), which every ComfyUI release
  that runs the model maps (Z-Image, Chroma: :mod:`lightning_lora.formats.comfyui`).

With a :class:`~lightning_lora.callbacks.ema.LoraEMA` the EMA of the LoRA is written too, as ``<name>.ema.safetensors``
(``<name>.ema.kohya.safetensors``...; ``weights`` chooses). With ``best``, ``<name>.best.safetensors`` (in every layout)
holds the LoRA of the step whose fixed evaluation was the best so far
(:class:`~lightning_lora.callbacks.evaluation.FixedEvalLoss`'s ``monitor``), written when it is measured. Every file
records the base format the LoRA trained on (``lightning_lora.training_precision``: ``bf16``, ``fp8``, ``nf4``...), so a
loader can pick the matching base.

Which tool applies every layer of which file is decided per file by the loaders' key rules
(:mod:`lightning_lora.formats.clients`), printed when the files are written, and stored in each file
(``lightning_lora.loads_in``). A layer that some tool loads from *none* of the written files (a custom target such as
``conv_in``, which sd-scripts never loads) is a warning when training starts.

Before the first step (``on_fit_start``, the model built), every chosen format is tried on the LoRA's shapes alone
(:func:`~lightning_lora.export.check_export`): a format the LoRA cannot be written in (a LoKr for the diffusers format,
a LoKr on FLUX's fused q/k/v for the kohya one) stops the run if it was asked for by name, and is left out with a
warning if it came from the defaults. Only global rank 0 writes; writes are atomic.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, cast

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_lora.callbacks.ema import LoraEMA, lora_ema
from lightning_lora.callbacks.evaluation import FixedEvalLoss
from lightning_lora.data.recipe import data_recipe
from lightning_lora.errors import ConfigError, first_line
from lightning_lora.export import check_export, export_lora, file_coverage, training_precision
from lightning_lora.formats import VARIANTS, LoraFormat
from lightning_lora.formats.clients import TOOL_NAMES, TOOLS
from lightning_lora.precision import DTYPES

if TYPE_CHECKING:
    import torch

    from lightning_lora.families.base import DiffusionFamily, ModelSource
    from lightning_lora.lora import LoraOptions

__all__ = ["LoraExport"]

log = logging.getLogger(__name__)

_SUFFIX = {"diffusers": ".safetensors", "kohya": ".kohya.safetensors", "comfyui": ".comfyui.safetensors"}
_VARIANT = {"lora": "LoRA", "dora": "DoRA", "lokr": "LoKr", "loha": "LoHa"}


class LoraModel(Protocol):
    """What the export reads of the trained module: a :class:`~lightning_lora.module.LoraModule` (tests drive the
    callback with stand-ins that have just these). Told apart by :func:`as_lora_model`, not ``isinstance``: from Python
    3.12 a runtime protocol looks its members up statically, and ``denoiser``, once a registered submodule, lives in the
    module's ``_modules``, where a static lookup does not see it."""

    denoiser: torch.nn.Module | None

    @property
    def family(self) -> DiffusionFamily: ...

    @property
    def source(self) -> ModelSource: ...

    @property
    def lora(self) -> LoraOptions: ...


def as_lora_model(module: object) -> LoraModel | None:
    """``module`` as the export reads it, or None when it lacks a member of :class:`LoraModel` (``hasattr``, which sees
    a ``torch.nn.Module``'s submodules on every Python)."""
    members = ("denoiser", "family", "source", "lora")
    return cast(LoraModel, module) if all(hasattr(module, name) for name in members) else None


class LoraExport(Callback):
    """Export the trained LoRA.

    Args:
        name: file name stem.
        every_n_steps: also export every this many optimizer steps (0: only at the end).
        formats: ``diffusers``, ``kohya`` (ComfyUI / Forge / sd-scripts key layout) and/or ``comfyui``
            (``diffusion_model.`` keys, every ComfyUI release); each must be one the
            model's family writes (checked at setup, before training). Default (null): every format the family writes
            that can hold the LoRA.
        dtype: tensor dtype in the file (``fp32`` keeps full precision; ``bf16`` halves the size).
        trigger: the trigger word, recorded in the file's metadata (``modelspec.trigger_phrase``).
        dirname: folder under the run folder.
        weights: with a ``LoraEMA`` callback, which weights are written: ``raw`` (the trained LoRA,
            ``<name>.safetensors``), ``ema`` (its EMA, ``<name>.ema.safetensors``) or ``both``. Without one, the trained
            LoRA.
        best: also write ``<name>.best.safetensors`` (every format): the LoRA of the step with the best fixed
            evaluation so far (``FixedEvalLoss.monitor``), rewritten when a better one is measured.
    """

    def __init__(
        self,
        name: str = "lora",
        every_n_steps: int = 0,
        formats: list[LoraFormat] | None = None,
        dtype: Literal["fp32", "bf16", "fp16"] = "fp32",
        trigger: str | None = None,
        dirname: str = "lora",
        weights: Literal["raw", "ema", "both"] = "both",
        best: bool = False,
    ) -> None:
        self.name = name
        self.every_n_steps = every_n_steps
        self.requested = list(formats) if formats else None
        self.formats: list[str] = list(formats or ["diffusers"])
        self.dtype = dtype
        self.trigger = trigger
        self.dirname = dirname
        self.weights = weights
        self.best = best
        self.last_path: Path | None = None
        self.written: list[Path] = []
        self.final: list[tuple[str, Path]] = []
        """(format, path) of each file written at the end of training (the raw and the EMA weights)."""
        self.best_files: list[tuple[str, Path]] = []
        self.best_step: int | None = None
        """The step of the LoRA in the ``best`` files this run wrote."""
        self.loads_in: dict[str, list[str]] = {}
        """Format -> the tools that apply every layer of its file exactly (known once training starts)."""

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Choose the formats now (the family's, by default) and refuse a format the family does not write or one
        that cannot hold the LoRA's variant, before training."""
        family = getattr(pl_module, "family", None)
        if family is None:
            return
        missing = [f for f in self.requested or [] if f not in family.lora_files.formats]
        if missing:
            raise ConfigError(
                f"LoraExport.formats: there is no {missing[0]} layout for the {family.name!r} family yet; choose from "
                f"{', '.join(family.lora_files.formats)}."
            )
        variant = _VARIANT.get(str(getattr(getattr(pl_module, "lora", None), "variant", "lora")), "LoRA")
        holds = [f for f in family.lora_files.formats if variant in VARIANTS.get(f, ())]
        if self.requested is None:
            self.formats = holds
        else:
            refused = [f for f in self.requested if f not in holds]
            if refused:
                raise ConfigError(
                    f"LoraExport.formats: a {refused[0]} file cannot hold a {variant} adapter (it holds "
                    f"{' and '.join(VARIANTS[refused[0]])}); use formats {holds} or leave formats out."
                )
            self.formats = list(self.requested)
        if not self.formats:
            raise ConfigError(
                f"model.lora.variant: no LoRA file format of the {family.name!r} family holds a {variant} adapter; "
                "choose another variant."
            )
        if self.weights == "ema" and not any(isinstance(cb, LoraEMA) for cb in trainer.callbacks):  # type: ignore[attr-defined]
            raise ConfigError("LoraExport.weights: ema needs a LoraEMA callback in trainer.callbacks (or use raw).")
        if self.best and _evaluator(trainer) is None:
            raise ConfigError("LoraExport.best: the best LoRA is judged by a FixedEvalLoss callback; add one.")

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Try every chosen format on the LoRA's shapes (nothing computed or written) and say which tool loads what."""
        model = as_lora_model(pl_module)
        if model is None or model.denoiser is None:
            return
        denoiser, family = model.denoiser, model.family
        from peft.utils import get_peft_model_state_dict

        state = get_peft_model_state_dict(denoiser, unwrap_compiled=True)
        if not state:
            return
        kept = []
        for fmt in self.formats:
            try:
                check_export(state, family, fmt)
            except ConfigError as e:
                if self.requested is not None:
                    raise ConfigError(f"LoraExport.formats: {first_line(e)}") from None
                rank_zero_warn(f"LoraExport: no {fmt} file will be written: {first_line(e)}")
                continue
            kept.append(fmt)
        if not kept:
            raise ConfigError(f"LoraExport: this LoRA cannot be written in any format of the {family.name!r} family.")
        self.formats = kept
        coverages = {fmt: file_coverage(state, family, fmt) for fmt in self.formats}
        self.loads_in = {fmt: c.loads_in for fmt, c in coverages.items()}
        for tool in TOOLS:  # layers no written file gets into this tool: say it now, not after training
            if tool not in family.lora_files.tools:  # a fact of the family, not a warning about this run
                log.info("LoraExport: %s does not load %s LoRAs.", TOOL_NAMES[tool], family.name)
                continue
            missed = [{**c.skipped[tool], **c.approximate[tool]} for c in coverages.values()]
            nowhere = [m for m in missed[0] if all(m in other for other in missed[1:])]
            if nowhere:
                names = ", ".join(nowhere[:3]) + (", ..." if len(nowhere) > 3 else "")
                rank_zero_warn(
                    f"LoraExport: {TOOL_NAMES[tool]} will not apply {len(nowhere)} trained layer(s) as trained from "
                    f"any of the files ({names}): {missed[0][nowhere[0]]}."
                )

    def paths(self, trainer: Trainer, stem: str) -> dict[str, Path]:
        folder = Path(trainer.default_root_dir) / self.dirname
        return {fmt: folder / f"{stem}{_SUFFIX[fmt]}" for fmt in self.formats}

    def describe(self, fmt: str) -> str:
        """The tools that apply every layer of this run's ``fmt`` file (``"diffusers, ComfyUI"``)."""
        tools = self.loads_in.get(fmt)
        return ", ".join(TOOL_NAMES[t] for t in tools) if tools else fmt

    def last_files(self) -> list[tuple[str, Path]]:
        """(format, path) of each file written at the end of training, else of the last export."""
        if self.final:
            return list(self.final)
        last = self.written[-len(self.formats) :] if self.written else []
        return list(zip(self.formats, last, strict=False))

    def summary_lines(self) -> list[str]:
        """One line per file of the last export, ``LoRA file: <path>  (loads in <tools>)``, and per best file, for the
        run summary."""
        lines = [f"  {'LoRA file:':<26}{path}  (loads in {self.describe(fmt)})" for fmt, path in self.last_files()]
        best = f"best LoRA (step {self.best_step}):"
        return lines + [f"  {best:<26}{path}  (loads in {self.describe(fmt)})" for fmt, path in self.best_files]

    def _stems(self, trainer: Trainer, stem: str) -> list[tuple[str, LoraEMA | None]]:
        """The files of one export: ``stem`` with the raw weights and ``<stem>.ema`` with the EMA, as ``weights``
        says (the raw ones only without a ``LoraEMA``)."""
        ema = lora_ema(trainer)
        if ema is None:
            return [(stem, None)]
        raw: list[tuple[str, LoraEMA | None]] = [(stem, None)] if self.weights != "ema" else []
        return raw + ([(f"{stem}.ema", ema)] if self.weights != "raw" else [])

    def export_weights(self, trainer: Trainer, pl_module: LightningModule, stem: str) -> list[tuple[str, Path]]:
        """Write ``stem``'s files with the weights ``weights`` chooses (:meth:`_stems`); (format, path) of each."""
        files: list[tuple[str, Path]] = []
        for file_stem, ema in self._stems(trainer, stem):
            with ema.applied() if ema is not None else contextlib.nullcontext():
                files += self.export(trainer, pl_module, file_stem)
        return files

    def export(self, trainer: Trainer, pl_module: LightningModule, stem: str) -> list[tuple[str, Path]]:
        """Write the LoRA files of ``stem``: the LoRA is gathered whole on every rank (under ``trainer.strategy: fsdp``
        each rank holds a shard of it: every rank takes part), and global rank 0 writes. Returns (format, path) of each
        file."""
        from peft.utils import get_peft_model_state_dict

        from lightning_lora.model.sharding import full_state

        module = as_lora_model(pl_module)
        if module is None:
            raise TypeError(f"LoraExport exports a LoraModule's adapter, not a {type(pl_module).__name__}'s")
        state = full_state(get_peft_model_state_dict(module.denoiser, unwrap_compiled=True))
        if trainer.is_global_zero:
            data = data_recipe(trainer)
            info = {
                "family": module.family.name,
                "base_model": module.source.pretrained,
                "denoiser_file": Path(module.source.denoiser_file).name if module.source.denoiser_file else "",
                "steps": trainer.global_step,
                "resolution": data.resolution if data is not None else 0,
                "trigger": self.trigger or "",
                "title": stem,
                "config_sha256": _config_hash(
                    Path(trainer.default_root_dir) / "config.yaml"
                ),  # no log_dir: it broadcasts
            }
            precision = getattr(getattr(module, "recipe", None), "precision", None)
            if precision is not None:
                info["training_precision"] = training_precision(precision.spec())
            for fmt, path in self.paths(trainer, stem).items():
                export_lora(
                    state,
                    path,
                    family=module.family,
                    lora=module.lora,
                    info=info,
                    format=fmt,  # type: ignore[arg-type]
                    dtype=DTYPES[self.dtype],
                )
                self.written.append(path)
                if fmt == self.formats[0] and not stem.endswith((".ema", ".best")):
                    self.last_path = path
        trainer.strategy.barrier("LoraExport")
        return list(self.paths(trainer, stem).items())

    def _export_best(self, trainer: Trainer, pl_module: LightningModule, end: bool = False) -> None:
        """Write the ``best`` files when the fixed evaluation of this step is the best so far (and they do not hold
        it yet): the EMA's weights when the monitored metric is an ``*_ema`` one."""
        evaluator = _evaluator(trainer)
        if not self.best or evaluator is None:
            return
        evaluator.evaluate_if_due(trainer, pl_module, end=end)
        step = trainer.global_step
        if evaluator.best_step != step or self.best_step == step:
            return
        ema = lora_ema(trainer) if evaluator.watched.endswith("_ema") else None
        with ema.applied() if ema is not None else contextlib.nullcontext():
            self.best_files = self.export(trainer, pl_module, f"{self.name}.best")
        self.best_step = step

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.global_step == 0:  # the base itself may stay the best (a resumed run wrote its best already)
            self._export_best(trainer, pl_module)

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        step = trainer.global_step
        if self.every_n_steps > 0 and step > 0 and step % self.every_n_steps == 0:
            stem = f"{self.name}-step{step:06d}"
            if not self.written or all(path.name != f"{stem}{_SUFFIX[self.formats[0]]}" for path in self.written):
                self.export_weights(trainer, pl_module, stem)
        self._export_best(trainer, pl_module)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._export_best(trainer, pl_module, end=True)
        self.final = self.export_weights(trainer, pl_module, self.name)
        files = "; ".join(f"{path} (loads in {self.describe(fmt)})" for fmt, path in self.last_files())
        log.info("LoRA written at step %d: %s", trainer.global_step, files)  # the run summary lists them for the user
        if self.best_files:
            log.info("Best LoRA (step %s): %s", self.best_step, "; ".join(str(p) for _, p in self.best_files))


def _evaluator(trainer: Trainer) -> FixedEvalLoss | None:
    """The trainer's fixed evaluation (which judges the best LoRA), or None."""
    return next((cb for cb in trainer.callbacks if isinstance(cb, FixedEvalLoss)), None)  # type: ignore[attr-defined]


def _config_hash(config: Path) -> str:
    """A short hash of the run's resolved config.yaml: which settings produced this file."""
    return hashlib.sha256(config.read_bytes()).hexdigest()[:16] if config.is_file() else ""
