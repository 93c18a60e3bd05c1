"""CP-SAT (OR-Tools) on an integer version of the model.

CP-SAT needs integer coefficients. Variables of kind 'time' become integers counting a quantum of
seconds (``time_quantum_s``, coarsened so time domains stay <= 1e5 units); rows of kind 'time' are divided by the quantum. Every coefficient is
rounded in the direction that relaxes its row (one-sided rows; variables are non-negative) and the
objective coefficients are rounded down, so every feasible point of the original model maps to a
feasible integer point whose scaled objective is at most the original one plus one quantum per
'time' variable; the bound reported is CP-SAT's bound times the quantum minus that slack, which is a
valid lower bound for the original model. CP-SAT always runs at least two workers (see solve)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Literal

import numpy as np

from hgopt.solvers import SolveOptions, SolveResult, SolveStatus
from hgopt.solvers.model import LinearModel, Row

__all__ = ["CPSAT"]

_BIG = 10**12
DTIME_PER_NODE = 0.01
"""determinism: CP-SAT's deterministic time (its own work measure, about seconds) per unit of
``SolveOptions.node_limit``: CP-SAT explores no branch-and-bound nodes to count (``SolveResult.nodes`` is its
deterministic time in these units)."""
_EPS = 1e-9


@dataclass(frozen=True, slots=True)
class CpSatBackend:
    name: str = "cp-sat"

    def available(self) -> bool:
        try:
            from ortools.sat.python import cp_model  # noqa: F401

            return True
        except ImportError:
            return False

    def version(self) -> str:
        import ortools

        return f"CP-SAT (OR-Tools {ortools.__version__})"

    def solve(self, model: LinearModel, options: SolveOptions) -> SolveResult:
        from ortools.sat.python import cp_model

        t0 = time.perf_counter()
        q = _quantum(model, options.time_quantum_s)
        unit = [q if v.kind == "time" else 1.0 for v in model.vars]
        cp = cp_model.CpModel()
        xs = []
        for j, v in enumerate(model.vars):
            assert v.lb >= 0, f"CP-SAT backend needs non-negative variables ({v.name})"
            lo = math.floor(v.lb / unit[j] + _EPS)
            hi = _BIG if v.ub == math.inf else math.ceil(v.ub / unit[j] - _EPS)
            if v.kind == "count" and not v.integer:
                lo, hi = math.ceil(v.lb - _EPS), (_BIG if v.ub == math.inf else math.floor(v.ub + _EPS))
            xs.append(cp.NewIntVar(lo, hi, f"x{j}"))
        for i, r in enumerate(model.rows):
            _add_row(cp, xs, r, unit, q, i)
        obj = [(math.floor(c * unit[j] / q + _EPS), j) for j, c in model.objective.items()]
        cp.Minimize(sum(a * xs[j] for a, j in obj if a) + math.floor(model.offset / q + _EPS))
        slack = sum(max(c, 0.0) * q for j, c in model.objective.items() if model.vars[j].kind == "time")
        slack += q  # the floor of the offset and of each objective coefficient only lowers the bound
        for j, v in model.hint.items():
            cp.AddHint(xs[j], int(round(v / unit[j])))
        solver = cp_model.CpSolver()
        solver.parameters.max_time_in_seconds = max(options.time_limit_s, 0.01)
        solver.parameters.relative_gap_limit = options.relative_gap
        # one worker runs a single sequential search without CP-SAT's LP-based workers and stalls
        # on these models (60 s on a 28-variable split that 2 workers close in 1 s): use >= 2
        solver.parameters.num_workers = max(2, options.threads)
        solver.parameters.random_seed = options.seed
        solver.parameters.log_search_progress = options.verbose
        if options.node_limit is not None:  # determinism: a work limit the same on every machine
            solver.parameters.max_deterministic_time = max(options.node_limit, 1) * DTIME_PER_NODE
            solver.parameters.interleave_search = True  # the workers in a fixed order: a deterministic search
            solver.parameters.interleave_batch_size = 1  # one task a batch: 100x faster than the default here
        code = solver.Solve(cp)
        wall = time.perf_counter() - t0
        limit: Literal["", "time", "work"] = ""
        dtime = solver.ResponseProto().deterministic_time
        if code in (cp_model.FEASIBLE, cp_model.UNKNOWN):
            by_work = options.node_limit is not None and dtime >= solver.parameters.max_deterministic_time
            limit = "work" if by_work else "time"
        status: SolveStatus = {
            cp_model.OPTIMAL: "optimal", cp_model.FEASIBLE: "feasible", cp_model.INFEASIBLE: "infeasible",
            cp_model.UNKNOWN: "no_solution",
        }.get(code, "error")
        values, objective = None, math.inf
        if status in ("optimal", "feasible"):
            values = np.array([solver.Value(x) * unit[j] for j, x in enumerate(xs)], dtype=float)
            objective = model.objective_value(values)
        bound = -math.inf
        if status in ("optimal", "feasible", "no_solution"):
            bound = solver.BestObjectiveBound() * q - slack
        if status == "infeasible":
            bound = math.inf
        return SolveResult(status=status, objective=objective, bound=bound, wall_s=wall, solver=self.name,
                           version=self.version(), values=values, message=solver.StatusName(code),
                           nodes=math.ceil(dtime / DTIME_PER_NODE), limit=limit)  # its work in node units


def _quantum(model: LinearModel, floor: float) -> float:
    """Seconds per integer unit: ``floor``, coarsened so that no bounded 'time' variable spans more
    than 1e5 units (CP-SAT stalls on huge domains: a 32-variable split took 60 s at 1 µs and 0.1 s
    at 10 µs)."""
    top = max((v.ub for v in model.vars if v.kind == "time" and math.isfinite(v.ub)), default=0.0)
    return max(floor, top / 1e6)


def _add_row(cp: object, xs: list[object], r: Row, unit: list[float], q: float, i: int) -> None:
    """Scale a row to integers, rounding each coefficient in the relaxing direction."""
    ru = q if r.kind == "time" else 1.0
    coefs = [a * unit[c] / ru for c, a in zip(r.cols, r.coefs)]
    lo, hi = r.lb / ru, r.ub / ru
    two_sided = math.isfinite(lo) and math.isfinite(hi)
    if two_sided:
        ints = [round(a) for a in coefs]
        if any(abs(a - b) > 1e-6 for a, b in zip(coefs, ints)) or abs(lo - round(lo)) > 1e-6 or abs(hi - round(hi)) > 1e-6:
            raise ValueError(f"row {r.name}: two-sided rows must have integer coefficients for CP-SAT")
        expr = sum(a * xs[c] for a, c in zip(ints, r.cols))
        cp.Add(expr >= round(lo))  # type: ignore[attr-defined]
        cp.Add(expr <= round(hi))  # type: ignore[attr-defined]
        return
    if math.isfinite(lo):  # sum a x >= lo: larger coefficients, smaller right-hand side relax it
        ints = [math.ceil(a - _EPS) for a in coefs]
        cp.Add(sum(a * xs[c] for a, c in zip(ints, r.cols)) >= math.floor(lo + _EPS))  # type: ignore[attr-defined]
    elif math.isfinite(hi):
        ints = [math.floor(a + _EPS) for a in coefs]
        cp.Add(sum(a * xs[c] for a, c in zip(ints, r.cols)) <= math.ceil(hi - _EPS))  # type: ignore[attr-defined]


CPSAT = CpSatBackend()
