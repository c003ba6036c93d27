"""What ``lightning-lora fit --help`` shows, and the Trainer options it refuses.

The ``fit`` parser is LightningCLI's: every argument of ``Trainer``, ``LoraModule`` and ``LatentDataModule``, with the
docstrings as help. Three things make that help ours:

* **Plain text.** The help strings come from docstrings written in reST (````x````, ``:class:`~a.B```, ```text
  <url>`_``); :func:`plain_text` turns them into what a terminal shows, in one place: the help formatter
  (:class:`HelpFormatter`) of every parser of the command, which also lists only the classes a config may name
  (:func:`~lightning_lora.cli.class_paths.trusted`) after "known subclasses".
* **Only what means something here** (:func:`tailor_fit_parser`). About twenty Trainer options are about Lightning's
  validation, test and predict loops, which a LoRA run does not use (its evaluation is a callback), or are debugging
  switches: they are hidden (:data:`HIDDEN`) and stay settable. Those that would break a run are refused when the
  config is parsed, in one line (:data:`REFUSED`, :func:`check_refused`).
* **Our texts** (:data:`OUR_HELP`) for the options whose meaning lightning-lora changes: ``--ckpt_path`` (``last`` is
  the newest valid checkpoint of the run folder, :func:`~lightning_lora.checkpoint.resolve_resume`), the run folder,
  the precision plugins.
"""

from __future__ import annotations

import argparse
import importlib
import re
from collections.abc import Callable
from typing import Any, NoReturn

from jsonargparse import DefaultHelpFormatter

from lightning_lora.errors import ConfigError

__all__ = [
    "FIT_DESCRIPTION",
    "HIDDEN",
    "OUR_HELP",
    "REFUSED",
    "HelpFormatter",
    "VerbParser",
    "check_refused",
    "plain_text",
]

FIT_DESCRIPTION = (
    "Train a LoRA adapter: lightning-lora fit --config configs/<card>.yaml [--section.option value ...]. Every "
    "option below can be set in the YAML file (section: {option: value}) or on the command line; "
    "--print_config shows the result."
)

HIDDEN = (
    "trainer.fast_dev_run",
    "trainer.min_epochs",
    "trainer.min_steps",
    "trainer.limit_train_batches",
    "trainer.limit_val_batches",
    "trainer.limit_test_batches",
    "trainer.limit_predict_batches",
    "trainer.overfit_batches",
    "trainer.val_check_interval",
    "trainer.check_val_every_n_epoch",
    "trainer.num_sanity_val_steps",
    "trainer.enable_model_summary",
    "trainer.benchmark",
    "trainer.inference_mode",
    "trainer.use_distributed_sampler",
    "trainer.detect_anomaly",
    "trainer.barebones",
    "trainer.sync_batchnorm",
    "trainer.reload_dataloaders_every_n_epochs",
    "trainer.enable_autolog_hparams",
    "trainer.model_registry",
    "weights_only",
)
"""Options ``fit --help`` does not show: Lightning's validation / test / predict loops (a LoRA run evaluates in a
callback), debugging switches, the model table (the start summary replaces it), Lightning's model registry. They can
still be set, except those of :data:`REFUSED`."""


def _truthy(value: Any) -> bool:
    return bool(value) and value != 0


REFUSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "trainer.fast_dev_run": (
        _truthy,
        "{option}: {value}: Lightning's debugging run switches off checkpoints and logging, which a lightning-lora "
        "run needs; for a quick try set --trainer.max_steps 2 and another trainer.default_root_dir.",
    ),
    "trainer.barebones": (
        _truthy,
        "{option}: {value}: it switches off checkpoints, logging and the progress bar, which a lightning-lora run "
        "needs; leave it false.",
    ),
    "trainer.overfit_batches": (
        _truthy,
        "{option}: {value}: it would replace lightning-lora's bucket sampler; to train on a few images, point "
        "data.images at a folder that holds just those.",
    ),
    "trainer.use_distributed_sampler": (
        _truthy,
        "{option}: {value} would replace lightning-lora's bucket sampler, which already gives each GPU its share of "
        "every batch (one aspect-ratio bucket per step); leave it false.",
    ),
    "weights_only": (
        lambda value: value is False,
        "--{option} {value}: lightning-lora reads checkpoints as data only (torch.load with weights_only=True), never "
        "as code; leave it out.",
    ),
}
"""Options a lightning-lora run cannot take: ``option -> (is the value refused, the message)``, checked right after
parsing (:func:`check_refused`); the message names the option and the value (``{option}``, ``{value}``)."""

OUR_HELP: dict[str, str] = {
    "ckpt_path": "continue a run: 'last' is the newest valid checkpoint in the run folder's checkpoints/ (by the time "
    "each was saved; a truncated or unreadable one is skipped with a warning), or a fresh start if there is none; or a "
    "path to a .ckpt written by lightning-lora fit (its LoRA settings and base model must match the config; the "
    "config's other settings apply). Without it a run starts from step 0, and a run folder that already holds "
    "checkpoints is refused.",
    "seed_everything": "the seed of every random choice (an int; true: a random seed). A resumed run restores the "
    "random state it saved.",
    "trainer.default_root_dir": "the run folder: config.yaml, checkpoints/, lora/ (the LoRA files), samples/, the "
    "TensorBoard logs and lightning-lora.log (the libraries' messages).",
    "trainer.max_steps": "the run length in optimizer steps (a step is data.batch_size x "
    "trainer.accumulate_grad_batches images per device); -1: trainer.max_epochs ends the run.",
    "trainer.precision": "the frozen base's dtype: bf16-mixed (default), 16-mixed (GPUs without bf16) or 32-true (the "
    "CPU); for an FP8 or NF4 base use trainer.plugins instead.",
    "trainer.plugins": "the frozen base's format, as a precision plugin: lightning_lora.precision.BF16, FP8, "
    "FP8Compute or NF4 (init_args: dtype, skip...); also Lightning's checkpoint IO and cluster environments.",
    "trainer.enable_progress_bar": "the progress bar in optimizer steps (loss, learning rate, time left); in a log "
    "file (not a terminal) a line every tenth of the run.",
}
"""Help texts of options whose meaning lightning-lora sets (the rest keep their docstrings, as plain text)."""

GROUP_TITLES = {
    "trainer": "The run (Lightning's Trainer): devices, precision, length, logging, checkpoints",
    "fit": "Continuing a run",
}

# reST -> plain text, in the order applied.
_ROLE_WITH_TARGET = re.compile(r":[\w:]+:`([^`<]*?)\s*<[^`>]*>`")  # :ref:`the CLI docs <lightning-cli>` -> the CLI docs
_ROLE = re.compile(r":[\w:]+:`~?([^`]*)`")  # :class:`~a.b.C` -> C (below), :mod:`a.b` -> a.b
_LINK = re.compile(r"`([^`<]+?)\s*<([^`>]+)>`__?")  # `text <url>`_ -> text (url)
_LITERAL = re.compile(r"``(.+?)``")
_REFERENCE = re.compile(r"`([^`]+)`_{0,2}")
_STRONG = re.compile(r"\*\*(.+?)\*\*")


def _short_role(match: re.Match[str]) -> str:
    text = match.group(0)
    target = match.group(1)
    return target.rsplit(".", 1)[-1] if "`~" in text else target


def plain_text(text: str) -> str:
    """A docstring's reST as plain text: ````x```` -> ``x``, ``:class:`~a.B``` -> ``B``, ``:mod:`a.b``` -> ``a.b``,
    ```text <url>`_`` -> ``text (url)``, ``**x**`` -> ``x``, ```x``` -> ``x``.

    >>> plain_text("``last`` or :class:`~lightning_lora.callbacks.LoraExport` (:mod:`lightning_lora.cli`)")
    'last or LoraExport (lightning_lora.cli)'
    """
    text = _ROLE_WITH_TARGET.sub(r"\1", text)
    text = _ROLE.sub(_short_role, text)
    text = _LINK.sub(r"\1 (\2)", text)
    text = _LITERAL.sub(r"\1", text)
    text = _REFERENCE.sub(r"\1", text)
    return _STRONG.sub(r"\1", text)


_KNOWN = re.compile(r", known subclasses: ([^)]*)\)$", re.S)

LISTED_PACKAGES = ("torch", "lightning", "lightning_lora")
"""The packages whose classes the help lists after "known subclasses" (jsonargparse lists the subclasses defined so
far): these are imported whenever the help is shown (lightning-lora's modules a config may name classes from by
:func:`_import_listed`). An extra's classes (bitsandbytes' optimizers, prodigyopt's) would be listed only when
something had imported it, 40 lines of bitsandbytes; the options' own texts name them."""


def _import_listed() -> None:
    """Import the modules of lightning-lora a config may name classes from (its optimizers and schedules are not
    imported by the parser), so the help lists their classes every time."""
    from lightning_lora.cli.class_paths import TRUSTED_MODULES

    for module in TRUSTED_MODULES:
        if module.split(".")[0] == "lightning_lora":
            importlib.import_module(module)


def _trusted_only(help_text: str) -> str:
    """The help string with only the classes a config may name after "known subclasses", of :data:`LISTED_PACKAGES`
    (none: the list is left out)."""
    from lightning_lora.cli.class_paths import trusted

    match = _KNOWN.search(help_text)
    if match is None:
        return help_text
    names = [
        n.strip()
        for n in match.group(1).split(",")
        if trusted(n.strip()) and n.split(".")[0].strip() in LISTED_PACKAGES
    ]
    listed = f", known subclasses: {', '.join(names)}" if names else ""
    return help_text[: match.start()] + listed + ")"


class HelpFormatter(DefaultHelpFormatter):
    """jsonargparse's help, as plain text (:func:`plain_text`), with only trusted classes listed, the same ones every
    time (:data:`LISTED_PACKAGES`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _import_listed()

    def _get_help_string(self, action: argparse.Action) -> str:
        return _trusted_only(plain_text(super()._get_help_string(action)))

    def _format_text(self, text: str) -> str:
        return super()._format_text(plain_text(text))

    def start_section(self, heading: str | None) -> None:
        super().start_section(plain_text(heading) if heading else heading)


def tailor_fit_parser(parser: Any) -> None:
    """Make LightningCLI's ``fit`` parser ours (see the module docstring): hide :data:`HIDDEN`, set :data:`OUR_HELP`,
    retitle the Trainer's and the resume options' groups."""
    parser.description = FIT_DESCRIPTION
    for action in parser._actions:  # noqa: SLF001 - argparse keeps its actions there
        if action.dest in HIDDEN:
            action.help = argparse.SUPPRESS
        elif action.dest in OUR_HELP:
            action.help = OUR_HELP[action.dest]
    for name, title in GROUP_TITLES.items():
        group = getattr(parser, "groups", {}).get(name)
        if group is not None:
            group.title = title
            group.description = None


def check_refused(config: Any) -> None:
    """A :class:`ConfigError` for the first :data:`REFUSED` option ``config`` (the ``fit`` section) sets to a value a
    run cannot take."""
    for option, (refused, why) in REFUSED.items():
        value = _get(config, option)
        if refused(value):
            shown = str(value).lower() if isinstance(value, bool) else value
            raise ConfigError(why.format(option=option, value=shown))


def _get(config: Any, option: str) -> Any:
    try:
        return config.get(option) if hasattr(config, "get") else None
    except (KeyError, AttributeError):
        return None


class VerbParser(argparse.ArgumentParser):
    """argparse's parser of a verb's own arguments (``plan``'s, ``export``'s), with its errors as one line
    (``lightning-lora export: error: --fromat: no such option; did you mean --format?``) instead of the usage screen
    and the error, as the config parser's (:class:`~lightning_lora.cli.parser.ConfigParser`); exit status 2."""

    def close_option(self, name: str) -> str | None:
        """The option of this parser closest to the unknown ``--name`` (a typo), or None."""
        import difflib

        options = [o.removeprefix("--") for o in self._option_string_actions if o.startswith("--")]
        found = difflib.get_close_matches(name.removeprefix("--"), options, n=1, cutoff=0.6)
        return f"--{found[0]}" if found else None

    def parse_args(self, args: Any = None, namespace: Any = None) -> Any:
        """argparse's, with an unknown option said first (argparse says a required option is missing first when it
        is the typo: ``--fromat kohya`` read "the following arguments are required: --format")."""
        for arg in [] if args is None else list(args):
            name = str(arg).split("=", 1)[0]
            if (
                name.startswith("--")
                and name != "--"
                and not any(o.startswith(name) for o in self._option_string_actions)
            ):
                self.error(f"unrecognized arguments: {name}")
        return super().parse_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        unknown = re.match(r"unrecognized arguments: .*?(--[\w.-]+)", message)
        if unknown:
            name = unknown.group(1)
            close = self.close_option(name)
            message = f"{name}: no such option" + (f"; did you mean {close}?" if close else "")
        self.exit(2, f"{self.prog}: error: {message} ({self.prog} --help).\n")
