"""``lightning-lora plan --config X.yaml [--vram 24 | --gpu "RTX 4090"]``: predicted peak GPU memory, and what fits.

Reads the same YAML as ``fit`` (any ``fit`` option can follow, e.g. ``--model.lora.rank 32``) and needs none of what
training needs: no GPU (the trainer is not built), no image folder (the ``data:`` options are read, no folder is
listed), no weights (the model is built on the meta device from its config: a local folder's ``config.json`` files,
or, for the models the shipped configs use, the architecture facts that ship with lightning-lora; another hub id needs
its few-KB configs downloaded, and the message says how). It prints the memory by component; with ``--vram`` or
``--gpu`` it says whether the run fits that card and which changes would make it fit. The planning itself is the
library's (:mod:`lightning_lora.plan`); this module reads the config and prints.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from typing import Any, ClassVar

from lightning_lora.callbacks.ema import LoraEMA, configured_ema
from lightning_lora.cli.fit import UNBUILT, LoraCLI, resolve_precision
from lightning_lora.cli.help import VerbParser, plain_text
from lightning_lora.cli.status import USER_ERROR, user_error
from lightning_lora.data.datamodule import DataOptions
from lightning_lora.data.recipe import DataRecipe
from lightning_lora.errors import ConfigError
from lightning_lora.model.parallel import shard_count
from lightning_lora.precision import BasePrecision

__all__ = ["PlanCLI", "card_size", "main"]


class PlanCLI(LoraCLI):
    """The ``fit`` config read for planning: the model (its recipe), the data options and the trainer's precision and
    strategy; no Trainer, no images, no callback or logger, and the optimizer is never called (its class sizes its
    state)."""

    data_class = DataOptions
    unbuilt: ClassVar[dict[str, Any]] = UNBUILT
    ema: LoraEMA | None = None
    """The config's ``LoraEMA`` callback (its copies of the LoRA are GPU memory), read from its options; no callback
    is built."""

    def before_instantiate_classes(self) -> None:
        """The config's ``LoraEMA`` is read from its ``trainer.callbacks`` before they are left out of the build, once
        their class paths are checked (:meth:`LoraCLI.before_instantiate_classes`)."""
        config = self.config[self.subcommand] if self.subcommand else self.config
        entries = config.get("trainer.callbacks")
        super().before_instantiate_classes()
        self.ema = configured_ema(entries) if entries else None

    def _set_seed(self) -> None:
        """Nothing: a plan draws no random numbers (and prints no "Seed set" line)."""

    def instantiate_classes(self) -> None:
        # jsonargparse 4.49 renamed instantiate_classes to instantiate (the old name warns); older releases lack it.
        instantiate = getattr(self.parser, "instantiate", None) or self.parser.instantiate_classes
        self.config_init = instantiate(self.config)
        self.datamodule = self._get(self.config_init, "data")
        self.model = self._get(self.config_init, "model")
        trainer = self._get(self.config_init, "trainer", default={})
        self.trainer_config = trainer  # the strategy and devices: how many GPUs a sharded base is split over
        plugins = trainer.get("plugins") or []
        plugins, _ = resolve_precision(trainer.get("precision"), plugins if isinstance(plugins, list) else [plugins])
        self.model.use_precision(next(p for p in plugins if isinstance(p, BasePrecision)))  # the base format to plan
        self.trainer = None  # type: ignore[assignment]  # planning builds no Trainer (it would need the accelerator)


def ema_note(ema: LoraEMA, lora_gib: float, max_steps: Any) -> str:
    """One line on what a ``LoraEMA`` costs: its float32 copies of the LoRA (in the plan), and its snapshots on disk."""
    line = f"LoraEMA: {ema.copies} float32 copies of the LoRA on the GPU (counted above)"
    if not ema.posthoc:
        return line
    each = lora_gib * len(ema.sigma_rels)
    count = max_steps // ema.snapshot_every if isinstance(max_steps, int) and max_steps > 0 else None
    total = f", {count} by trainer.max_steps: {count * each:.2f} GiB" if count is not None else ""
    return f"{line}; a snapshot of {each:.2f} GiB on disk every {ema.snapshot_every} steps{total}"


def card_size(gib: float | None, option: str) -> float | None:
    """``gib`` (a card's memory), or a :class:`ConfigError` naming ``option`` when it is not a positive, finite number
    of GiB (``-3``, ``0``, ``nan``, ``inf`` would get a verdict that means nothing)."""
    if gib is None or (math.isfinite(gib) and gib > 0):
        return gib
    raise ConfigError(f"{option}: {gib:g} GiB is not a card's memory; give the GPU memory in GiB, e.g. --vram 24.")


def _gib_or_auto(text: str) -> float | str:
    """``--vram``: GiB, or ``auto`` (the visible card's free memory, read when the plan runs)."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size in GiB (e.g. 24) or auto") from None


def _plan_cli(parser: VerbParser, rest: list[str]) -> Any:
    """The :class:`PlanCLI` of ``rest`` (what plan's own options left for the config parser); an option the config
    parser does not know and finds nothing close to, but close to one of plan's own (``--vrm 24``), is one line naming
    that one (did you mean --vram?)."""
    try:
        return PlanCLI(args=rest, run=False)
    except ConfigError as e:
        unknown = re.match(r"([\w.]+): no such option", str(e))
        close = parser.close_option(f"--{unknown.group(1)}") if unknown and "did you mean" not in str(e) else None
        if unknown is None or close is None:
            raise
        parser.error(f"--{unknown.group(1)}: no such option; did you mean {close}?")


def main(argv: list[str]) -> int:
    """Run ``lightning-lora plan`` with ``argv`` (the arguments after ``plan``); return the exit status."""
    parser = VerbParser(prog="lightning-lora plan", description=plain_text(__doc__ or ""))
    size = parser.add_mutually_exclusive_group()
    size.add_argument(
        "--vram",
        type=_gib_or_auto,
        default=None,
        help="GPU memory in GiB to check against (e.g. 24), or auto: what is free on this machine's GPU",
    )
    size.add_argument("--gpu", default=None, help="a card by name instead of --vram (e.g. 'RTX 4090', 'RTX 3060 12GB')")
    parser.add_argument("--cards", action="store_true", help="the fastest way to run on each common card size")
    args, rest = parser.parse_known_args(argv)
    from lightning_lora.plan import (
        HEADROOM,
        card_memory,
        cards_of,
        cards_table,
        choose_for_memory,
        fitting_changes,
        larger_batches,
        plan_for,
        visible_card_memory,
    )

    try:
        if args.vram == "auto":
            free, card = visible_card_memory()
            args.vram = math.floor(free * 10) / 10  # as printed, never more than is free
            print(f"--vram auto: {args.vram:g} GiB free on {card}")
        vram = card_size(card_memory(args.gpu), f"--gpu {args.gpu!r}") if args.gpu else card_size(args.vram, "--vram")
        cli = _plan_cli(parser, rest)
        recipe, optimizer = cli.model.recipe, cli.model.optimizer_name
        trainer = cli.trainer_config
        shards = shard_count(trainer.get("strategy"), trainer.get("devices", "auto"), trainer.get("num_nodes", 1))
        data: DataRecipe = cli.datamodule.recipe
        ema = cli.ema
        copies = ema.copies if ema is not None else 0
        plan = plan_for(recipe, data, optimizer, shards=shards, ema_copies=copies)
        if ema is not None:
            plan.notes.append(ema_note(ema, plan.lora, trainer.get("max_steps")))
        print("Predicted GPU memory (lightning-lora plan):")
        print(plan.report(vram))
        if vram is not None and plan.run_peak > vram * HEADROOM:
            options = fitting_changes(recipe, data, vram, optimizer, shards, copies)
            if options:
                print("  these changes would fit:")
                print("\n".join(f"    {o}" for o in options))
            else:
                print("  lower data.resolution or data.batch_size, or use a GPU with more memory")
        elif vram is not None:
            fastest = choose_for_memory(recipe, data, vram, optimizer, shards, copies)
            if fastest is not None and fastest.flags:
                print(f"  faster, and it still fits: {fastest.line()}")
            accumulate = int(trainer.get("accumulate_grad_batches") or 1)
            larger = larger_batches(recipe, data, vram, accumulate, optimizer, shards, copies)
            if larger is not None:
                images = data.batch_size * accumulate
                print(
                    f"  or the same {images} images a step in larger batches (faster where launches bound the step: "
                    f"NF4, checkpointing, small images): {larger.line()}"
                )
        if args.cards:
            print("The fastest way to run on each card size (5% kept free):")
            for gib, fit in cards_table(recipe, data, optimizer, shards=shards, ema_copies=copies):
                names = ", ".join(cards_of(gib)[:3])
                what = fit.line() if fit else "nothing fits: lower data.resolution or data.batch_size"
                print(f"  {gib:>4} GiB  {names:<30} {what}")
    except ConfigError as e:
        return user_error("lightning-lora plan", e)
    except NotImplementedError as e:
        print(f"lightning-lora plan: {e}", file=sys.stderr)
        return USER_ERROR
    return 0
