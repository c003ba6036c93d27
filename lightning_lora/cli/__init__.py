"""The ``lightning-lora`` command: one entry point and a table of verbs.

* ``lightning-lora fit --config X.yaml`` trains: Lightning's CLI with our defaults (:mod:`lightning_lora.cli.fit`);
* ``lightning-lora cache --config X.yaml`` builds the latent cache ahead of training (:mod:`lightning_lora.cli.cache`);
* ``lightning-lora plan --config X.yaml [--vram 24]`` predicts peak GPU memory (:mod:`lightning_lora.cli.plan`);
* ``lightning-lora export CKPT --format kohya --out F`` writes a checkpoint's LoRA (:mod:`lightning_lora.cli.export`).

``lightning-lora --help`` prints this table (:data:`ABOUT`) and ``--version`` the installed version, both without
importing the training stack. Lightning's other subcommands (``validate``, ``test``, ``predict``) do not apply to a
LoRA run and are refused in one line naming what to use (:data:`NOT_VERBS`).

The other entry point, ``python -m lightning_lora.cli.demo``, prepares the CPU demo (:mod:`lightning_lora.cli.demo`).
This package is the top layer: nothing else in ``lightning_lora`` imports from it. A verb module exposes
``main(argv) -> int`` (the exit status: 0 done, 2 a problem the user can fix, printed as one line, 130 / 143 after
Ctrl-C / SIGTERM: :mod:`lightning_lora.cli.status`) and is imported only when its verb runs. Every verb runs under the
console routing of :mod:`lightning_lora.cli.console` (library chatter off the screen, our lines on stdout).
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import warnings

__all__ = ["ABOUT", "NOT_VERBS", "VERBS", "main", "usage"]

VERBS: dict[str, str] = {
    "cache": "lightning_lora.cli.cache",
    "plan": "lightning_lora.cli.plan",
    "export": "lightning_lora.cli.export",
}
"""Our verbs -> the module whose ``main(argv)`` runs it; any other first argument goes to :mod:`.fit`."""

ABOUT: dict[str, str] = {
    "fit": "train a LoRA: fit --config configs/<card>.yaml (after a stop: add --ckpt_path last)",
    "plan": "predict peak GPU memory and what fits a card: plan --config X.yaml --vram 24 (no GPU, no weights)",
    "cache": "encode the images and captions ahead of training: cache --config X.yaml",
    "export": "write a checkpoint's LoRA, or convert a LoRA file: export last.ckpt --format kohya --out F.safetensors",
}
"""What each verb does, for ``lightning-lora --help``."""

NOT_VERBS: dict[str, str] = {
    "validate": "the fixed evaluation loss (and a held-out one with data.val_images) is measured while `fit` trains",
    "test": "the fixed evaluation loss (and a held-out one with data.val_images) is measured while `fit` trains",
    "predict": "to make images with a trained LoRA, load its file in diffusers or ComfyUI (`lightning-lora export` "
    "writes other layouts); `fit` draws samples while training (lightning_lora.callbacks.SampleImages)",
}
"""Lightning's subcommands that do not apply to a LoRA run -> what to use instead."""


def usage() -> str:
    """The top-level help: the verb table."""
    import lightning_lora

    rows = "\n".join(f"  {verb:<8}{about}" for verb, about in ABOUT.items())
    summary = " ".join((lightning_lora.__doc__ or "").split("\n\n")[0].split()).removeprefix("lightning-lora: ")
    return (
        "usage: lightning-lora <command> [options]\n\n"
        f"{summary[:1].upper()}{summary[1:]}\n\n"
        f"commands:\n{rows}\n\n"
        "options:\n  -h, --help  this table; lightning-lora <command> --help: the command's options\n"
        "  --version   the installed version\n\n"
        "The CPU demo: make demo (a tiny model, real photos, about a minute)."
    )


def _top_level(args: list[str]) -> int | None:
    """The exit status of what the first argument settles without a verb (help, version, a command that is not one),
    printed; None for a verb's arguments."""
    first = args[0] if args else None
    if first is None or first in ("-h", "--help"):
        print(usage())
        return 0 if first else 2
    if first == "--version":
        from lightning_lora import __version__

        print(f"lightning-lora {__version__}")
        return 0
    if first in NOT_VERBS:
        print(f"lightning-lora: error: {first} is not a lightning-lora command: {NOT_VERBS[first]}.", file=sys.stderr)
        return 2
    if first.startswith("-"):
        print(
            f"lightning-lora: error: {first}: a command comes first, then its options (lightning-lora fit "
            f"{' '.join(args)}); the commands are {', '.join(ABOUT)} (lightning-lora --help).",
            file=sys.stderr,
        )
        return 2
    if first != "fit" and first not in VERBS:
        import difflib

        close = difflib.get_close_matches(first, [*ABOUT], n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        print(
            f"lightning-lora: error: '{first}' is not a lightning-lora command; {hint}choose one of "
            f"{', '.join(ABOUT)} (lightning-lora --help).",
            file=sys.stderr,
        )
        return 2
    return None


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``lightning-lora`` command; exits with the verb's status. When the reader of its output
    goes away (``lightning-lora fit --help | head``), it stops as other commands do: no traceback, exit status 141
    (SIGPIPE's, :func:`~lightning_lora.cli.status.interrupted`)."""
    try:
        _main(argv)
    except BrokenPipeError:
        import os
        import signal

        from lightning_lora.cli.status import interrupted

        with contextlib.suppress(OSError, ValueError):  # nothing more to write: Python's flush at exit would fail too
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(interrupted(signal.SIGPIPE)) from None


def _main(argv: list[str] | None) -> None:
    args = sys.argv[1:] if argv is None else list(argv)
    settled = _top_level(args)
    if settled is not None:
        raise SystemExit(settled)
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
        from lightning_lora.cli.console import Console, quiet_library_loggers

        quiet_library_loggers()  # no run log after the verb either: the libraries' notes would only bury its output
        verb = importlib.import_module(VERBS[args[0]])
        with Console():  # the libraries' chatter goes to the run log (cache) or nowhere (plan, export)
            status = verb.main(args[1:])
        raise SystemExit(status)
    from lightning_lora.cli.fit import main as fit

    # ``argv`` as given: None lets LightningCLI read sys.argv itself (its --help shows the program's name).
    status = fit(argv)
    if status:
        raise SystemExit(status)
