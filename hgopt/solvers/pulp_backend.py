"""CBC (bundled with PuLP) and HiGHS (highspy) through PuLP.

PuLP's ``LpStatus`` says "Optimal" for a time-limited run that only has an incumbent; the status
here comes from ``prob.sol_status`` and the proven bound from the solver itself (HiGHS:
``mip_dual_bound``; CBC: the "Lower bound" / "Objective value" lines of its log)."""

from __future__ import annotations

import math
import os
import re
import tempfile
import time
from dataclasses import dataclass
from typing import Literal

import numpy as np

from hgopt.solvers import SolveOptions, SolveResult, SolveStatus, _import_ortools_first, quiet_stdout
from hgopt.solvers.model import LinearModel

__all__ = ["CBC", "HIGHS"]


@dataclass(frozen=True, slots=True)
class PulpBackend:
    name: str
    kind: str
    """'cbc' or 'highs'."""

    def available(self) -> bool:
        try:
            pulp = _pulp()
            solver = pulp.PULP_CBC_CMD(msg=False) if self.kind == "cbc" else pulp.HiGHS(msg=False)
            return bool(solver.available())
        except Exception:  # an unusable installation of any kind means "not available"
            return False

    def version(self) -> str:
        pulp = _pulp()
        if self.kind == "highs":
            import highspy

            with quiet_stdout():
                h = highspy.Highs()
                ver = h.version()
            return f"HiGHS {ver} via PuLP {pulp.__version__}"
        return f"CBC (bundled) via PuLP {pulp.__version__}"

    def solve(self, model: LinearModel, options: SolveOptions) -> SolveResult:
        pulp = _pulp()
        t0 = time.perf_counter()
        prob, xs = _build(pulp, model)
        with tempfile.TemporaryDirectory() as tmp:
            log_path = os.path.join(tmp, "cbc.log")
            if self.kind == "cbc":
                solver = pulp.PULP_CBC_CMD(msg=options.verbose, timeLimit=options.time_limit_s,
                                           gapRel=options.relative_gap, threads=options.threads, logPath=log_path,
                                           warmStart=bool(model.hint), options=[f"randomCbcSeed {options.seed + 1}"],
                                           maxNodes=options.node_limit)
            else:
                nodes = {} if options.node_limit is None else {"mip_max_nodes": int(options.node_limit)}
                solver = pulp.HiGHS(msg=options.verbose, timeLimit=options.time_limit_s, gapRel=options.relative_gap,
                                    threads=options.threads, random_seed=options.seed, **nodes)
            try:
                with quiet_stdout():
                    prob.solve(solver)
            except Exception as exc:  # solver-side failures of every kind become an 'error' result
                if self.kind == "highs" and _node_limited(prob):  # determinism: PuLP 3.3 has no status for it
                    return self._node_limited(prob, xs, model, time.perf_counter() - t0)
                return SolveResult(status="error", objective=math.inf, bound=-math.inf,
                                   wall_s=time.perf_counter() - t0, solver=self.name, version=self.version(),
                                   message=str(exc))
            log_text = open(log_path).read() if os.path.exists(log_path) else ""
        return self._result(pulp, prob, xs, model, log_text, time.perf_counter() - t0)

    def _result(self, pulp: object, prob: object, xs: list[object], model: LinearModel, log_text: str,
                wall: float) -> SolveResult:
        sol = prob.sol_status  # type: ignore[attr-defined]
        status: SolveStatus
        if sol == pulp.LpSolutionOptimal:  # type: ignore[attr-defined]
            status = "optimal"
        elif sol == pulp.LpSolutionIntegerFeasible:  # type: ignore[attr-defined]
            status = "feasible"
        elif sol == pulp.LpSolutionInfeasible:  # type: ignore[attr-defined]
            status = "infeasible"
        elif sol == pulp.LpSolutionNoSolutionFound:  # type: ignore[attr-defined]
            status = "no_solution"
        else:
            status = "error"
        values, objective = None, math.inf
        if status in ("optimal", "feasible"):
            values = np.array([x.value() if x.value() is not None else 0.0 for x in xs], dtype=float)
            objective = model.objective_value(values)
        bound = self._bound(prob, status, objective, log_text, model.offset)
        nodes, limit = self._work(prob, status, log_text)
        return SolveResult(status=status, objective=objective, bound=bound, wall_s=wall, solver=self.name,
                           version=self.version(), values=values, message=str(pulp.LpStatus[prob.status]),  # type: ignore[attr-defined]
                           nodes=nodes, limit=limit)

    def _node_limited(self, prob: object, xs: list[object], model: LinearModel, wall: float) -> SolveResult:
        """determinism: HiGHS stopped by ``mip_max_nodes`` (model status kSolutionLimit, which PuLP's
        HiGHS interface does not map): its incumbent, if it has one, and its dual bound."""
        info = prob.solverModel.getInfo()  # type: ignore[attr-defined]
        values = None
        objective = math.inf
        status: SolveStatus = "no_solution"
        if int(info.primal_solution_status) == 2:  # kSolutionStatusFeasible
            values = np.array([x.value() if x.value() is not None else 0.0 for x in xs], dtype=float)
            objective, status = model.objective_value(values), "feasible"
        bound = float(info.mip_dual_bound) + model.offset  # PuLP hands HiGHS the objective without its constant
        return SolveResult(status=status, objective=objective, bound=min(bound, objective), wall_s=wall,
                           solver=self.name, version=self.version(), values=values,
                           message="HiGHS: node limit reached", nodes=int(info.mip_node_count), limit="work")

    def _work(self, prob: object, status: SolveStatus, log_text: str) -> tuple[int, Literal["", "time", "work"]]:
        """determinism: nodes explored and the limit that ended an unfinished solve (CBC: its log's
        "Stopped on nodes" / "Stopped on time"; HiGHS: its model status)."""
        if status not in ("feasible", "no_solution"):
            limit: Literal["", "time", "work"] = ""
        elif self.kind == "cbc":
            low = log_text.lower()
            limit = "work" if "stopped on node" in low else "time" if "stopped on time" in low else ""
        else:
            try:
                ms = str(prob.solverModel.getModelStatus())  # type: ignore[attr-defined]
            except Exception:  # highspy without it
                ms = ""
            limit = "time" if "TimeLimit" in ms else "work" if ("SolutionLimit" in ms or "Node" in ms) else ""
        found = re.findall(r"Enumerated nodes:\s*([0-9]+)", log_text)
        nodes = int(found[-1]) if found else -1
        if self.kind == "highs":
            try:
                nodes = int(prob.solverModel.getInfo().mip_node_count)  # type: ignore[attr-defined]
            except Exception:  # highspy without that info field
                nodes = -1
        return nodes, limit

    def _bound(self, prob: object, status: SolveStatus, objective: float, log_text: str, offset: float) -> float:
        if status == "infeasible":
            return math.inf
        if self.kind == "highs":
            try:  # PuLP hands HiGHS the objective without its constant term
                b = float(prob.solverModel.getInfo().mip_dual_bound) + offset  # type: ignore[attr-defined]
            except Exception:  # highspy without that info field
                b = -math.inf
            if status == "optimal" and not math.isfinite(b):
                return objective  # an LP, or a MIP solved at the root
            return min(b, objective) if status == "optimal" else b
        m = re.findall(r"Lower bound:\s*(-?[0-9.eE+-]+)", log_text)
        if m:  # CBC's log leaves out the objective's constant term
            return min(float(m[-1]) + offset, objective)
        if status == "optimal":
            found = re.findall(r"Objective value:\s*(-?[0-9.eE+-]+)", log_text)
            gapped = re.search(r"Gap:\s*([0-9.eE+-]+)", log_text)
            if found and not gapped:
                return min(float(found[-1]) + offset, objective)
            return objective - abs(objective) * _gap_of(log_text)
        return -math.inf


def _node_limited(prob: object) -> bool:
    try:
        import highspy

        return bool(prob.solverModel.getModelStatus() == highspy.HighsModelStatus.kSolutionLimit)  # type: ignore[attr-defined]
    except Exception:  # no solver model: not this case
        return False


def _gap_of(log_text: str) -> float:
    m = re.findall(r"Gap:\s*([0-9.eE+-]+)", log_text)
    return float(m[-1]) if m else 0.0


def _pulp() -> object:
    _import_ortools_first()  # OR-Tools before PuLP (docs/sources.md: the reverse order segfaults)
    import pulp

    return pulp


def _build(pulp: object, model: LinearModel) -> tuple[object, list[object]]:
    prob = pulp.LpProblem(model.name.replace(" ", "_") or "model", pulp.LpMinimize)  # type: ignore[attr-defined]
    xs = []
    for j, v in enumerate(model.vars):
        x = pulp.LpVariable(f"x{j}", lowBound=None if v.lb == -math.inf else v.lb,  # type: ignore[attr-defined]
                            upBound=None if v.ub == math.inf else v.ub,
                            cat=pulp.LpInteger if v.integer else pulp.LpContinuous)  # type: ignore[attr-defined]
        if j in model.hint:
            x.setInitialValue(model.hint[j])
        xs.append(x)
    prob += pulp.lpSum(c * xs[j] for j, c in model.objective.items()) + model.offset  # type: ignore[attr-defined]
    for i, r in enumerate(model.rows):
        expr = pulp.lpSum(a * xs[c] for c, a in zip(r.cols, r.coefs))  # type: ignore[attr-defined]
        if r.lb == r.ub:
            prob += (expr == r.lb, f"c{i}")
            continue
        if r.lb > -math.inf:
            prob += (expr >= r.lb, f"c{i}_lo")
        if r.ub < math.inf:
            prob += (expr <= r.ub, f"c{i}_hi")
    return prob, xs


CBC = PulpBackend("cbc", "cbc")
HIGHS = PulpBackend("pulp-highs", "highs")
