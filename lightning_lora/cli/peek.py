"""What the command reads from its arguments before the config parser runs: the ``--config`` files, and the options
that must act before anything the parser imports does (the GPU allocator's settings, :func:`config_allocator`).

Only ``yaml.safe_load`` reads the files here, and a file or value this cannot read is left to the parser, which names
the file or the option; nothing here raises, but :func:`check_config_files` for what the parser would report badly
(a traceback for a file that is not UTF-8 text, a screen of types for a folder entry with a wrong field).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from lightning_lora.hardware import Allocator

__all__ = [
    "check_config_file",
    "check_config_files",
    "check_config_text",
    "config_allocator",
    "config_files",
    "options_set",
    "read_config_file",
]

_CONFIG_FLAGS = ("--config", "-c")


def _config_and_flags(args: Sequence[Any]) -> list[tuple[str, str]]:
    """``("config", path)`` and ``("--option", value)`` pairs of ``args``, in the order the parser applies them."""
    pairs: list[tuple[str, str]] = []
    items = [str(a) for a in args]
    for i, arg in enumerate(items):
        name, eq, value = arg.partition("=")
        if not eq:
            if i + 1 >= len(items):
                continue
            value = items[i + 1]
        if name in _CONFIG_FLAGS:
            pairs.append(("config", value))
        elif name.startswith("--"):
            pairs.append((name, value))
    return pairs


def config_files(args: Sequence[Any]) -> list[Path]:
    """The files given with ``--config`` / ``--config=`` / ``-c`` in ``args``, in order."""
    return [Path(value) for kind, value in _config_and_flags(args) if kind == "config"]


def check_config_files(args: Sequence[Any]) -> None:
    """A :class:`~lightning_lora.errors.ConfigError` for the first ``--config`` file of ``args`` that is not UTF-8 text
    (:func:`check_config_text`) or has a folder entry of ``data.images`` / ``data.val_images`` with a wrong field
    (:func:`~lightning_lora.data.sources.folder_entry`: the parser's message for one is every type it tried)."""
    from lightning_lora.data.sources import as_folders

    for path in config_files(args):
        check_config_file(path)
        data = read_config_file(path).get("data")
        for name in ("images", "val_images"):
            value = data.get(name) if isinstance(data, dict) else None
            if isinstance(value, list | dict):
                as_folders(value, f"data.{name}")  # type: ignore[arg-type]  # the mapping of a folder entry too


def check_config_file(path: Path) -> None:
    """A :class:`~lightning_lora.errors.ConfigError` naming the config file ``path`` when the parser could not read a
    config from it, said with the fix: no such file (or a folder), not UTF-8 text (:func:`check_config_text`), not YAML
    (the line and column, as the YAML reader found them), or YAML that is not a mapping of sections. The parser said
    ``Parser key "config": File does not exist`` or ``Problems parsing config: ... in "<unicode string>"``, without
    the file. A value that is a config itself (``--config '{trainer: {max_steps: 10}}'``, which the parser takes) is
    left to the parser."""
    import yaml

    from lightning_lora.errors import ConfigError

    where = f"--config {path}"
    if not path.exists():
        try:
            inline = yaml.safe_load(str(path))
        except yaml.YAMLError:
            inline = None
        if isinstance(inline, dict):
            return
        raise ConfigError(
            f"{where}: no such file ({path.absolute()}). Give the path of a config file (configs/ has one per card "
            "and family)."
        )
    if path.is_dir():
        raise ConfigError(f"{where}: that is a folder; give one of its .yaml files (configs/ has one per card).")
    check_config_text(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise ConfigError(f"{where}: the file cannot be read ({e.strerror or e}).") from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        context = f" ({e.context} at line {e.context_mark.line + 1})" if e.context and e.context_mark else ""
        raise ConfigError(
            f"{where}: not valid YAML{at}: {e.problem}{context}. Fix that line: a config is sections (model:, data:, "
            "trainer:) of option: value lines, indented by spaces."
        ) from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}: not valid YAML: {' '.join(str(e).split())}.") from None
    if not isinstance(data, dict):
        holds = "nothing" if data is None else f"a {type(data).__name__}"
        raise ConfigError(
            f"{where}: the file holds {holds}, not a config: sections (model:, data:, trainer:) of option: value "
            "lines; configs/ has one per card and family."
        )


def check_config_text(path: Path) -> None:
    """A :class:`~lightning_lora.errors.ConfigError` naming the config file ``path`` when it is not UTF-8 text (saved
    as Latin-1 or Windows-1252, or as UTF-16 by Notepad), with where its first such byte is: the parser reads config
    files as UTF-8 text, and fails with a traceback. A file it cannot open is left to the parser, which names it."""
    from lightning_lora.errors import ConfigError

    try:
        data = path.read_bytes()
    except OSError:
        return
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ConfigError(
            f"--config {path}: the file is not UTF-8 text (byte 0x{data[e.start]:02x} on line {line}); save it as "
            "UTF-8 (in your editor: Save As, encoding UTF-8) and run the command again."
        ) from None


def read_config_file(path: Path) -> dict[str, Any]:
    """A config file's top-level mapping (``yaml.safe_load``), or ``{}`` when it cannot be read as one."""
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return {}
    return data if isinstance(data, dict) else {}


def options_set(args: Sequence[Any]) -> set[str]:
    """The options the ``--config`` files and the flags of ``args`` set, named as
    :func:`~lightning_lora.callbacks.monitor.flat_options` names them (``model.optimizer.lr``: a class's ``init_args``
    are options of its section; a list of classes stops at the list); what the HParams tab shows of a run."""
    from lightning_lora.callbacks.monitor import flat_options

    found: set[str] = set()
    for kind, value in _config_and_flags(args):
        if kind == "config":
            found.update(flat_options(read_config_file(Path(value))))
        elif kind not in ("--print_config", "--allocator"):
            name = kind[2:].rstrip("+")
            found.add(".".join(part for part in name.split(".") if part not in ("init_args", "class_path")))
    return found


def config_allocator(args: Sequence[Any]) -> Allocator | None:
    """The ``allocator`` the command line chooses (:data:`lightning_lora.hardware.ALLOCATORS`): the last of the
    ``--allocator`` flags and the ``--config`` files that set it, as the parser applies them; None when none does or
    the value is not one of the choices (the parser then names the option)."""
    from lightning_lora.hardware import ALLOCATORS

    choice: Any = None
    for kind, value in _config_and_flags(args):
        if kind == "config":
            choice = read_config_file(Path(value)).get("allocator", choice)
        elif kind == "--allocator":
            choice = value
    return cast("Allocator", choice) if isinstance(choice, str) and choice in ALLOCATORS else None
