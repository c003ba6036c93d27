"""The config parser of every verb: Lightning's, with each parse failure as one line and ``--print_config=skip_default``
working for every optimizer.

jsonargparse reports a problem by printing the whole usage (110 lines for ``fit``) before the error, and its errors
name types the way Python spells them. :class:`ConfigParser` raises a :class:`~lightning_lora.errors.ConfigError`
instead (printed as one line, exit status 2, by each verb), worded by :func:`parse_problem`:

* an unknown key, in a config file or on the command line: the key, and the closest option of the parser
  (``model.lora.rnak: no such option; did you mean model.lora.rank?``, :mod:`difflib` over every key the parser
  knows, or over the ``init_args`` of the class a ``class_path`` names);
* a value of the wrong type: the option, the value and what it takes (``model.lora.rank: 'abc' is not an int``; for
  a choice, the choices and the closest one);
* a class a config may not name (:func:`~lightning_lora.cli.class_paths.class_path_problem`);
* anything else: jsonargparse's message on one line.

``--print_config=skip_default`` compares each ``class_path`` of the config with the default's. jsonargparse builds a
parser of a class that differs from the default without leaving out the arguments the option supplies itself (an
optimizer's ``params``): for a class whose first argument has no type annotation, such as bitsandbytes'
``AdamW8bit``, that fails with a traceback. :meth:`ConfigParser._dump_delete_default_entries` compares such a class
with the defaults of its other arguments.
"""

from __future__ import annotations

import argparse
import difflib
import inspect
import re
import types
import typing
from typing import Any, NoReturn

from lightning.pytorch.cli import LightningArgumentParser

from lightning_lora.cli.class_paths import class_path_problem, trusted
from lightning_lora.cli.help import HelpFormatter
from lightning_lora.errors import ConfigError

__all__ = ["ConfigParser", "describe_type", "option_names", "parse_problem"]

HELP_HINT = "lightning-lora fit --help lists every option"

_NOT_OPTIONS = {"help", "config", "print_config", argparse.SUPPRESS}


def option_names(parser: Any) -> dict[str, argparse.Action]:
    """Every option ``parser`` takes (its subcommands' included, without the subcommand's name: jsonargparse's messages
    name keys that way) -> its action."""
    from jsonargparse import ActionSubCommands

    names: dict[str, argparse.Action] = {}
    for action in parser._actions:  # noqa: SLF001 - argparse keeps its actions there
        if isinstance(action, ActionSubCommands):
            for sub in action.choices.values():
                names.update(option_names(sub))
        elif action.dest not in _NOT_OPTIONS and not action.dest.endswith(".help"):
            names[action.dest] = action
    return names


def _close(word: str, candidates: list[str]) -> str | None:
    found = difflib.get_close_matches(word, candidates, n=1, cutoff=0.6)
    return found[0] if found else None


def _unknown(key: str, known: list[str], where: str = "") -> str:
    match = _close(key, known)
    if match is None and "." in key:  # a typo in the last part: compare with the options of the same section
        parent, leaf = key.rsplit(".", 1)
        siblings = [
            k.rsplit(".", 1)[1] for k in known if k.startswith(parent + ".") and "." not in k[len(parent) + 1 :]
        ]
        leaf_match = _close(leaf, siblings)
        match = f"{parent}.{leaf_match}" if leaf_match else None
    hint = f"; did you mean {match}?" if match else ""
    return f"{key}: no such option{where}{hint} ({HELP_HINT})."


_PLAIN = {int: "an int", float: "a number", str: "text", bool: "true or false"}


def describe_type(typehint: Any) -> str:
    """A type annotation in words: ``int`` -> ``an int``, ``int | list[int]`` -> ``an int or a list of ints``,
    ``Literal['a', 'b']`` -> ``one of a, b``, ``Optional[X]`` -> ``X or null``."""
    origin = typing.get_origin(typehint)
    args = typing.get_args(typehint)
    if origin is typing.Literal:
        return "one of " + ", ".join(str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        kept = [a for a in args if a is not type(None)]
        words = " or ".join(describe_type(a) for a in kept)
        return f"{words} or null" if len(kept) < len(args) else words
    if origin in (list, tuple, set) and args:
        inner = describe_type(args[0])
        return f"a list of {re.sub(r'^(an?|one of) ', '', inner)}s" if inner.startswith(("a ", "an ")) else "a list"
    if typehint in _PLAIN:
        return _PLAIN[typehint]
    return getattr(typehint, "__name__", str(typehint))


_KEY = re.compile(r'Parser key "([\w.]+)"')
_VALUE = re.compile(r"(?:Got|Given) value: (.*)$", re.M)
_NOT_ACCEPTED = re.compile(r"(?:Subcommand '[\w-]+'|Group '([\w.]+)') does not accept (?:nested key|option) '([\w.]+)'")
_UNRECOGNIZED = re.compile(r"unrecognized arguments: .*?--([\w.]+)")
_INIT_ARG = re.compile(r"Option '(\w+)' is not accepted")
_CLASS_PATH = re.compile(r"class_path='([\w.]+)'")
_REQUIRED = re.compile(r'Key "([\w.]+)" is required')
_MISSING = re.compile(r"the following arguments are required: ([\w., ]+)")


def _init_args(class_path: str) -> list[str]:
    """The argument names of the class ``class_path`` names (a trusted one only: nothing else is imported)."""
    if not trusted(class_path):
        return []
    from lightning_lora.cli.class_paths import _resolve

    try:
        parameters = inspect.signature(_resolve(class_path)).parameters
    except (ImportError, AttributeError, TypeError, ValueError):
        return []
    return [name for name, p in parameters.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def parse_problem(message: str, options: dict[str, argparse.Action]) -> str:
    """The one line for jsonargparse's error ``message`` (see the module docstring); ``options`` are the parser's
    (:func:`option_names`)."""
    known = list(options)
    found = _NOT_ACCEPTED.search(message)
    if found:
        return _unknown(".".join(p for p in found.groups() if p), known)
    found = _UNRECOGNIZED.search(message)
    if found:
        return _unknown(found.group(1), known)
    key = _KEY.search(message)
    if key is not None:
        option = key.group(1)
        init_arg, class_path = _INIT_ARG.search(message), _CLASS_PATH.search(message)
        if init_arg and class_path:
            name, path = init_arg.group(1), class_path.group(1)
            match = _close(name, _init_args(path))
            hint = f"did you mean {match}? " if match else ""
            return f"{option}.init_args.{name}: {path} takes no option {name}; {hint}({HELP_HINT})."
        value = _VALUE.search(message)
        action = options.get(option)
        typehint = getattr(action, "_typehint", None)
        if value is not None and typehint is not None:
            expected = describe_type(typehint)
            given = value.group(1).strip()
            line = f"{option}: {given!r} is not {expected}"
            match = (
                _close(given, [str(a) for a in typing.get_args(typehint)]) if expected.startswith("one of ") else None
            )
            return f"{line}; did you mean {match}?" if match else f"{line}."
    found = _REQUIRED.search(message) or _MISSING.search(message)
    if found:
        missing = [re.sub(r"^fit\.", "", name.strip()) for name in found.group(1).split(",")]
        return (
            f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} required: give a config file that sets "
            f"{'it' if len(missing) == 1 else 'them'} (--config X.yaml; configs/ has one per card and family) or "
            f"--{missing[0]} ... on the command line."
        )
    text = " ".join(line.strip() for line in message.splitlines() if line.strip())
    return f"{text} ({HELP_HINT})."


class ConfigParser(LightningArgumentParser):
    """Lightning's parser, with every parse failure as one line (a :class:`ConfigError`: :func:`parse_problem`, a
    refused class path: :func:`~lightning_lora.cli.class_paths.class_path_problem`) instead of the usage screen, the
    help as plain text (:class:`~lightning_lora.cli.help.HelpFormatter`), and ``skip_default`` for every optimizer
    (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        # A parser of a class's init_args (exit_on_error False) raises for the enclosing parser, which reports it.
        if not self.exit_on_error:
            super().error(message, ex)
        raise ConfigError(class_path_problem(message) or parse_problem(message, option_names(self)))

    def _dump_delete_default_entries(self, subcfg: dict[str, Any], subdefaults: dict[str, Any]) -> None:
        """jsonargparse's, except for a ``class_path`` that differs from the default's and whose class parser it cannot
        build (see the module docstring): its ``init_args`` are compared with the class's own defaults here."""
        from jsonargparse._typehints import ActionTypeHint, is_subclass_spec

        for key, value in subcfg.items():
            default = subdefaults.get(key)
            if key not in subdefaults or not is_subclass_spec(value):
                continue
            if isinstance(default, dict) and default.get("class_path") == value["class_path"]:
                continue
            try:
                ActionTypeHint.get_class_parser(value["class_path"])
                continue  # jsonargparse compares it
            except ValueError:
                pass
            try:  # without its first argument, as the option calls it (an optimizer's params)
                parser = ActionTypeHint.get_class_parser(value["class_path"], skip_args={1})
                defaults = parser.get_defaults().as_dict()
            except ValueError:
                defaults = {}
            del subdefaults[key]  # the class_path is not the default's: it stays
            init_args = value.get("init_args")
            if init_args == defaults:
                value.pop("init_args", None)
            elif isinstance(init_args, dict):
                self._dump_delete_default_entries(init_args, defaults)
                if not init_args:
                    value.pop("init_args")
        super()._dump_delete_default_entries(subcfg, subdefaults)
