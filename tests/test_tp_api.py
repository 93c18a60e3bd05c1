"""PyTorch's tensor-parallel API on gloo for the runner's Hugging Face blocks: ``parallelize_module`` with
``ColwiseParallel``/``RowwiseParallel`` on a ``LlamaDecoderLayer`` (2 CPU processes, gloo) computes what
one process computes, and the runner's hand-written split (:mod:`hgopt.runner.hf` + :mod:`hgopt.runner.tp`)
computes the same outputs and gradient shards as PyTorch's (docs/runner.md says why the runner keeps
its own path)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

CONFIG = Path(__file__).resolve().parents[1] / "instances" / "hf" / "llama-tiny" / "config.json"
_COL = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
_ROW = ("self_attn.o_proj", "mlp.down_proj")


def _rank(rank: int, init: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from hgopt.export.runner_plan import ModelConfig
    from hgopt.runner.model import build_stage
    from hgopt.runner.tp import TpGroup

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    text = json.dumps(json.loads(CONFIG.read_text()))
    cfg = ModelConfig(layers=("embedding", "block", "block", "head"), hidden=256, heads=4, vocab=256, seq=16,
                      hf_config=text)
    full = build_stage(cfg, 1, 2, dtype="float64")  # one process: the reference
    ours = build_stage(cfg, 1, 2, TpGroup(size=2, rank=rank, group=dist.group.WORLD), dtype="float64")
    theirs = build_stage(cfg, 1, 2, dtype="float64")
    layer = theirs.layers["1"].block.layer
    plan = {**{n: ColwiseParallel() for n in _COL}, **{n: RowwiseParallel() for n in _ROW}}
    parallelize_module(layer, init_device_mesh("cpu", (2,)), plan)
    x = torch.randn(2, 16, 256, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    res = {}
    outs = {}
    for name, model in (("full", full), ("ours", ours), ("theirs", theirs)):
        xi = x.clone().requires_grad_(True)
        y = model(xi)
        y.square().sum().backward()
        outs[name] = (y.detach(), xi.grad)
    grad = {n: p.grad for n, p in ours.named_parameters()}
    key = "layers.1.block.layer.self_attn.k_proj.weight"
    tw = theirs.layers["1"].block.layer.self_attn.k_proj.weight.grad.to_local()
    fw = full.layers["1"].block.layer.self_attn.k_proj.weight.grad.chunk(2)[rank]
    res = {
        "theirs_vs_full_y": float((outs["theirs"][0] - outs["full"][0]).abs().max()),
        "theirs_vs_full_dx": float((outs["theirs"][1] - outs["full"][1]).abs().max()),
        "ours_vs_theirs_y": float((outs["ours"][0] - outs["theirs"][0]).abs().max()),
        "ours_vs_theirs_dx": float((outs["ours"][1] - outs["theirs"][1]).abs().max()),
        "ours_vs_theirs_dk": float((grad[key] - tw).abs().max()),
        "theirs_vs_full_dk": float((tw - fw).abs().max()),
        "dtensor_param": type(theirs.layers["1"].block.layer.self_attn.k_proj.weight).__name__,
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(res))
    dist.barrier()
    dist.destroy_process_group()


def test_parallelize_module_on_gloo_equals_one_process_and_the_runner_split(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    from hgopt.profiler.run import free_port

    mp.start_processes(_rank, args=(f"tcp://127.0.0.1:{free_port()}", str(tmp_path)), nprocs=2, join=True,
                       start_method="spawn")
    for r in range(2):
        res = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert res.pop("dtensor_param") == "DTensor"  # what the runner's local-tensor code would have to take
        assert all(v <= 1e-12 for v in res.values()), res
