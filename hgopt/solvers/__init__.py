"""MILP solver backends behind one small interface.

Every backend is a module with ``NAME``, ``available() -> bool``, ``version() -> str`` and
``solve(model: LinearModel, options: SolveOptions) -> SolveResult``; :data:`BACKENDS` maps the
names users type to those modules (imported on first use). Shared options: time limit, relative
gap, threads, seed and a deterministic work limit (``node_limit``: the same model, options and seed give
the same result whatever the machine's load, unlike a time limit, which stays the watchdog). Pitfalls handled here (measured, docs/sources.md): OR-Tools is imported before PuLP (PuLP
first makes OR-Tools' HiGHS segfault); HiGHS runs through MathOpt (pywraplp drops the incumbent at a
time limit); PuLP's "Optimal" is checked against ``sol_status``; CP-SAT gets integer coefficients.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import os
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Iterator, Literal, Mapping

import numpy as np

from hgopt.solvers.model import LinearModel

__all__ = [
    "BACKENDS",
    "SolveOptions",
    "SolveResult",
    "SolveStatus",
    "available_backends",
    "backend_names",
    "get_backend",
    "solve",
]

SolveStatus = Literal["optimal", "feasible", "infeasible", "no_solution", "error"]
"""optimal: proven within the relative gap asked for; feasible: an incumbent at a limit, with a
bound; infeasible: proven infeasible; no_solution: a limit hit before any incumbent; error."""

BACKENDS: Mapping[str, str] = {
    "highs": "hgopt.solvers.mathopt_backend:HIGHS",
    "scip": "hgopt.solvers.mathopt_backend:SCIP",
    "cp-sat": "hgopt.solvers.cpsat_backend:CPSAT",
    "cbc": "hgopt.solvers.pulp_backend:CBC",
    "pulp-highs": "hgopt.solvers.pulp_backend:HIGHS",
}


@dataclass(frozen=True, kw_only=True, slots=True)
class SolveOptions:
    time_limit_s: float = 60.0
    relative_gap: float = 1e-4
    threads: int = 1
    seed: int = 0
    bound_limit: float = math.inf
    """A cutoff (HiGHS's ``objective_bound``; backends without the feature ignore it): a solve with one
    proves only that nothing lies below the cutoff — on 'infeasible' the bound reported is the cutoff.
    The exact planner passes none: on a split of sailor-het-32+96 HiGHS returned 'optimal' with
    objective = bound = 4.75459 under one, optimum 4.67836 (issue #11)."""
    node_limit: int | None = None
    """determinism: the work limit — branch-and-bound nodes (HiGHS ``mip_max_nodes``, SCIP
    ``limits/nodes`` through MathOpt's ``node_limit``, CBC ``maxNodes``, PuLP-HiGHS ``mip_max_nodes``;
    CP-SAT has no nodes: ``max_deterministic_time`` = ``node_limit`` × ``cpsat_backend.DTIME_PER_NODE``
    with its workers interleaved, which makes it deterministic). Reached: status ``feasible`` (an
    incumbent) or ``no_solution``, with the solver's bound, and ``SolveResult.limit`` = "work". None: none.
    ``time_limit_s`` still applies (the wall-clock watchdog; ``limit`` = "time" when it ended the solve)."""
    time_quantum_s: float = 1e-6
    """CP-SAT only: seconds per integer unit when times are scaled to integers."""
    verbose: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class SolveResult:
    status: SolveStatus
    objective: float
    """Objective of the incumbent (inf without one)."""
    bound: float
    """Proven lower bound on the optimum (-inf when none)."""
    wall_s: float
    solver: str
    version: str
    values: np.ndarray | None = None
    message: str = ""
    nodes: int = -1
    """determinism: branch-and-bound nodes the solve explored (-1: the backend does not say)."""
    limit: Literal["", "time", "work"] = ""
    """determinism: which limit ended a solve that did not finish: "work" (``node_limit``: the same run
    on any machine ends there), "time" (``time_limit_s``: depends on the load), "" (it finished, or an
    other limit or the gap ended it)."""

    @property
    def gap(self) -> float:
        """(objective − bound) / |objective|; inf when either is missing."""
        if not (math.isfinite(self.objective) and math.isfinite(self.bound)):
            return math.inf
        return max(0.0, (self.objective - self.bound) / max(abs(self.objective), 1e-12))

    @property
    def has_solution(self) -> bool:
        return self.values is not None


def backend_names() -> tuple[str, ...]:
    return tuple(BACKENDS)


def get_backend(name: str) -> object:
    """The backend object registered as ``name``; ValueError naming the choices otherwise."""
    if name not in BACKENDS:
        raise ValueError(f"--solver: unknown solver {name!r} (choices: {', '.join(BACKENDS)})")
    _import_ortools_first()
    module, attr = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), attr)


def available_backends() -> tuple[str, ...]:
    """Names of the backends whose solver library imports and runs here."""
    return tuple(n for n in BACKENDS if get_backend(n).available())  # type: ignore[attr-defined]


def solve(model: LinearModel, name: str, options: SolveOptions) -> SolveResult:
    backend = get_backend(name)
    if not backend.available():  # type: ignore[attr-defined]
        raise ValueError(f"--solver: {name} is not installed here (available: {', '.join(available_backends())})")
    return backend.solve(model, options)  # type: ignore[attr-defined, no-any-return]


def _import_ortools_first() -> ModuleType | None:
    """Import OR-Tools before anything imports PuLP (the other order segfaults HiGHS; docs/sources.md)."""
    try:
        return importlib.import_module("ortools.math_opt.python.mathopt")
    except ImportError:
        return None


@contextlib.contextmanager
def quiet_stdout() -> Iterator[None]:
    """Silence solver banners written straight to file descriptor 1 (they would corrupt --json)."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
