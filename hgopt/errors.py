"""Errors raised for user input: each names the file, the field and what is wrong."""

from __future__ import annotations

__all__ = ["MAX_MESSAGE_CHARS", "SpecError", "PlanError", "truncate"]

MAX_MESSAGE_CHARS = 400
"""Longest file name, field or problem an error message carries (longer ones are cut in the middle)."""


def truncate(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """``text`` cut to about ``limit`` characters, keeping its start and end."""
    if len(text) <= limit:
        return text
    keep = max(limit // 2 - 20, 1)
    return f"{text[:keep]} ...[{len(text) - 2 * keep} characters cut]... {text[-keep:]}"


class SpecError(ValueError):
    """A model profile, topology, job or instance file is malformed.

    ``source`` is the file (or ``<inline>``), ``field`` a dotted path inside it
    (``topology.clusters[2].gpus_per_node``) and ``problem`` a sentence saying what is wrong; each is
    truncated to :data:`MAX_MESSAGE_CHARS`.
    """

    def __init__(self, source: str, field: str, problem: str) -> None:
        self.source = truncate(str(source))
        self.field = truncate(str(field))
        self.problem = truncate(str(problem))
        super().__init__(f"{self.source}: {self.field}: {self.problem}")


class PlanError(ValueError):
    """A plan file cannot be read (bad JSON, wrong schema version, missing field)."""

    def __init__(self, source: str, field: str, problem: str) -> None:
        self.source = truncate(str(source))
        self.field = truncate(str(field))
        self.problem = truncate(str(problem))
        super().__init__(f"{self.source}: {self.field}: {self.problem}")
