"""Errors a user can act on. The CLI prints them as one line (tracebacks only with --debug)."""


class AmaliaError(Exception):
    """A problem with the user's input or environment, stated so they can fix it."""


class RecipeError(AmaliaError):
    """The recipe file is missing, not YAML, or does not validate."""


class NotImplementedYet(AmaliaError):
    """A capability that is planned but not built yet; says which issue tracks it."""

    def __init__(self, what: str, issue: int | None = None):
        where = f" (tracked in issue #{issue})" if issue else ""
        super().__init__(f"{what} is not implemented yet{where}")
