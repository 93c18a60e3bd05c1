"""deadline3 (issue #11 item 5): the words when no plan fits name the binding constraint with numbers —
the GPU count (no profiled tp fits any cluster's nodes), not memory — and a global batch that is no
multiple of the smallest profiled microbatch size is not reported as a reason (the planners' microbatch
sizes are the divisors of the batch, [C2] extrapolates the profile: such an instance has plans)."""

from __future__ import annotations

import json

import pytest

from hgopt.cli import build_parser
from hgopt.commands import plan as plan_cmd
from hgopt.cost import evaluate
from hgopt.explain import infeasibility
from hgopt.search import PlanOptions, get_planner
from tests.factories import tiny_instance, tiny_model


@pytest.mark.parametrize("planner", ["heuristic", "milp"])
def test_no_profiled_tp_fits_the_nodes_names_the_gpu_count(planner: str) -> None:
    inst = tiny_instance(model=tiny_model(tps=(4,)))  # clusters a, b: 2 nodes x 2 GPUs; tp 4 only
    res = get_planner(planner)(inst, PlanOptions(time_limit_s=5))
    assert res.status == "infeasible" and res.plan is None
    lines = infeasibility(inst)
    assert lines[-1].startswith("GPU count binds")
    for name in ("a", "b"):
        assert f"{name}: 2 GPUs per node, 4 GPUs, profiled tp [4]" in lines[-1]
    assert not any("memory binds" in line for line in lines)


def test_plan_cli_without_a_plan_prints_the_gpu_count(monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(plan_cmd, "load_instance", lambda name: tiny_instance(model=tiny_model(tps=(4,))))
    args = build_parser().parse_args(["plan", "tiny", "-q", "--planner", "heuristic", "--time-limit", "30", "--json"])
    rc = plan_cmd.run(args)
    doc = json.loads(capsys.readouterr().out)
    assert rc != 0 and any(r.startswith("GPU count binds") for r in doc["infeasibility"]), doc["infeasibility"]


def test_a_batch_off_the_profiled_microbatch_sizes_is_no_reason_and_has_plans() -> None:
    inst = tiny_instance(global_batch=3, model=tiny_model(mbss=(2, 4)))
    lines = infeasibility(inst)
    assert all("microbatch size 1 (the global batch 3 is no multiple of the smallest profiled microbatch size 2"
               in line and line.endswith(": fits") for line in lines[:2])
    res = get_planner("heuristic")(inst, PlanOptions(time_limit_s=5))
    assert res.plan is not None and evaluate(res.plan, inst).feasible  # the lines' verdict holds
