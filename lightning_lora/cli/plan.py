"""``lightning-lora plan --config X.yaml [--vram 24]``: predicted peak GPU memory, and what would make it fit.

Reads the same YAML as ``fit`` (any ``fit`` option can follow, e.g. ``--model.lora.rank 32``), builds the model on
the meta device (no weights are read; for a hub id only its config file), and prints the memory by component.
With ``--vram``, it says whether the run fits and which changes would make it fit. The planning itself is the
library's (:mod:`lightning_lora.plan`); this module only reads the config and prints.
"""

from __future__ import annotations

import argparse

from lightning_lora.errors import ConfigError

__all__ = ["main"]


def main(argv: list[str]) -> int:
    """Run ``lightning-lora plan`` with ``argv`` (the arguments after ``plan``); return the exit status."""
    parser = argparse.ArgumentParser(prog="lightning-lora plan", description=__doc__)
    parser.add_argument("--vram", type=float, default=None, help="GPU memory in GiB to check against (e.g. 24)")
    args, rest = parser.parse_known_args(argv)
    from lightning_lora.cli.fit import LoraCLI
    from lightning_lora.plan import fitting_changes, plan_for

    try:
        cli = LoraCLI(args=rest, run=False)
        recipe, optimizer = cli.model.recipe, cli.model.optimizer_name
        plan = plan_for(recipe, cli.datamodule, optimizer)
    except ConfigError as e:
        print(f"lightning-lora plan: error: {e}")
        return 2
    except NotImplementedError as e:
        print(f"lightning-lora plan: {e}")
        return 2
    print("Predicted GPU memory (lightning-lora plan):")
    print(plan.report(args.vram))
    if args.vram is not None and plan.peak_gib > args.vram * 0.95:
        options = fitting_changes(recipe, cli.datamodule, args.vram, optimizer)
        if options:
            print("  these changes would fit:")
            print("\n".join(f"    {o}" for o in options))
        else:
            print("  lower data.resolution or data.batch_size, or use a GPU with more memory")
    return 0
