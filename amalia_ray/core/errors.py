"""Errors a user can act on. The CLI prints them as one line (tracebacks only with --debug)."""


class AmaliaError(Exception):
    """A problem with the user's input or environment, stated so they can fix it."""


class RecipeError(AmaliaError):
    """The recipe file is missing, not YAML, or does not validate."""

