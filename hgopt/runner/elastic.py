"""Elastic mode of the local launcher (``python -m hgopt.runner --plan DIR/plan.json --elastic``): when a
rank dies, the survivors stop on their own within the heartbeat timeout (:mod:`hgopt.runner.watchdog`);
the launcher then

1. names the dead rank (the one the watchdogs found silent, else the one a signal ended) and turns it
   into a change of the resources: its node is lost (``cluster=C:-gpus_per_node``);
2. re-plans for what is left (:func:`hgopt.search.replan.replan`: the planner's plan and the old plan
   repaired, priced with the migration [M1] over the steps still to run);
3. exports the chosen plan into ``<out>/restart<k>/`` and restarts every rank from the last checkpoint
   under it (torch.distributed.checkpoint reshards: use ``--checkpoint-format dcp``);

up to ``--max-restarts`` times. Each restart is logged with its reason and appended to
``<out>/restarts.jsonl``; ``metrics.jsonl`` goes on (a step re-run after the restart replaces the
record of the same step in the summary). A rank that failed with an error of its own (not a lost
node) is not restarted. Needs ``DIR/elastic.json`` (``hgopt export --elastic``): the plan, the
instance and the export options to re-plan and re-export with. Local launcher only (one machine)."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import time
from pathlib import Path
from typing import Any

from hgopt.changes import Change, apply_changes, describe_change
from hgopt.export import build_runner_plan, write_export
from hgopt.export.elastic import ElasticSource, write_elastic_source
from hgopt.export.runner_plan import RunnerPlan
from hgopt.runner.checkpoint import latest_step
from hgopt.runner.launch import LaunchOptions, launch_local
from hgopt.search import PlanOptions, get_planner
from hgopt.search.replan import replan

__all__ = ["dead_rank", "lost_node", "run_elastic"]

log = logging.getLogger(__name__)
_SILENT = re.compile(r"^rank (\d+) \(.*\) (stopped responding|never started)")


def dead_rank(outcome: dict[str, Any]) -> int | None:
    """The rank whose node is lost: the one the watchdogs found silent, else the one a signal ended
    (exit code < 0); None when a rank failed with an error of its own or nothing failed."""
    m = _SILENT.match(outcome.get("reason") or "")
    if m:
        return int(m.group(1))
    if outcome.get("reason"):
        return None
    first = outcome.get("first")
    if first is not None and first[1] is not None and first[1] < 0:
        return int(first[0])
    return None


def lost_node(rp: RunnerPlan, rank: int, source: ElasticSource) -> Change:
    """The change that losing ``rank``'s node makes: its cluster has one node fewer."""
    cluster = rp.rank_info(rank).cluster
    gpn = source.instance.topology.cluster(cluster).gpus_per_node
    return Change(kind="cluster", cluster=cluster, gpus=-gpn, text=f"cluster={cluster}:-{gpn}")


def run_elastic(rp: RunnerPlan, plan_path: Path, opts: LaunchOptions, source: ElasticSource, max_restarts: int,
                planner: str = "heuristic", time_limit_s: float = 2.0) -> int:
    """Launch; after a lost node re-plan, re-export and resume, at most ``max_restarts`` times."""
    if max_restarts < 0:
        raise ValueError(f"--max-restarts: must be >= 0, got {max_restarts}")
    target = opts.steps if opts.steps is not None else rp.train.steps
    restarts = 0
    while True:
        outcome: dict[str, Any] = {}
        code = launch_local(rp, plan_path, opts, outcome)
        if code == 0 or not outcome:  # done, or stopped by a signal (no outcome recorded)
            return code
        dead = dead_rank(outcome)
        if dead is None:
            log.error("elastic: no restart: %s (not a lost node)", outcome.get("reason") or "a rank failed")
            return code
        if restarts >= max_restarts:
            log.error("elastic: %s died; --max-restarts %d reached, stopping", rp.rank_info(dead).describe(),
                      max_restarts)
            return code
        restarts += 1
        change = lost_node(rp, dead, source)
        try:
            new_inst = apply_changes(source.instance, [change])
        except ValueError as exc:
            log.error("elastic: cannot re-plan without %s's node: %s", rp.rank_info(dead).describe(), exc)
            return code
        done = latest_step(opts.out_dir) or 0
        res = replan(source.plan, source.instance, new_inst, planner, get_planner(planner),
                     PlanOptions(time_limit_s=time_limit_s), max(1, target - done))
        if res.chosen is None:
            log.error("elastic: no plan fits what is left (%s): stopping", "; ".join(w for _, w in res.rejected))
            return code
        folder = opts.out_dir / f"restart{restarts}"
        export = dataclasses.replace(source.export, local=True, master_port=0)
        what = describe_change(change, source.instance)
        reason = outcome.get("reason") or f"{rp.rank_info(dead).describe()} exited with status {outcome['first'][1]}"
        rp = build_runner_plan(res.chosen.plan, new_inst, export)
        plan_path = write_export(rp, folder).plan
        folder.joinpath("source_plan.json").write_text(res.chosen.plan.to_json() + "\n")
        source = ElasticSource(plan=res.chosen.plan, instance=new_inst, export=export)
        write_elastic_source(folder, source.plan, source.instance, source.export)
        mig = res.chosen.migration
        log.warning("elastic: restart %d/%d: %s; change %s (%s); new plan (%s): %d ranks, %.4g s per step "
                    "predicted, %.3g MB of state between clusters; resuming from checkpoint step %d under %s",
                    restarts, max_restarts, reason, change.text, what, res.chosen.name, rp.world_size,
                    res.chosen.evaluation.iteration_time_s, mig.bytes / 1e6, done, plan_path)
        with open(opts.out_dir / "restarts.jsonl", "a") as f:
            f.write(json.dumps({"restart": restarts, "dead_rank": dead, "reason": reason, "change": change.text,
                                "resume_step": done, "candidate": res.chosen.name, "world_size": rp.world_size,
                                "migration_bytes": mig.bytes, "plan": str(plan_path), "wall": time.time()}) + "\n")
        opts = dataclasses.replace(opts, resume=True, port=0)
