"""[C5w] / [C7c] on toy plans: simulate / evaluate (replay mode) of the 36 two-stage plans of
``tests/test_contention.py::_mixed_plans`` (both stages span clusters a and b, whose link is 1 GB/s per
flow and as each direction's cap, 10 ms), with and without the sharing of capped directions
(``_contended_sync`` switched off: every ring and message alone, the plain [C7o] bucket schedule;
until round 7 "without" still had the [C5w] every-ring-together floor), for three activation sizes.
Prints min / max ratio, how many within 2 % and how many exact (1e-9).

    PYTHONPATH=$PWD .venv/bin/python bench/contention_toy.py [closed|replay] [--random N]

(the argument: evaluate's pipeline mode, default replay). ``--random N``: instead, N random plans
(seed 1) on three clusters a, b, c (one link kind for all pairs: 1 or 0.5 GB/s per flow, cap 1 or
2 GB/s, 10 ms), 6 layers of 1e6 / 1e7 / 3e7 parameters, 1e6 / 1e7 / 1e8 activation bytes, 2 or 3
stages each on one or two of the clusters, one or two pipelines (the second with the clusters
permuted), m in 1, 2, 4, buckets 5 / 25 / 1000 MiB; plans the simulator rejects are skipped. Prints
the same summary, with sharing only, and the three lowest and highest ratios.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import random  # noqa: E402

from hgopt.cost import evaluate  # noqa: E402
from hgopt.plan import Pipeline, Plan, ReplicaGroup, Stage  # noqa: E402
from hgopt.cost.gradsync import bucket_schedule_starts  # noqa: E402
from hgopt.simulate import simulate  # noqa: E402
from tests.factories import tiny_instance, tiny_model, tiny_topology  # noqa: E402
from tests.test_contention import _mixed_plans  # noqa: E402


def _summary(xs: list[float]) -> str:
    return (f"min {min(xs):.3f} max {max(xs):.3f} within 2 % {sum(abs(x - 1) <= 0.02 for x in xs)}/{len(xs)} "
            f"exact {sum(abs(x - 1) <= 1e-9 for x in xs)}")


def random_cases(n: int, seed: int = 1):  # type: ignore[no-untyped-def]
    """(plan, instance) of the ``--random`` set (module docstring)."""
    rng = random.Random(seed)
    for _ in range(n):
        pf, cap = rng.choice([8.0, 4.0]), rng.choice([8.0, 16.0])
        topo = tiny_topology(clusters=(("a", "A", 2, 2, 80.0), ("b", "A", 2, 2, 80.0), ("c", "A", 2, 2, 80.0)))
        topo["links"] = {"default": {"kind": "per_flow", "per_flow": {"gbit_s": pf, "latency_ms": 10.0},
                                     "aggregate": {"gbit_s": cap}}}
        act, params = rng.choice([1e6, 1e7, 1e8]), rng.choice([1e6, 1e7, 3e7])
        model = tiny_model(num_layers=6, gpus={"A": 0.01}, params=params, activation_bytes=act)
        S = rng.choice([2, 3])
        b = [0, *sorted(rng.sample(range(1, 6), S - 1)), 6]
        m = rng.choice([1, 2, 4])
        stages = []
        for x, y in zip(b, b[1:]):
            cl = rng.sample("abc", rng.choice([1, 2]))
            stages.append(Stage(start=x, end=y, groups=tuple(ReplicaGroup(cluster=c, dp=1, mbs=2 // len(cl)) for c in cl)))
        pipes = [Pipeline(stages=tuple(stages), num_microbatches=m)]
        if rng.choice([1, 2]) == 2:
            perm = dict(zip("abc", rng.sample("abc", 3)))
            pipes.append(Pipeline(stages=tuple(Stage(start=s.start, end=s.end, groups=tuple(
                ReplicaGroup(cluster=perm[g.cluster], dp=1, mbs=g.mbs) for g in s.groups)) for s in stages), num_microbatches=m))
        plan = Plan(pipelines=tuple(pipes), grad_bucket_mb=rng.choice([5.0, 25.0, 1000.0]))
        yield plan, tiny_instance(global_batch=2 * m * len(pipes), model=model, topology=topo)


def main() -> None:
    if "--random" in sys.argv:
        n = int(sys.argv[sys.argv.index("--random") + 1])
        mode = next((a for a in sys.argv[1:] if a in ("closed", "replay")), "replay")
        got = []
        for plan, inst in random_cases(n):
            try:
                sim = simulate(plan, inst).iteration_time_s
            except ValueError:
                continue
            got.append(sim / evaluate(plan, inst, pipeline=mode).iteration_time_s)  # type: ignore[arg-type]
        print(f"{len(got)} random plans: {_summary(got)}; lowest {sorted(got)[:3]}, highest {sorted(got)[-3:]}")
        return
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
