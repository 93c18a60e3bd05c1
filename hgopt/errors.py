"""Errors raised for user input: each names the file, the field and what is wrong."""

from __future__ import annotations

__all__ = ["SpecError", "PlanError"]


class SpecError(ValueError):
    """A model profile, topology, job or instance file is malformed.

    ``source`` is the file (or ``<inline>``), ``field`` a dotted path inside it
    (``topology.clusters[2].gpus_per_node``) and ``problem`` a sentence saying what is wrong.
    """

    def __init__(self, source: str, field: str, problem: str) -> None:
        self.source = source
        self.field = field
        self.problem = problem
        super().__init__(f"{source}: {field}: {problem}")


class PlanError(ValueError):
    """A plan file cannot be read (bad JSON, wrong schema version, missing field)."""

    def __init__(self, source: str, field: str, problem: str) -> None:
        self.source = source
        self.field = field
        self.problem = problem
        super().__init__(f"{source}: {field}: {problem}")
