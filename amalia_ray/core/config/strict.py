"""The base of every recipe model: unknown fields are errors, values are frozen; and the one rule for names
that become folders."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

# a recipe value that becomes a folder or file name (run, stage, source, task): one path component, never `..`,
# so nothing a recipe names can land outside the run folder
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"


class Strict(BaseModel):
    """Every recipe section rejects unknown fields so a typo never silently falls back to a default."""

    model_config = ConfigDict(extra="forbid", frozen=True)
