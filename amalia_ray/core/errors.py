"""Errors a user can act on. The CLI prints them as one line (tracebacks only with --debug)."""


class AmaliaError(Exception):
    """A problem with the user's input or environment, stated so they can fix it."""


class RecipeError(AmaliaError):
    """The recipe file is missing, not YAML, or does not validate."""


class NotImplementedYet(AmaliaError):
    """A capability that is not built yet, said as such (exit code 3)."""

    def __init__(self, what: str):
        super().__init__(f"{what} is not implemented yet")
