"""[C5w] / [C7c] on toy plans: simulate / evaluate (replay mode) of the 36 two-stage plans of
``tests/test_contention.py::_mixed_plans`` (both stages span clusters a and b, whose link is 1 GB/s per
flow and as each direction's cap, 10 ms), with and without the sharing of capped directions
(``_contended_sync`` switched off: every ring and message alone, the plain [C7o] bucket schedule;
until round 7 "without" still had the [C5w] every-ring-together floor), for three activation sizes.
Prints min / max ratio, how many within 2 % and how many exact (1e-9).

    PYTHONPATH=$PWD .venv/bin/python bench/contention_toy.py [closed|replay]

(the argument: evaluate's pipeline mode, default replay)
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hgopt.cost import evaluate  # noqa: E402
from hgopt.cost.gradsync import bucket_schedule_starts  # noqa: E402
from hgopt.simulate import simulate  # noqa: E402
from tests.factories import tiny_instance, tiny_model, tiny_topology  # noqa: E402
from tests.test_contention import _mixed_plans  # noqa: E402


def _summary(xs: list[float]) -> str:
    return (f"min {min(xs):.3f} max {max(xs):.3f} within 2 % {sum(abs(x - 1) <= 0.02 for x in xs)}/{len(xs)} "
            f"exact {sum(abs(x - 1) <= 1e-9 for x in xs)}")


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "replay"
    mod = importlib.import_module("hgopt.cost.evaluate")
    on = mod._contended_sync

    def off(plan, inst, tables, first, ends, buckets, rings, **kw):  # type: ignore[no-untyped-def]
        return (ends, *bucket_schedule_starts(buckets, ends))

    topo = tiny_topology(clusters=(("a", "A", 2, 2, 80.0), ("b", "A", 2, 2, 80.0)))
    topo["links"] = {"default": {"kind": "per_flow", "per_flow": {"gbit_s": 8.0, "latency_ms": 10.0},
                                 "aggregate": {"gbit_s": 8.0}}}
    for act in (1e6, 1e7, 1e8):
        model = tiny_model(num_layers=4, gpus={"A": 0.01}, params=1e7, activation_bytes=act)
        ratios: dict[str, list[float]] = {"with": [], "without": []}
        for plan in _mixed_plans():
            inst = tiny_instance(global_batch=2 * plan.pipelines[0].num_microbatches, model=model, topology=topo)
            sim = simulate(plan, inst).iteration_time_s
            for label, fn in (("with", on), ("without", off)):
                mod._contended_sync = fn
                ratios[label].append(sim / evaluate(plan, inst, pipeline=mode).iteration_time_s)
            mod._contended_sync = on
        print(f"activation {act:.0e} B/sample: with [C7c] {_summary(ratios['with'])} | without {_summary(ratios['without'])}")


if __name__ == "__main__":
    main()
