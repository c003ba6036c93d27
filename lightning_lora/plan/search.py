"""The search over changes: the ways to run the same training in a card's memory, each planned as a new recipe by
:func:`~lightning_lora.plan.estimate.plan_for` (the estimate), fastest first.

A change is a set of command-line options with the recipe fields and data options they set (:data:`Changes`): less
checkpointing or offloading than configured where the memory allows it (:func:`choose_for_memory`, ``model.memory``),
checkpointing, inputs in CPU memory, a smaller base format and offloaded blocks where it does not
(:func:`fitting_changes`), the same images per step in fewer, larger batches (:func:`larger_batches`), and the table of
common cards (:func:`cards_table`). A combination the recipe or the strategy refuses is never suggested.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from lightning_lora.data.recipe import DataRecipe
from lightning_lora.errors import ConfigError
from lightning_lora.model.parallel import LoraFSDPStrategy, check_strategy
from lightning_lora.model.recipe import ModelRecipe
from lightning_lora.plan.estimate import FIXED_OVERHEAD_GIB, HEADROOM, plan_for
from lightning_lora.precision import FP8, NF4

__all__ = [
    "CARDS",
    "CARD_SIZES",
    "OFFLOAD_TRIES",
    "OUTSIDE_ALLOCATOR_GIB",
    "Changes",
    "Fit",
    "card_memory",
    "cards_of",
    "cards_table",
    "choose_for_memory",
    "fitting_changes",
    "larger_batches",
    "merged_batches",
    "smaller_batches",
    "visible_card_memory",
]

OFFLOAD_TRIES = (3, 4, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48)  # 1-2 save nothing: two are on the GPU at once


Changes = tuple[str, dict[str, Any], dict[str, Any]]
"""An alternative: (command-line options, the recipe fields they change, the data options they change: ``batch_size``,
``resolution``)."""


_MODEL_OPTIONS = ("gradient_checkpointing", "checkpoint_every", "offload_activations", "offload_blocks")
"""The recipe fields a change may set (besides the base's format), in the order their options are written."""


def _options(recipe: ModelRecipe, changes: dict[str, Any], data: dict[str, Any]) -> str:
    """The command-line options that make ``changes`` (recipe fields) and ``data`` (data options) of ``recipe``: only
    what differs from it (an option already at that value is left out); empty when nothing changes."""
    flags = []
    precision = changes.get("precision", recipe.precision)
    if type(precision) is not type(recipe.precision):
        flags.append(f"--trainer.plugins lightning_lora.precision.{type(precision).__name__}")
    for name in _MODEL_OPTIONS:
        value = changes.get(name, getattr(recipe, name))
        if value != getattr(recipe, name):
            flags.append(f"--model.{name} {str(value).lower()}")
    flags += [f"--data.{name} {value}" for name, value in data.items()]
    return " ".join(flags)


def _changes(recipe: ModelRecipe, alternatives: list[tuple[dict[str, Any], dict[str, Any]]]) -> list[Changes]:
    """The ``(recipe fields, data options)`` alternatives as :data:`Changes`, in order, without those that change
    nothing and without repeats (two alternatives that write the same options)."""
    tries: list[Changes] = []
    for changes, data in alternatives:
        flags = _options(recipe, changes, data)
        if flags and all(flags != t[0] for t in tries):
            tries.append((flags, changes, data))
    return tries


def _candidates(recipe: ModelRecipe, data: DataRecipe) -> list[Changes]:
    """Alternatives to try, fastest first (offloading, tried last, is :data:`OFFLOAD_TRIES`): ways to run the same
    training with less memory, then smaller batches and images (a different training: only when nothing else fits)."""
    checkpointing = {"gradient_checkpointing": True, "checkpoint_every": 1}
    tries: list[tuple[dict[str, Any], dict[str, Any]]] = []
    if not recipe.gradient_checkpointing:
        # Fastest first: checkpointing one block in 3 or 2 recomputes less than checkpointing every block.
        tries += [({"gradient_checkpointing": True, "checkpoint_every": every}, {}) for every in (3, 2)]
    tries.append((checkpointing, {}))
    tries.append(({**checkpointing, "offload_activations": True}, {}))
    smallest: dict[str, Any] = {}
    for fmt in (FP8, NF4):  # FP8Compute is an FP8: the same memory
        if not isinstance(recipe.precision, fmt):
            smallest = {"precision": recipe.precision.as_format(fmt.__name__)}  # the same dtype: a plain replace
            tries += [(smallest, {}), ({**smallest, **checkpointing}, {})]
    # The least memory without changing the training: the smallest base, every block checkpointed, inputs in CPU.
    least = {**smallest, **checkpointing, "offload_activations": True}
    tries.append((least, {}))
    batch, side = data.batch_size, data.resolution
    if batch > 1:
        tries.append((least, {"batch_size": 1}))
    tries += [(least, {"batch_size": 1, "resolution": smaller}) for smaller in (768, 512) if smaller < side]
    return _changes(recipe, tries)


def _faster(recipe: ModelRecipe) -> list[Changes]:
    """Ways to run the same training faster than as configured, fastest first: no gradient checkpointing, then one
    block in 3 or 2 checkpointed (less recomputation than configured), each without the configured copies to and from
    CPU memory (checkpointed inputs, offloaded blocks); then only without those copies. Empty when nothing is saving
    memory."""
    copies: dict[str, Any] = {}
    if recipe.offload_activations:
        copies["offload_activations"] = False
    if recipe.offload_blocks:
        copies["offload_blocks"] = 0
    tries: list[dict[str, Any]] = []
    if recipe.gradient_checkpointing:
        tries.append({"gradient_checkpointing": False, **copies})
        tries += [{"checkpoint_every": every, **copies} for every in (3, 2) if every > recipe.checkpoint_every]
    tries.append(copies)
    return _changes(recipe, [(changes, {}) for changes in tries])


@dataclass(frozen=True)
class Fit:
    """A way to run that fits: the command-line options that make it (empty: as configured), its planned peak, and
    the recipe fields (``changes``) and data options (``data``) those options set."""

    flags: str
    peak_gib: float
    offload: bool = False
    changes: dict[str, Any] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)

    def line(self) -> str:
        slower = "; slower by the blocks' copies" if self.offload else ""
        return f"{self.flags or 'as configured'}   (~{self.peak_gib:.1f} GiB{slower})"


def _with_data_options(data: DataRecipe, options: dict[str, Any]) -> DataRecipe:
    """``data`` with the data options of a :data:`Changes` (``resolution``: one size, as ``--data.resolution`` sets)."""
    if not options:
        return data
    sizes = {"resolutions": (options["resolution"],)} if "resolution" in options else {}
    return data.replace(batch_size=options.get("batch_size", data.batch_size), **sizes)


class _Planner:
    """Plans of a recipe and its alternatives for one data recipe, each planned once (``shards``, ``ema_copies``:
    :func:`~lightning_lora.plan.estimate.plan_training`'s)."""

    def __init__(
        self, recipe: ModelRecipe, data: DataRecipe, optimizer: str, shards: int = 1, ema_copies: int = 0
    ) -> None:
        self.recipe, self.data, self.optimizer, self.shards = recipe, data, optimizer, shards
        self.ema_copies = ema_copies
        self._peaks: dict[str, float | None] = {}
        # A sharded run takes only what its strategy takes (a bf16 base, not offloaded): the strategy's own check.
        self._strategy = LoraFSDPStrategy() if shards > 1 else None

    def peak(self, flags: str, changes: dict[str, Any], data: dict[str, Any] | None = None) -> float | None:
        """The planned peak with ``changes`` (and data options ``data``), or None when the recipe refuses them."""
        if flags not in self._peaks:
            try:
                changed = self.recipe.replace(**changes)
                if self._strategy is not None:
                    check_strategy(self._strategy, changed)
                data_recipe = _with_data_options(self.data, data or {})
                plan = plan_for(changed, data_recipe, self.optimizer, shards=self.shards, ema_copies=self.ema_copies)
                self._peaks[flags] = plan.run_peak  # the samples must fit too
            except ConfigError:  # a change the other settings refuse (e.g. NF4 with model.offload_blocks): not a fix
                self._peaks[flags] = None
        return self._peaks[flags]

    def fastest(self, vram: float) -> Fit | None:
        """The fastest way to run the same training in ``vram`` GiB (5% kept free): a faster change than configured
        (:func:`_faster`) when one fits, else as configured when it fits, else the first memory-saving change that
        fits without changing the data; None when none does."""
        limit = vram * HEADROOM
        for flags, changes, _ in _faster(self.recipe):
            peak = self.peak(flags, changes)
            if peak is not None and peak <= limit:
                return Fit(flags, peak, changes=changes)
        configured = self.peak("", {})
        if configured is not None and configured <= limit:
            return Fit("", configured)
        same = [fit for fit in self.fits(vram, first=True) if not fit.data]
        return same[0] if same else None

    def fits(self, vram: float, first: bool = False) -> list[Fit]:
        """The alternatives that fit in ``vram`` GiB (5% kept free), fastest first (only the fastest with ``first``);
        offloading with the fewest blocks that fit (it costs PCIe copies per block and step), before changes of the
        data. One that needs as much memory as a faster one on the same base format (the same GiB, as printed) is left
        out: it would only be slower (:func:`_without_ties`)."""
        limit = vram * HEADROOM
        found: list[Fit] = []
        if limit <= FIXED_OVERHEAD_GIB:  # not even the CUDA context fits
            return found
        tries = _candidates(self.recipe, self.data)
        same = [t for t in tries if not t[2]]
        for flags, changes, data in same:
            peak = self.peak(flags, changes, data)
            if peak is not None and peak <= limit:
                found.append(Fit(flags, peak, changes=changes))
                if first:
                    return found
        for count in OFFLOAD_TRIES:
            flags = _options(self.recipe, {"offload_blocks": count}, {})
            if not flags:  # as configured
                continue
            peak = self.peak(flags, {"offload_blocks": count})
            if peak is None:  # more blocks than the model has, or a setting offloading refuses (NF4, compile_blocks)
                break
            if peak <= limit:
                found.append(Fit(flags, peak, offload=True, changes={"offload_blocks": count}))
                if first:
                    return found
                break
        if not found:  # a smaller batch or smaller images change the training: only when nothing else fits
            for flags, changes, data in (t for t in tries if t[2]):
                peak = self.peak(flags, changes, data)
                if peak is not None and peak <= limit:
                    found.append(Fit(flags, peak, changes=changes, data=data))
                    break
        return _without_ties(found)


def _without_ties(fits: list[Fit]) -> list[Fit]:
    """The ``fits`` (fastest first) without those that need the same memory, as printed (0.1 GiB), as a faster one on
    the same base format: more checkpointing or copies for nothing (where the sample images' peak sets the run's, say).
    A different base format is another choice (of quality), kept."""
    kept: list[Fit] = []
    for fit in fits:
        base = type(fit.changes.get("precision"))
        if not any(
            f"{k.peak_gib:.1f}" == f"{fit.peak_gib:.1f}" and type(k.changes.get("precision")) is base for k in kept
        ):
            kept.append(fit)
    return kept


OUTSIDE_ALLOCATOR_GIB = 0.67
"""GPU memory a training process holds outside PyTorch's caching allocator (the CUDA context, the loaded kernels, the
libraries' handles), which the planned peaks (PyTorch's allocated peaks) leave out: 0.67 GiB on an H200 (CUDA 13); with
the allocator capped at 7.5 GiB the process held 8.17 (dev/LOG.md, 2026-12-02). The fit verdicts do not count it yet
(their 0.35 GiB allowance and 5% headroom stand in for it); :func:`larger_batches` does."""


def smaller_batches(batch_size: int, accumulate: int) -> tuple[int, int] | None:
    """The same images per optimizer step in smaller batches: ``(data.batch_size, trainer.accumulate_grad_batches)``
    with the batch halved (an odd batch: one image at a time) and the accumulation raised to match; None for a batch
    of one."""
    if batch_size <= 1:
        return None
    smaller = batch_size // 2 if batch_size % 2 == 0 else 1
    return smaller, accumulate * batch_size // smaller


def merged_batches(batch_size: int, accumulate: int) -> tuple[int, int] | None:
    """The same images per optimizer step in fewer, larger batches: the accumulation divided by its smallest factor
    (halved when even) and the batch multiplied by it; None without accumulation."""
    if accumulate <= 1:
        return None
    factor = next(f for f in range(2, accumulate + 1) if accumulate % f == 0)
    return batch_size * factor, accumulate // factor


def larger_batches(
    recipe: ModelRecipe,
    data: DataRecipe,
    vram: float,
    accumulate: int,
    optimizer: str = "AdamW",
    shards: int = 1,
    ema_copies: int = 0,
) -> Fit | None:
    """The same images per optimizer step as fewer, larger batches (:func:`merged_batches`), when that fits ``vram``
    GiB with :data:`OUTSIDE_ALLOCATOR_GIB` kept for the process and 5% of the rest free; None otherwise. A step that
    launches many small kernels (NF4, checkpointed blocks, 512px) pays its launches per batch: FLUX at rank 4 with NF4
    and every block checkpointed trained 4 images in 1.10 s as 2 x 2 against 2.01-2.14 as 4 x 1 (torch's AdamW at
    both) on an H200, and needed 7.34 GiB for it, which an 8 GB card does not have (out of memory under a
    7.5 GiB cap)."""
    merged = merged_batches(data.batch_size, accumulate)
    if merged is None:
        return None
    batch, steps = merged
    flags = f"--data.batch_size {batch} --trainer.accumulate_grad_batches {steps}"
    peak = _Planner(recipe, data, optimizer, shards, ema_copies).peak(flags, {}, {"batch_size": batch})
    if peak is None or peak > (vram - OUTSIDE_ALLOCATOR_GIB) * HEADROOM:
        return None
    return Fit(flags, peak, data={"batch_size": batch})


def choose_for_memory(
    recipe: ModelRecipe, data: DataRecipe, vram: float, optimizer: str = "AdamW", shards: int = 1, ema_copies: int = 0
) -> Fit | None:
    """The fastest way to run the same training in ``vram`` GiB (``model.memory``, :meth:`_Planner.fastest`): less
    checkpointing or offloading than configured when that fits, as configured when it fits, else the first
    alternative that fits without changing the data (batch, resolution); None when none does. ``shards``,
    ``ema_copies``: :func:`~lightning_lora.plan.estimate.plan_training`'s (a sharded base takes no quantized or
    offloaded alternative; a ``LoraEMA``'s copies of the LoRA)."""
    return _Planner(recipe, data, optimizer, shards, ema_copies).fastest(vram)


def fitting_changes(
    recipe: ModelRecipe, data: DataRecipe, vram: float, optimizer: str = "AdamW", shards: int = 1, ema_copies: int = 0
) -> list[str]:
    """Changes (as command-line options, with the planned peak) that bring the plan under ``vram`` GiB, fastest first;
    each is tried as a new recipe (``recipe.replace``), so a combination the recipe refuses is never suggested."""
    return [fit.line() for fit in _Planner(recipe, data, optimizer, shards, ema_copies).fits(vram)]


CARDS: dict[str, float] = {
    "RTX 3060": 12,
    "RTX 3070": 8,
    "RTX 3080": 10,
    "RTX 3090": 24,
    "RTX 4060": 8,
    "RTX 4060 Ti": 16,
    "RTX 4070": 12,
    "RTX 4080": 16,
    "RTX 4090": 24,
    "RTX 5080": 16,
    "RTX 5090": 32,
    "L4": 24,
    "A10": 24,
    "RTX A6000": 48,
    "L40S": 48,
    "A100": 80,
    "H100": 80,
    "H200": 141,
    "RX 7900 XTX": 24,
    "MI300X": 192,
}
"""Common cards and their memory in GiB (the 16 GB RTX 4060 Ti; write ``"RTX 4060 Ti 8GB"`` for the other)."""

CARD_SIZES = (8, 12, 16, 24, 32, 48, 80)
"""The memory sizes ``lightning-lora plan --cards`` tabulates."""


def card_memory(name: str) -> float:
    """GiB of the card ``name`` (``"RTX 4090"``, ``"4090"``, ``"nvidia h100"``, ``"RTX 3060 12GB"``: a size in the
    name wins); :class:`ConfigError` listing the known cards otherwise."""
    size = re.search(r"(\d+)\s*GB?\b", name, re.IGNORECASE)
    if size:
        return float(size.group(1))
    wanted = re.sub(r"[^a-z0-9]", "", name.lower().replace("nvidia", "").replace("geforce", "").replace("amd", ""))
    for card, gib in CARDS.items():
        plain = re.sub(r"[^a-z0-9]", "", card.lower())
        if wanted in (plain, plain.removeprefix("rtx").removeprefix("rx")):
            return gib
    raise ConfigError(
        f"--gpu: {name!r} is not a card lightning-lora knows ({', '.join(CARDS)}). Give --vram in GiB, or write the "
        "memory in the name (e.g. 'RTX 3060 12GB')."
    )


def visible_card_memory() -> tuple[float, str]:
    """GiB free on the visible GPU (CUDA or ROCm, through ``torch.cuda``: the current device, other processes' use
    taken off, as ``model.memory: auto`` measures it) and the card's name: ``plan --vram auto``. A
    :class:`ConfigError` naming ``--vram`` and ``--gpu`` where no GPU is visible."""
    import torch

    from lightning_lora.hardware import free_memory_gib

    free = free_memory_gib("cuda")
    if free is None:
        raise ConfigError(
            "--vram auto: no GPU is visible here (CUDA or ROCm); give the card's memory instead, e.g. --vram 24 or "
            '--gpu "RTX 4090".'
        )
    return free, torch.cuda.get_device_name()


def cards_table(
    recipe: ModelRecipe,
    data: DataRecipe,
    optimizer: str = "AdamW",
    sizes: tuple[int, ...] = CARD_SIZES,
    shards: int = 1,
    ema_copies: int = 0,
) -> list[tuple[int, Fit | None]]:
    """For each card size (GiB): the fastest way to run the same training that fits (:meth:`_Planner.fastest`: less
    checkpointing than configured on a larger card, as configured, or a memory-saving change), else the first change
    of the data that fits, or None; with ``shards`` > 1, on each of that many cards of the size."""
    planner = _Planner(recipe, data, optimizer, shards, ema_copies)
    rows: list[tuple[int, Fit | None]] = []
    for size in sizes:
        fit = planner.fastest(size)
        if fit is None:
            fits = planner.fits(size, first=True)
            fit = fits[0] if fits else None
        rows.append((size, fit))
    return rows


def cards_of(size: float) -> list[str]:
    """The :data:`CARDS` with this much memory."""
    return [card for card, gib in CARDS.items() if gib == size]
