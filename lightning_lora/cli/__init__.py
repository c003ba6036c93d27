"""The ``lightning-lora`` command: one entry point and a table of verbs.

* ``lightning-lora fit|validate|--help ...`` is Lightning's CLI with our defaults (:mod:`lightning_lora.cli.fit`);
* ``lightning-lora cache --config X.yaml`` builds the latent cache ahead of training (:mod:`lightning_lora.cli.cache`);
* ``lightning-lora plan --config X.yaml [--vram 24]`` predicts peak GPU memory (:mod:`lightning_lora.cli.plan`);
* ``lightning-lora export CKPT --format kohya --out F`` writes a checkpoint's LoRA (:mod:`lightning_lora.cli.export`).

The other entry point, ``python -m lightning_lora.cli.demo``, prepares the CPU demo (:mod:`lightning_lora.cli.demo`).
This package is the top layer: nothing else in ``lightning_lora`` imports from it. A verb module exposes
``main(argv) -> int`` (the exit status: 0 done, 2 a problem the user can fix, printed as one line, 130 / 143 after
Ctrl-C / SIGTERM: :mod:`lightning_lora.cli.status`) and is imported only when its verb runs.
"""

from __future__ import annotations

import importlib
import sys
import warnings

__all__ = ["VERBS", "main"]

VERBS: dict[str, str] = {
    "cache": "lightning_lora.cli.cache",
    "plan": "lightning_lora.cli.plan",
    "export": "lightning_lora.cli.export",
}
"""Our verbs -> the module whose ``main(argv)`` runs it; any other first argument goes to :mod:`.fit`."""


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``lightning-lora`` command; exits with the verb's status."""
    args = sys.argv[1:] if argv is None else list(argv)
    from lightning_lora.cli.peek import config_allocator
    from lightning_lora.hardware import set_allocator_defaults

    set_allocator_defaults(choice=config_allocator(args))  # before anything touches the GPU
    # A file name with a byte that is not UTF-8 must not crash a print under a strict UTF-8 locale.
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="backslashreplace")
    # The verbs hand LightningCLI their own arguments on purpose (sys.argv still starts with the verb).
    warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
    # diffusers 0.42's ChromaTransformer2DModel builds FLUX's position embedding through a deprecated import: a note
    # for diffusers' developers, not for someone planning or training Chroma.
    warnings.filterwarnings("ignore", message="`FluxPosEmbed` is deprecated", category=FutureWarning)
    if args[:1] and args[0] in VERBS:
        from lightning_lora.cli.console import quiet_library_loggers

        quiet_library_loggers()  # no run folder to log to: their notes would only bury the verb's output
        verb = importlib.import_module(VERBS[args[0]])
        raise SystemExit(verb.main(args[1:]))
    from lightning_lora.cli.fit import main as fit

    # ``argv`` as given: None lets LightningCLI read sys.argv itself (its --help shows the program's name).
    status = fit(argv)
    if status:
        raise SystemExit(status)
