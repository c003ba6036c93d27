"""What a config may name: classes of the kind each option takes, from modules lightning-lora trusts.

A ``class_path`` in a config (``model.optimizer: {class_path: torch.optim.AdamW, init_args: {lr: 1e-4}}``), like an
import path given where a callable is expected, is resolved by jsonargparse: it imports the named module, and when the
config is instantiated it calls the named object with the ``init_args``. Importing a module runs its top-level code and
calling a function runs it, so a config that could name anything could run any command (``class_path: os.system,
init_args: {command: ...}``), in ``plan`` and ``cache`` as in ``fit``. Two checks stand in the way, and either stops the
command with one line naming the option (a :class:`~lightning_lora.errors.ConfigError`, exit status 2) before anything
the config names is instantiated or called:

* **What may be imported** (:func:`apply_import_policy`, while the config is parsed, before each import): only paths
  under :data:`TRUSTED_MODULES` (where the optimizers, learning-rate schedules, callbacks, loggers, Lightning plugins,
  strategies, accelerators, profilers and model families are defined) and the modules the user lists in the environment
  variable ``LIGHTNING_LORA_ALLOW_IMPORTS`` (comma-separated, e.g. ``my_lab.optim``; a config cannot set it), and the
  names directly in the packages above them (``transformers.Adafactor``: jsonargparse's own spelling of a class), never
  another module of those packages. This is jsonargparse's import-path policy (``*`` denied, these allowed), which also
  checks the module an object is defined in: ``torch.optim.optimizer.torch.load`` names ``torch.serialization.load``
  and is refused. A ``class_path`` under a parameter typed ``Any`` is kept as data, never instantiated
  (``instantiate_subclass_spec_in_any=False``). What remains nameable where a trusted class takes a callable (such as
  Lightning's ``LambdaCallback``) is a function defined in a trusted module or in the top module of a package above one
  (``torch.set_default_device``), which Lightning calls with its own arguments: no command, no file to load.
* **What may be instantiated** (:func:`check_class_paths`, after parsing): every ``class_path`` names a class, never a
  function (jsonargparse would call a function named as the ``class_path`` of a callable option such as
  ``model.optimizer``), of the kind its option takes (:func:`kinds`): a ``torch.optim.Optimizer`` subclass for
  ``model.optimizer``, a learning-rate scheduler for ``model.scheduler``, a model family, a callback, a logger, a
  Lightning plugin... The same holds for every ``class_path`` nested in ``init_args``.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import os
import pkgutil
import re
from collections.abc import Iterator
from typing import Any

from lightning_lora.errors import ConfigError

__all__ = [
    "ALLOW_ENV",
    "TRUSTED_MODULES",
    "apply_import_policy",
    "check_class_paths",
    "class_path_problem",
    "kinds",
    "trusted",
]

ALLOW_ENV = "LIGHTNING_LORA_ALLOW_IMPORTS"
"""The environment variable that lists more modules a config may name classes from (comma-separated)."""

TRUSTED_MODULES: tuple[str, ...] = (
    "torch.optim",  # optimizers and learning-rate schedules
    "bitsandbytes.optim",  # 8-bit and paged optimizers (the bnb extra)
    "transformers.optimization",  # Adafactor
    "prodigyopt",  # Prodigy (the prodigy extra)
    "lightning_lora.families",
    "lightning_lora.callbacks",
    "lightning_lora.precision",
    "lightning_lora.schedules",
    "lightning_lora.optimizers",
    "lightning_lora.data.sources",  # ImageFolder: jsonargparse writes a data.images entry as a class_path too
    "lightning.pytorch.callbacks",
    "lightning.pytorch.loggers",
    "lightning.pytorch.plugins",
    "lightning.pytorch.strategies",
    "lightning.pytorch.accelerators",
    "lightning.pytorch.profilers",
    "lightning.fabric.plugins",  # where lightning.pytorch.plugins' cluster environments and checkpoint IO are defined
)
"""The modules (and their submodules) a config may name classes from. Each holds classes of the kinds of
:func:`kinds` and runs nothing but definitions when imported."""

_TRUSTED_IN_WORDS = (
    "torch.optim, bitsandbytes.optim, transformers.optimization, prodigyopt, lightning_lora and Lightning's callbacks, "
    "loggers, plugins, strategies, accelerators and profilers"
)

_applied: set[str] = set()
"""Every entry a policy applied in this process has set (jsonargparse keeps them; the next policy overrides each)."""


def _submodules(package: str) -> list[str]:
    """The names of the modules directly in ``package``, read from its folder (nothing is imported but the packages
    above it)."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return []
    if spec is None or spec.submodule_search_locations is None:
        return []
    return [info.name for info in pkgutil.iter_modules(spec.submodule_search_locations)]


@functools.lru_cache(maxsize=8)
def _policy(modules: tuple[str, ...]) -> tuple[frozenset[str], frozenset[str]]:
    """``(allowed, denied)`` import-path entries that let a value name what lies in ``modules`` and nothing else.

    jsonargparse writes a class under its shortest import path (``transformers.optimization.Adafactor`` becomes
    ``transformers.Adafactor``, ``lightning_lora.families.Flux`` becomes ``lightning_lora.Flux``) and checks that path
    again, so the packages above each module are allowed too, with every other module in them denied: a name directly
    in ``transformers`` imports nothing new, and what it names must still be defined in a trusted module (jsonargparse
    checks the defining module's path as well)."""
    allowed, denied = set(modules), set()
    parents = {".".join(m.split(".")[:i]) for m in modules for i in range(1, len(m.split(".")))} - allowed
    for parent in parents:
        allowed.add(parent)
        for name in _submodules(parent):
            child = f"{parent}.{name}"
            if not any(m == child or m.startswith(child + ".") for m in modules):
                denied.add(child)
    return frozenset(allowed), frozenset(denied)


def _current_policy() -> tuple[frozenset[str], frozenset[str]]:
    return _policy((*TRUSTED_MODULES, *_env_modules()))


def trusted(path: str) -> bool:
    """Whether a config may name the import path ``path``: the most specific entry of the policy that covers it allows
    it (:data:`TRUSTED_MODULES`, the modules of ``LIGHTNING_LORA_ALLOW_IMPORTS`` and the packages above them, less
    their other modules: the rule jsonargparse applies while parsing)."""
    allowed, denied = _current_policy()
    parts = path.split(".")
    for size in range(len(parts), 0, -1):
        entry = ".".join(parts[:size])
        if entry in denied:
            return False
        if entry in allowed:
            return True
    return False


def _env_modules() -> list[str]:
    """The modules ``LIGHTNING_LORA_ALLOW_IMPORTS`` lists; a :class:`ConfigError` for an entry that is no import
    path."""
    entries = [e.strip() for e in re.split(r"[,\s]+", os.environ.get(ALLOW_ENV, "")) if e.strip()]
    for entry in entries:
        if not all(part.isidentifier() for part in entry.split(".")):
            raise ConfigError(
                f"{ALLOW_ENV}: {entry!r} is not a module's import path; list modules separated by commas, e.g. "
                f"{ALLOW_ENV}=my_package.optim,lion_pytorch."
            )
        if entry == "jsonargparse" or entry.startswith("jsonargparse."):
            raise ConfigError(f"{ALLOW_ENV}: {entry!r} cannot be allowed (it would let a config change these rules).")
    return entries


def apply_import_policy() -> None:
    """Make jsonargparse import, from a parsed value, only what :func:`trusted` allows (see the module docstring).
    Applied anew before each parse: the environment variable may have changed (a process that parses twice). An entry
    an earlier policy set (jsonargparse keeps them all) gets this policy's verdict."""
    from jsonargparse import set_parsing_settings

    allowed, denied = _current_policy()
    earlier = _applied - allowed - denied
    set_parsing_settings(
        import_path_denylist=["*", *sorted(denied | {e for e in earlier if not trusted(e)})],
        import_path_allowlist=sorted(allowed | {e for e in earlier if trusted(e)}),
        instantiate_subclass_spec_in_any=False,
    )
    _applied.update(allowed | denied)


def kinds() -> dict[str, tuple[tuple[type, ...], str]]:
    """The options that name a class, with the base classes it must derive from and what that is in words."""
    from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
    from lightning.pytorch.accelerators import Accelerator
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.loggers import Logger
    from lightning.pytorch.plugins import LayerSync, Precision
    from lightning.pytorch.profilers import Profiler
    from lightning.pytorch.strategies import Strategy
    from torch.optim import Optimizer
    from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

    from lightning_lora.data.sources import ImageFolder
    from lightning_lora.families.base import DiffusionFamily

    return {
        "model.optimizer": (
            (Optimizer,),
            "an optimizer class (a torch.optim.Optimizer subclass, e.g. torch.optim.AdamW, "
            "bitsandbytes.optim.AdamW8bit or lightning_lora.optimizers.Adafactor)",
        ),
        "model.scheduler": (
            (LRScheduler, ReduceLROnPlateau),
            "a learning-rate schedule class (a torch.optim.lr_scheduler.LRScheduler subclass, e.g. "
            "lightning_lora.schedules.CosineWithWarmup)",
        ),
        "model.family": ((DiffusionFamily,), "a model family (e.g. lightning_lora.families.Flux or SDXL)"),
        "data.images": ((ImageFolder,), "folder entries (lightning_lora.data.ImageFolder)"),
        "data.val_images": ((ImageFolder,), "folder entries (lightning_lora.data.ImageFolder)"),
        "trainer.callbacks": ((Callback,), "callback classes (lightning.pytorch.callbacks.Callback subclasses)"),
        "trainer.logger": ((Logger,), "a logger class (a lightning.pytorch.loggers.Logger subclass)"),
        "trainer.plugins": (
            (Precision, CheckpointIO, ClusterEnvironment, LayerSync),
            "Lightning plugins: a precision plugin (lightning_lora.precision.BF16, FP8, FP8Compute or NF4), a "
            "checkpoint IO or a cluster environment",
        ),
        "trainer.strategy": ((Strategy,), "a strategy (a name such as ddp, or a lightning.pytorch.strategies class)"),
        "trainer.accelerator": ((Accelerator,), "an accelerator (a name such as gpu, or an Accelerator class)"),
        "trainer.profiler": ((Profiler,), "a profiler (a name such as simple, or a Profiler class)"),
    }


def _what(option: str) -> str:
    known = kinds().get(option)
    return known[1] if known else "a class of the type this option declares"


def _takes(option: str) -> str:
    return f": {option} takes {_what(option)}" if option in kinds() else ""


def untrusted_message(option: str, path: str) -> str:
    """The one line for an import path outside the trusted modules."""
    return (
        f"{option}: {path} is not a class a config may name{_takes(option)}. A config names classes only from "
        f"{_TRUSTED_IN_WORDS}; nothing else is imported or run. To use a class of another installed package, list its "
        f"module in the environment variable {ALLOW_ENV} (e.g. {ALLOW_ENV}=my_package.optim)."
    )


def _resolve(path: str) -> Any:
    """The object at the trusted import path ``path`` (its module imported if it is not yet)."""
    parts = path.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:split]))
        except ModuleNotFoundError:
            continue
        for name in parts[split:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(f"no module in {path}")


def _class_paths(value: Any, option: str) -> Iterator[tuple[str, Any]]:
    """``(option, spec)`` for every ``class_path`` spec in a parsed config (a jsonargparse Namespace, dicts, lists),
    nested ``init_args`` included (named ``<option>.init_args.<name>``)."""
    if isinstance(value, list | tuple):
        for item in value:
            yield from _class_paths(item, option)
        return
    items = value.items() if isinstance(value, dict) else vars(value).items() if _is_namespace(value) else None
    if items is None:
        return
    entries = {str(k): v for k, v in items if not str(k).startswith("__")}
    if "class_path" in entries:
        yield option, entries["class_path"]
    for name, child in entries.items():
        if name != "class_path":
            yield from _class_paths(child, f"{option}.{name}" if option else name)


def _is_namespace(value: Any) -> bool:
    from jsonargparse import Namespace

    return isinstance(value, Namespace)


def check_class_paths(config: Any) -> None:
    """A :class:`ConfigError` for the first ``class_path`` in the parsed ``config`` (one verb's section) that is not a
    trusted class of its option's kind, or a function given where :func:`kinds` expects a class; see the module
    docstring. Imports nothing that is not trusted."""
    expected = kinds()
    for option, path in _class_paths(config, ""):
        if not isinstance(path, str) or not trusted(path):
            raise ConfigError(untrusted_message(option, str(path)))
        try:
            obj = _resolve(path)
        except (ImportError, AttributeError) as e:
            raise ConfigError(f"{option}: {path} cannot be imported ({e}){_takes(option)}.") from None
        defined = f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', '')}"
        if not trusted(defined):  # named through a trusted package, defined elsewhere
            raise ConfigError(untrusted_message(option, defined))
        if not inspect.isclass(obj):
            raise ConfigError(
                f"{option}: {path} is not a class{_takes(option)}. A class_path names a class; a config calls nothing "
                "else."
            )
        bases = expected.get(option, ((object,), ""))[0]
        if not issubclass(obj, bases):
            raise ConfigError(f"{option}: {path} is not {_what(option)}.")
    for option in ("model.optimizer", "model.scheduler"):
        value = _get(config, option)
        if callable(value) and not inspect.isclass(value) and value is not _code_default(option):
            name = f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', value)}"
            raise ConfigError(f"{option}: {name} is a function, not a class: {option} takes {_what(option)}.")


def _get(config: Any, option: str) -> Any:
    value = config
    for name in option.split("."):
        value = value.get(name) if isinstance(value, dict) else getattr(value, name, None)
    return value


def _code_default(option: str) -> Any:
    """The default of a ``model.*`` option, as the code (not a config) sets it."""
    from lightning_lora.module import LoraModule

    return inspect.signature(LoraModule.__init__).parameters[option.split(".")[1]].default


_DENIED = re.compile(r"Importing '([\w.]+)' is not allowed")
_KEY = re.compile(r'Parser key "([\w.]+)"')
_NOT_SUBCLASS = re.compile(
    r"(?:Import path ([\w.]+) does not correspond to a subclass of|Expected '([\w.]+)' to be a (?:subclass|function "
    r"that returns|class that instantiates))"
)


def class_path_problem(message: str) -> str | None:
    """The one line for a jsonargparse parse error about a class path (an import the policy denied, a class of the
    wrong kind), or None for other errors. The option is the chain of parser keys that leads to the problem in the
    error's indented tree (``model.optimizer`` > ``lr`` is ``model.optimizer.init_args.lr``)."""
    chain: list[tuple[int, str]] = []
    for line in message.splitlines():
        indent = len(line) - len(line.lstrip())
        key = _KEY.search(line)
        problem = _DENIED.search(line) or _NOT_SUBCLASS.search(line)
        if key is not None and (problem is None or key.start() < problem.start()):
            chain = [(i, k) for i, k in chain if i < indent] + [(indent, key.group(1))]
        if problem is None:
            continue
        keys = [k for i, k in chain if i < indent or (i == indent and key is not None)]
        if not keys:
            return None
        option = ".init_args.".join(keys)
        path = next(g for g in problem.groups() if g)
        if problem.re is _DENIED:
            return untrusted_message(option, path)
        return f"{option}: {path} is not {_what(option)}."
    return None
