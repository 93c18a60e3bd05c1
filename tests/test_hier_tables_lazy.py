"""[H2] ``hier_tables.LazyTables``: one layer count of every weight read off the block (``cells``, what
the split's choice of local alternatives reads) equals the weight's built table there, whether that
table was built before or not; fresh searches and cached blocks agree."""

from __future__ import annotations

import itertools
import math

import pytest

from hgopt.cost import build_tables
from hgopt.search.baselines._common import block_layout
from hgopt.search.hier_tables import MOST_STAGES, cluster_tables, lazy_cluster_tables
from tests.factories import tiny_instance, tiny_model, tiny_topology


def _instance(mem_gb: float):  # type: ignore[no-untyped-def]
    """Two clusters; memory from tight (few layouts fit, some layer counts none) to ample."""
    topo = tiny_topology(clusters=(("a", "A", 2, 4, mem_gb), ("b", "B", 1, 4, mem_gb)))
    return tiny_instance(global_batch=32, model=tiny_model(num_layers=6, params=5e7, act_mem_bytes=2e8), topology=topo)


@pytest.mark.parametrize("mem_gb", [2.0, 4.0, 40.0])
def test_cells_equal_the_built_tables(mem_gb: float) -> None:
    inst = _instance(mem_gb)
    tables, layout = build_tables(inst), block_layout(inst)
    L = tables.num_layers
    finite = infinite = 0
    for name, role, B, k, after in itertools.product(("a", "b"), ("first", "middle", "last", "only"), (2, 4, 8),
                                                     (1, 2), (0, 1, 4)):
        c = inst.topology.cluster(name)
        m = inst.job.global_batch // (k * B)
        kw = dict(microbatch=B, num_microbatches=m, gpu_budget=c.num_gpus // k, replicas=k, stages_after=after,
                  weights=(max(1, m // 8), 1, 4 * m + 4, MOST_STAGES))
        lazy = lazy_cluster_tables(inst, tables, layout, c, role, cache={}, **kw)  # type: ignore[arg-type]
        before = {n: lazy.cells(n) for n in range(L + 1)}  # nothing built yet
        eager = cluster_tables(inst, tables, layout, c, role, cache={}, **kw)  # type: ignore[arg-type]
        assert list(lazy) == list(eager)
        for w in eager:
            t = lazy[w]
            for n in range(L + 1):
                want = (float(eager[w].bottleneck[n]), float(eager[w].fill[n]), float(eager[w].sync_opt[n]),
                        int(eager[w].stages[n]))
                assert before[n][w] == want, (name, role, B, k, after, w, n)
                assert (float(t.bottleneck[n]), float(t.fill[n]), float(t.sync_opt[n]), int(t.stages[n])) == want
                if math.isfinite(want[0]):
                    finite += 1
                else:
                    infinite += 1
        built_first = lazy_cluster_tables(inst, tables, layout, c, role, cache={}, **kw)  # type: ignore[arg-type]
        for w in built_first:
            built_first[w]
        assert {n: built_first.cells(n) for n in range(L + 1)} == before
    assert finite and infinite  # both kinds of cells compared
