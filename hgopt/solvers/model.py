"""A solver-neutral mixed-integer linear model: variables, rows, objective; written to MPS/LP and
translated by each backend. Variables and rows carry a ``kind`` ('time' or 'count') so that the
CP-SAT backend can scale times to integers in the relaxing direction (see cpsat.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

__all__ = ["Kind", "LinearModel", "Row", "Var"]

Kind = Literal["time", "count"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Var:
    name: str
    lb: float
    ub: float
    integer: bool
    kind: Kind = "count"


@dataclass(frozen=True, kw_only=True, slots=True)
class Row:
    name: str
    cols: tuple[int, ...]
    coefs: tuple[float, ...]
    lb: float
    ub: float
    kind: Kind = "count"


@dataclass(kw_only=True, slots=True)
class LinearModel:
    """Minimise ``objective · x + offset`` subject to rows and bounds. A builder: mutable while the
    formulation is written, then handed to a backend."""

    name: str
    vars: list[Var] = field(default_factory=list)
    rows: list[Row] = field(default_factory=list)
    objective: dict[int, float] = field(default_factory=dict)
    offset: float = 0.0
    hint: dict[int, float] = field(default_factory=dict)
    """A feasible assignment (e.g. from a heuristic) handed to solvers that accept hints."""

    def add_var(self, name: str, lb: float = 0.0, ub: float = math.inf, *, integer: bool = False,
                kind: Kind = "count") -> int:
        self.vars.append(Var(name=name, lb=lb, ub=ub, integer=integer, kind=kind))
        return len(self.vars) - 1

    def add_binary(self, name: str) -> int:
        return self.add_var(name, 0.0, 1.0, integer=True)

    def add_row(self, name: str, terms: dict[int, float], lb: float = -math.inf, ub: float = math.inf,
                *, kind: Kind = "count") -> int:
        items = [(c, v) for c, v in terms.items() if v != 0.0]
        self.rows.append(Row(name=name, cols=tuple(c for c, _ in items), coefs=tuple(v for _, v in items),
                             lb=lb, ub=ub, kind=kind))
        return len(self.rows) - 1

    def set_objective(self, terms: dict[int, float], offset: float = 0.0) -> None:
        self.objective = {c: v for c, v in terms.items() if v != 0.0}
        self.offset = offset

    # ---- evaluation -------------------------------------------------------------------------
    def objective_value(self, x: np.ndarray) -> float:
        return self.offset + sum(v * float(x[c]) for c, v in self.objective.items())

    def violation(self, x: np.ndarray) -> float:
        """Largest violation of a row, a bound or integrality by ``x`` (0 when feasible)."""
        worst = 0.0
        for j, v in enumerate(self.vars):
            worst = max(worst, v.lb - x[j], x[j] - v.ub)
            if v.integer:
                worst = max(worst, abs(x[j] - round(x[j])))
        for r in self.rows:
            act = sum(a * float(x[c]) for c, a in zip(r.cols, r.coefs))
            worst = max(worst, r.lb - act, act - r.ub)
        return max(0.0, worst)

    @property
    def num_integer(self) -> int:
        return sum(v.integer for v in self.vars)

    @property
    def num_nonzeros(self) -> int:
        return sum(len(r.cols) for r in self.rows)

    def size(self) -> str:
        return (f"{len(self.vars)} variables ({self.num_integer} integer), {len(self.rows)} rows, "
                f"{self.num_nonzeros} nonzeros")

    # ---- export -----------------------------------------------------------------------------
    def to_mathopt_proto(self) -> object:
        """The model as an OR-Tools MathOpt ``ModelProto``."""
        from ortools.math_opt import model_pb2

        p = model_pb2.ModelProto(name=self.name)
        n = len(self.vars)
        p.variables.ids.extend(range(n))
        p.variables.lower_bounds.extend(v.lb for v in self.vars)
        p.variables.upper_bounds.extend(v.ub for v in self.vars)
        p.variables.integers.extend(v.integer for v in self.vars)
        p.variables.names.extend(v.name for v in self.vars)
        p.objective.maximize = False
        p.objective.offset = self.offset
        obj = sorted(self.objective.items())
        p.objective.linear_coefficients.ids.extend(c for c, _ in obj)
        p.objective.linear_coefficients.values.extend(v for _, v in obj)
        p.linear_constraints.ids.extend(range(len(self.rows)))
        p.linear_constraints.lower_bounds.extend(r.lb for r in self.rows)
        p.linear_constraints.upper_bounds.extend(r.ub for r in self.rows)
        p.linear_constraints.names.extend(r.name for r in self.rows)
        trip = sorted((i, c, a) for i, r in enumerate(self.rows) for c, a in zip(r.cols, r.coefs))
        p.linear_constraint_matrix.row_ids.extend(t[0] for t in trip)
        p.linear_constraint_matrix.column_ids.extend(t[1] for t in trip)
        p.linear_constraint_matrix.coefficients.extend(t[2] for t in trip)
        return p

    def to_mps(self) -> str:
        """Free MPS text, numbers written with full precision (repr)."""
        vn = [_lp_name(v.name, j, "x") for j, v in enumerate(self.vars)]
        rn = [_lp_name(r.name, i, "c") for i, r in enumerate(self.rows)]
        out = [f"NAME {_lp_name(self.name, 0, 'm')}", "ROWS", " N obj"]
        kinds = []
        for i, r in enumerate(self.rows):
            kind = "E" if r.lb == r.ub else ("G" if r.lb > -math.inf else "L")
            kinds.append(kind)
            out.append(f" {kind} {rn[i]}")
        cols: dict[int, list[tuple[str, float]]] = {j: [] for j in range(len(self.vars))}
        for j, c in self.objective.items():
            cols[j].append(("obj", c))
        for i, r in enumerate(self.rows):
            for j, a in zip(r.cols, r.coefs):
                cols[j].append((rn[i], a))
        out.append("COLUMNS")
        in_int = False
        for j, v in enumerate(self.vars):
            if v.integer != in_int:
                out.append(f"    M{j} 'MARKER' {chr(39)}{'INTORG' if v.integer else 'INTEND'}{chr(39)}")
                in_int = v.integer
            for row, a in cols[j] or [("obj", 0.0)]:
                out.append(f"    {vn[j]} {row} {_num(a)}")
        if in_int:
            out.append(f"    M{len(self.vars)} 'MARKER' 'INTEND'")
        out.append("RHS")
        if self.offset:
            out.append(f"    rhs obj {_num(-self.offset)}")
        for i, r in enumerate(self.rows):
            rhs = r.lb if kinds[i] in ("E", "G") else r.ub
            if rhs != 0.0:
                out.append(f"    rhs {rn[i]} {_num(rhs)}")
        ranges = [(rn[i], r.ub - r.lb) for i, r in enumerate(self.rows)
                  if kinds[i] == "G" and r.ub < math.inf]
        if ranges:
            out.append("RANGES")
            out.extend(f"    rng {name} {_num(width)}" for name, width in ranges)
        out.append("BOUNDS")
        for j, v in enumerate(self.vars):
            if v.lb == v.ub:
                out.append(f" FX bnd {vn[j]} {_num(v.lb)}")
                continue
            if v.lb == -math.inf:
                out.append(f" MI bnd {vn[j]}")
            elif v.lb != 0.0 or v.integer:
                out.append(f" LO bnd {vn[j]} {_num(v.lb)}")
            if v.ub < math.inf:
                out.append(f" UP bnd {vn[j]} {_num(v.ub)}")
            elif v.integer:
                out.append(f" PL bnd {vn[j]}")
        out.append("ENDATA")
        return "\n".join(out) + "\n"

    def to_lp(self) -> str:
        """CPLEX LP format text."""
        names = [_lp_name(v.name, j, "x") for j, v in enumerate(self.vars)]
        out = [f"\\ {self.name}", "Minimize", " obj: " + _lp_expr(self.objective.items(), names, self.offset)]
        out.append("Subject To")
        for i, r in enumerate(self.rows):
            expr = _lp_expr(zip(r.cols, r.coefs), names, 0.0)
            rn = _lp_name(r.name, i, "c")
            if r.lb == r.ub:
                out.append(f" {rn}: {expr} = {_num(r.lb)}")
                continue
            if r.lb > -math.inf:
                out.append(f" {rn}_lo: {expr} >= {_num(r.lb)}")
            if r.ub < math.inf:
                out.append(f" {rn}_hi: {expr} <= {_num(r.ub)}")
        out.append("Bounds")
        for j, v in enumerate(self.vars):
            lo = "-inf" if v.lb == -math.inf else _num(v.lb)
            hi = "+inf" if v.ub == math.inf else _num(v.ub)
            out.append(f" {lo} <= {names[j]} <= {hi}")
        ints = [names[j] for j, v in enumerate(self.vars) if v.integer]
        if ints:
            out.append("General")
            out.extend(f" {n}" for n in ints)
        out.append("End")
        return "\n".join(out) + "\n"


def _num(v: float) -> str:
    return repr(float(v))


def _lp_name(name: str, index: int, prefix: str) -> str:
    safe = "".join(ch if ch.isalnum() or ch in "_.[]" else "_" for ch in name)
    return safe if safe and not safe[0].isdigit() and safe[0] not in ".[]" else f"{prefix}{index}_{safe}"


def _lp_expr(terms: object, names: list[str], offset: float) -> str:
    parts = [f"{'+' if a >= 0 else '-'} {abs(a)!r} {names[c]}" for c, a in terms]  # type: ignore[attr-defined]
    if offset:
        parts.append(f"{'+' if offset >= 0 else '-'} {abs(offset)!r}")
    return " ".join(parts) if parts else "0 x_dummy"
