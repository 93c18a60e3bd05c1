"""Re-planning for changed resources: candidates for the new instance (the planner's plan, and the
old plan repaired where that is valid), each priced by ``evaluate`` and by the migration [M1] from the
old plan, and the one of least total time over a horizon of N steps (``T_move + N · t_iter``).

Repairs keep the old plan's layer ranges (so little or nothing moves):

- ``as is``: the old plan, when it is still valid on the new instance (GPUs added, a link changed);
- ``fewer replicas``: every replica group in a cluster that has fewer GPUs than the plan uses there
  halves its ``dp`` and doubles its ``mbs`` (samples per microbatch unchanged) until the plan fits;
- ``fewer pipelines``: pipelines that use a cluster beyond what it has are dropped, last first, and
  their microbatches are dealt to the remaining pipelines (the global batch is kept).

Every candidate must be valid and fit in memory (``evaluate(...).feasible``); the global batch is the
job's, unchanged."""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass

from hgopt.cost import build_tables, evaluate
from hgopt.cost.evaluate import Evaluation
from hgopt.cost.migration import Migration, horizon_time, migration
from hgopt.plan import Pipeline, Plan, validate
from hgopt.search import Planner, PlanOptions, PlanResult
from hgopt.spec import Instance

__all__ = ["Candidate", "ReplanResult", "check_same_job", "repairs", "replan"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class Candidate:
    name: str
    plan: Plan
    evaluation: Evaluation
    migration: Migration
    total_s: float
    """[M1] move time + horizon × iteration time."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ReplanResult:
    before: Evaluation
    """The old plan on the old instance."""
    candidates: tuple[Candidate, ...]
    """Feasible candidates, best (least total time) first."""
    rejected: tuple[tuple[str, str], ...]
    """(candidate, why it is not usable)."""
    planner: PlanResult
    horizon_steps: int
    search_time_s: float

    @property
    def chosen(self) -> Candidate | None:
        return self.candidates[0] if self.candidates else None


def check_same_job(old: Instance, new: Instance) -> None:
    """The new instance trains the same model with the same global batch (ValueError naming what differs)."""
    if old.model.num_layers != new.model.num_layers or any(
            a.params != b.params for a, b in zip(old.model.layers, new.model.layers)):
        raise ValueError(f"{new.source}: the new instance's model ({new.model.name}, {new.model.num_layers} layers) is "
                         f"not the old one's ({old.model.name}, {old.model.num_layers} layers): re-planning keeps the model")
    if old.job.global_batch != new.job.global_batch:
        raise ValueError(f"{new.source}: job.global_batch {new.job.global_batch} differs from the old "
                         f"{old.job.global_batch}: re-planning keeps the global batch")


def _overused(plan: Plan, inst: Instance) -> dict[str, int]:
    """Cluster -> GPUs the plan uses beyond what the instance has (a missing cluster: all of them)."""
    have = {c.name: c.num_gpus for c in inst.topology.clusters}
    return {c: n - have.get(c, 0) for c, n in plan.gpus_by_cluster().items() if n > have.get(c, 0)}


def _fewer_replicas(plan: Plan, inst: Instance) -> Plan | None:
    cur = plan
    while over := _overused(cur, inst):
        if any(c not in {x.name for x in inst.topology.clusters} for c in over):
            return None
        changed = False
        pipes = []
        for p in cur.pipelines:
            stages = []
            for s in p.stages:
                groups = []
                for g in s.groups:
                    if g.cluster in over and g.dp % 2 == 0:
                        g = dataclasses.replace(g, dp=g.dp // 2, mbs=g.mbs * 2)
                        changed = True
                    groups.append(g)
                stages.append(dataclasses.replace(s, groups=tuple(groups)))
            pipes.append(dataclasses.replace(p, stages=tuple(stages)))
        if not changed:
            return None
        cur = dataclasses.replace(cur, pipelines=tuple(pipes))
    return cur


def _deal(pipes: list[Pipeline], samples: int) -> list[Pipeline] | None:
    """``samples`` more per iteration dealt to ``pipes`` as whole microbatches, to the pipeline with the
    fewest samples first (None when they cannot add up exactly)."""
    counts = [p.num_microbatches for p in pipes]
    left = samples
    while left > 0:
        fits = [i for i, p in enumerate(pipes) if p.microbatch <= left]
        if not fits:
            return None
        i = min(fits, key=lambda i: (counts[i] * pipes[i].microbatch, i))
        counts[i] += 1
        left -= pipes[i].microbatch
    return [dataclasses.replace(p, num_microbatches=m) for p, m in zip(pipes, counts)]


def _fewer_pipelines(plan: Plan, inst: Instance) -> Plan | None:
    pipes = list(plan.pipelines)
    dropped = 0
    while _overused(dataclasses.replace(plan, pipelines=tuple(pipes)), inst):
        over = _overused(dataclasses.replace(plan, pipelines=tuple(pipes)), inst)
        users = [i for i, p in enumerate(pipes) if any(g.cluster in over for s in p.stages for g in s.groups)]
        if not users or len(pipes) == 1:
            return None
        dropped += pipes.pop(users[-1]).samples
    dealt = _deal(pipes, dropped)
    return None if dealt is None else dataclasses.replace(plan, pipelines=tuple(dealt))


def repairs(old: Plan, inst: Instance) -> list[tuple[str, Plan]]:
    """The old plan repaired for ``inst`` (see the module text): (name, plan), possibly empty."""
    if not _overused(old, inst):
        return [("old plan as is", old)]
    out = []
    for name, fn in (("old plan, fewer replicas (same layer ranges)", _fewer_replicas),
                     ("old plan, fewer pipelines (same layer ranges)", _fewer_pipelines)):
        p = fn(old, inst)
        if p is not None:
            out.append((name, dataclasses.replace(p, meta=(*p.meta, ("repaired", name)))))
    return out


def replan(old_plan: Plan, old_inst: Instance, new_inst: Instance, planner_name: str, planner: Planner,
           options: PlanOptions, horizon_steps: int) -> ReplanResult:
    """Candidates for ``new_inst``, priced over ``horizon_steps`` (see the module text)."""
    if horizon_steps < 1:
        raise ValueError(f"--horizon-steps: must be >= 1, got {horizon_steps}")
    check_same_job(old_inst, new_inst)
    t0 = time.perf_counter()
    before = evaluate(old_plan, old_inst)
    tables = build_tables(new_inst)
    res = planner(new_inst, options)
    named = [(f"{planner_name} plan for the new resources", res.plan)] if res.plan is not None else []
    named += repairs(old_plan, new_inst)
    cands, rejected = [], []
    if res.plan is None:
        rejected.append((f"{planner_name} plan", f"the planner found none ({res.status})"))
    for name, plan in named:
        assert plan is not None
        bad = validate(plan, new_inst)
        if bad:
            rejected.append((name, "; ".join(str(v) for v in bad[:3])))
            continue
        ev = evaluate(plan, new_inst, tables)
        if not ev.feasible or not math.isfinite(ev.iteration_time_s):
            rejected.append((name, "; ".join(ev.violations[:3]) or "not feasible"))
            continue
        mig = migration(old_plan, plan, new_inst)
        cands.append(Candidate(name=name, plan=plan, evaluation=ev, migration=mig,
                               total_s=horizon_time(ev.iteration_time_s, mig.time_s, horizon_steps)))
    cands.sort(key=lambda c: (c.total_s, c.migration.bytes, not c.name.startswith("old plan")))  # ties: keep the old
    elapsed = time.perf_counter() - t0
    log.debug("replan: %d candidates in %.2f s", len(cands), elapsed)
    return ReplanResult(before=before, candidates=tuple(cands), rejected=tuple(rejected), planner=res,
                        horizon_steps=horizon_steps, search_time_s=elapsed)
