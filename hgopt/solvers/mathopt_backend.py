"""HiGHS and SCIP through OR-Tools MathOpt (keeps the incumbent at a time limit, unlike pywraplp)."""

from __future__ import annotations

import dataclasses
import datetime
import logging
import math
import time
from dataclasses import dataclass
from typing import Literal

import numpy as np

from hgopt.solvers import SolveOptions, SolveResult, SolveStatus
from hgopt.solvers.model import LinearModel

__all__ = ["HIGHS", "SCIP", "MathOptBackend"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class MathOptBackend:
    name: str
    solver: str
    """``mathopt.SolverType`` member name."""

    def available(self) -> bool:
        try:
            from ortools.math_opt.python import mathopt

            return hasattr(mathopt.SolverType, self.solver)
        except ImportError:
            return False

    def version(self) -> str:
        import ortools

        return f"{self.solver.lower()} via OR-Tools MathOpt {ortools.__version__}"

    def solve(self, model: LinearModel, options: SolveOptions) -> SolveResult:
        from ortools.math_opt.python import mathopt

        t0 = time.perf_counter()
        mo = mathopt.Model.from_model_proto(model.to_mathopt_proto())
        params = mathopt.SolveParameters(
            time_limit=datetime.timedelta(seconds=max(options.time_limit_s, 0.01)),
            relative_gap_tolerance=options.relative_gap,
            enable_output=options.verbose,
            random_seed=options.seed,
            node_limit=options.node_limit,
        )
        # HiGHS prunes nodes whose bound reaches the cutoff (it then reports infeasible). SCIP's
        # cutoff_limit is not used: OR-Tools 9.15's Python layer fails to parse the CUTOFF limit.
        if math.isfinite(options.bound_limit) and self.solver == "HIGHS":
            params.highs.double_options["objective_bound"] = options.bound_limit
        if self.solver == "GSCIP":
            params.gscip.int_params["parallel/maxnthreads"] = max(1, options.threads)
        else:
            params.highs.int_options["threads"] = max(1, options.threads)
        hints = []
        if model.hint:
            hints = [mathopt.SolutionHint(variable_values={mo.get_variable(j): v for j, v in model.hint.items()})]
        mparams = mathopt.ModelSolveParameters(solution_hints=hints)
        try:
            res = mathopt.solve(mo, getattr(mathopt.SolverType, self.solver), params=params, model_params=mparams)
        except Exception as exc:  # solver-side failures of every kind become an 'error' result
            log.warning("%s failed: %s", self.name, exc)
            return SolveResult(status="error", objective=math.inf, bound=-math.inf, wall_s=time.perf_counter() - t0,
                               solver=self.name, version=self.version(), message=str(exc))
        out = self._result(res, mo, model, time.perf_counter() - t0, options.bound_limit, options.relative_gap)
        return dataclasses.replace(out, nodes=int(res.solve_stats.node_count), limit=_limit_of(res))

    def _result(self, res: object, mo: object, model: LinearModel, wall: float, options_bound: float,
                relative_gap: float) -> SolveResult:
        from ortools.math_opt.python import mathopt

        reason = res.termination.reason  # type: ignore[attr-defined]
        status: SolveStatus
        R = mathopt.TerminationReason
        if reason == R.OPTIMAL:
            status = "optimal"
        elif reason in (R.FEASIBLE, R.NO_SOLUTION_FOUND) and res.has_primal_feasible_solution():  # type: ignore[attr-defined]
            status = "feasible"
        elif reason == R.INFEASIBLE:
            status = "infeasible"
        elif reason == R.NO_SOLUTION_FOUND:
            status = "no_solution"
        else:
            status = "error"
        values = None
        objective = math.inf
        if status in ("optimal", "feasible") and res.has_primal_feasible_solution():  # type: ignore[attr-defined]
            vv = res.variable_values()  # type: ignore[attr-defined]
            values = np.array([vv[mo.get_variable(j)] for j in range(len(model.vars))], dtype=float)  # type: ignore[attr-defined]
            objective = float(res.objective_value())  # type: ignore[attr-defined]
        elif status in ("optimal", "feasible"):
            status = "no_solution"
        bound = float(res.termination.objective_bounds.dual_bound)  # type: ignore[attr-defined]
        if status == "optimal" and not math.isfinite(bound):  # optimal within the gap asked for, no more
            bound = objective - abs(objective) * relative_gap
        if status == "infeasible":  # with a cutoff: nothing below the cutoff, which is what we need
            bound = options_bound if math.isfinite(options_bound) else math.inf
        return SolveResult(status=status, objective=objective, bound=bound, wall_s=wall, solver=self.name,
                           version=self.version(), values=values, message=str(res.termination.detail))  # type: ignore[attr-defined]


def _limit_of(res: object) -> Literal["", "time", "work"]:
    """determinism: "work" when the node limit ended the solve, "time" for the time limit, else ""."""
    from ortools.math_opt.python import mathopt

    limit = res.termination.limit  # type: ignore[attr-defined]
    if limit == mathopt.Limit.NODE:
        return "work"
    return "time" if limit == mathopt.Limit.TIME else ""


HIGHS = MathOptBackend("highs", "HIGHS")
SCIP = MathOptBackend("scip", "GSCIP")
