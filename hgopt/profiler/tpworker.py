"""One tensor-parallel rank of ``hgopt profile --tp N`` (``python -m hgopt.profiler.tpworker RANK SIZE
INIT JSON``): builds its shard of every layer, times them in lock step with the other ranks (the tp
collectives synchronise them) and, on rank 0, prints the measurements as one JSON line."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict

__all__ = ["main"]


def main(argv: list[str]) -> int:
    import torch.distributed as dist

    from hgopt.export.runner_plan import ModelConfig
    from hgopt.profiler.runner_model import runner_layer_cases
    from hgopt.profiler.timing import TimingSettings, measure_layers
    from hgopt.runner.tp import TpGroup

    rank, size, init, payload = int(argv[0]), int(argv[1]), argv[2], json.loads(argv[3])
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=size)
    m = payload["model"]
    cfg = ModelConfig(**{**m, "layers": tuple(m["layers"])})
    tp = TpGroup(size=size, rank=rank, group=dist.group.WORLD)
    cases = runner_layer_cases(cfg, names=payload["names"], tp=tp, seed=payload["seed"], dtype=payload["dtype"])
    sizes, timings = measure_layers(cases, payload["mbss"], TimingSettings(**payload["timing"]))
    if rank == 0:
        print(json.dumps({"sizes": [asdict(s) for s in sizes], "timings": [asdict(t) for t in timings]}), flush=True)
    # Every rank must be past its last collective before any tears its gloo pairs down: a peer closing
    # early aborts the other ("terminate called without an active exception", seen in CI).
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
