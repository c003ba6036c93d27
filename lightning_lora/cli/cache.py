"""``lightning-lora cache --config X.yaml``: build the latent cache ahead of training, then print a summary.

It reads the same YAML as ``fit`` (and the same ``--section.option value`` overrides), builds the model, data module
and trainer objects without loading any weights (and none of the config's callbacks, logger or profiler), and asks the
data module to encode whatever is missing on the trainer's device: decoding in worker processes, a progress bar on a
terminal, one line per skipped file. The summary
says what was found, encoded, reused and skipped (with reasons), the buckets with their image counts, and the time.
``fit`` reuses everything (the keys are content hashes) and builds only what is still missing.

Exit status: 0 when done, 2 for a configuration error (wrong path, no usable image, a bad file with
``data.on_bad_file: error``) or a cache file that cannot be written (full disk, no permission), printed as one message
without a traceback; 130 after Ctrl-C. An interrupted or failed build keeps every file it finished (each is written
atomically): the same command continues where it stopped.
"""

from __future__ import annotations

import signal
import sys
from typing import Any

__all__ = ["main"]

_USAGE = """usage: lightning-lora cache --config CONFIG.yaml [--section.option VALUE ...]

Build the latent and text-embedding cache that `lightning-lora fit --config CONFIG.yaml` trains from.
Takes the same config file and overrides as `fit` (see `lightning-lora fit --help`)."""


def _device(trainer: Any) -> Any:
    import torch

    try:
        return trainer.strategy.root_device
    except Exception:  # a strategy that needs a launched process group to know its device
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def main(argv: list[str]) -> int:
    """Run the ``cache`` verb with ``argv`` (the arguments after ``cache``); return the exit status."""
    args = list(argv)
    if not args or args[0] in ("-h", "--help"):
        print(_USAGE)
        return 0 if args else 2
    from lightning_lora.callbacks.evaluation import drift_prompts
    from lightning_lora.cli.fit import UNBUILT, LoraCLI
    from lightning_lora.cli.status import interrupted, user_error
    from lightning_lora.errors import ConfigError

    class CacheCLI(LoraCLI):
        """The ``fit`` config, built for caching: the model and data, and a trainer for its device and run folder,
        without the config's callbacks, logger or profiler."""

        unbuilt = UNBUILT
        callback_entries: Any = None

        def before_instantiate_classes(self) -> None:
            config = self.config[self.subcommand] if self.subcommand else self.config
            self.callback_entries = config.get("trainer.callbacks")
            super().before_instantiate_classes()

    try:
        cli = CacheCLI(args=args, run=False)
        device = _device(cli.trainer)
        report = cli.datamodule.build_cache(
            cli.model.family,
            cli.model.source,
            device,
            preservation=cli.model.preservation,
            default_root_dir=cli.trainer.default_root_dir,
            progress=True,
        )
        prompts = drift_prompts(cli.callback_entries, cli.model.family)
        if prompts:  # what fit's FixedEvalLoss reads at its start: cached here, fit loads no text encoder for them
            cli.datamodule.cache().text_embeddings(prompts, device)
    except (ConfigError, OSError) as e:
        return user_error("lightning-lora cache", e)
    except KeyboardInterrupt:
        print(
            "\nlightning-lora cache: interrupted. Every entry finished so far is kept; run the same command again to "
            "continue (it encodes only what is missing).",
            file=sys.stderr,
        )
        return interrupted(signal.SIGINT)
    print(report.format(), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
