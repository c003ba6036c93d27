"""User-facing errors.

A :class:`ConfigError` is raised for anything the user can fix: a wrong path, a typo'd option, an impossible
combination. Its message names the option (as written in the YAML, e.g. ``model.pretrained``) or the file and says
what to do. The command line prints it without a traceback and exits with status 2.
"""


class ConfigError(ValueError):
    """A problem with the user's configuration or files; the message says how to fix it."""


def first_line(error: BaseException, limit: int | None = None) -> str:
    """The first line of an exception's message (its type name when the message is empty), for one-line reports."""
    text = str(error).strip()
    line = text.splitlines()[0] if text else type(error).__name__
    return line if limit is None else line[:limit]
