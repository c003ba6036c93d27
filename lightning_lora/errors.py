"""User-facing errors.

A :class:`ConfigError` is raised for anything the user can fix: a wrong path, a typo'd option, an impossible
combination. Its message names the option (as written in the YAML, e.g. ``model.pretrained``) or the file and says
what to do. The command line prints it without a traceback and exits with status 2.
"""


class ConfigError(ValueError):
    """A problem with the user's configuration or files; the message says how to fix it."""
