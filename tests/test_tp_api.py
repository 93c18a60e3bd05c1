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


def _vocab_rank(rank: int, init: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module

    from hgopt.export.runner_plan import ModelConfig
    from hgopt.runner.model import build_stage
    from hgopt.runner.tp import TpGroup, split_dims, vocab_parallel_cross_entropy

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    text = json.dumps(json.loads(CONFIG.read_text()))
    res: dict[str, float] = {}
    for name, hf in (("hf", text), ("gpt", "")):
        cfg = ModelConfig(layers=("embedding", "block", "block", "head"), hidden=64 if not hf else 256, heads=4,
                          vocab=256, seq=16, hf_config=hf)
        full = build_stage(cfg, 0, 4, seed=2, dtype="float64")  # one process: the reference
        tp = TpGroup(size=2, rank=rank, group=dist.group.WORLD)
        ours = build_stage(cfg, 0, 4, tp, seed=2, dtype="float64")
        g = torch.Generator().manual_seed(5)
        x = torch.randint(0, 256, (3, 16), generator=g)
        y = torch.randint(0, 256, (3, 16), generator=g)
        y[0, :4] = -100  # ignored targets count 0
        losses = {}
        for key, model in (("full", full), ("ours", ours)):
            logits = model(x)
            ce = (torch.nn.functional.cross_entropy(logits.reshape(-1, 256), y.reshape(-1), reduction="sum")
                  if key == "full" else vocab_parallel_cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1),
                                                                     tp))
            ce.backward()
            losses[key] = float(ce)
        res[f"{name}_loss"] = abs(losses["ours"] - losses["full"]) / abs(losses["full"])
        dims = split_dims(ours)
        ref = dict(full.named_parameters())
        worst = 0.0
        for n, p in ours.named_parameters():
            want = ref[n].grad if dims[n] is None else ref[n].grad.chunk(2, dim=dims[n])[rank]
            worst = max(worst, float((p.grad - want).abs().max()) / float(want.abs().max()))
        res[f"{name}_grads"] = worst
        tok = "layers.0.embed.tok.weight" if hf else "layers.0.embed.tok"
        head = "layers.3.head.lm_head.weight" if hf else "layers.3.head.out.weight"
        res[f"{name}_split"] = float(dims[tok] != 0 or dims[head] != 0
                                     or dict(ours.named_parameters())[tok].shape[0] != 128)
        if hf:  # PyTorch's own vocabulary-parallel embedding and head (DTensors), same weights and loss
            emb = torch.nn.Embedding(256, 256).double()
            lm = torch.nn.Linear(256, 256, bias=False).double()
            with torch.no_grad():
                emb.weight.copy_(ref[tok])
                lm.weight.copy_(ref[head])
            mesh = init_device_mesh("cpu", (2,))
            parallelize_module(emb, mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()))
            parallelize_module(lm, mesh, ColwiseParallel(output_layouts=Shard(-1), use_local_output=False))
            h = torch.randn(3 * 16, 256, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
            with loss_parallel():
                theirs = torch.nn.functional.cross_entropy(lm(h), y.reshape(-1), reduction="sum")
                theirs.backward()
            mine_lm = torch.nn.Linear(256, 128, bias=False).double()
            with torch.no_grad():
                mine_lm.weight.copy_(ref[head].chunk(2)[rank])
            mine = vocab_parallel_cross_entropy(mine_lm(h), y.reshape(-1), tp)
            mine.backward()
            res["torch_loss"] = abs(float(mine) - float(theirs.full_tensor() if hasattr(theirs, "full_tensor")
                                                       else theirs)) / abs(float(mine))
            res["torch_head_grad"] = float((mine_lm.weight.grad - lm.weight.grad.to_local()).abs().max())
            e_theirs = emb(x)
            e_theirs = e_theirs.full_tensor() if hasattr(e_theirs, "full_tensor") else e_theirs
            res["torch_embedding"] = float((ours.layers["0"].embed(x) - e_theirs).abs().max())
    Path(out, f"rank{rank}.json").write_text(json.dumps(res))
    dist.barrier()
    dist.destroy_process_group()


def test_vocabulary_parallel_embedding_and_head_equal_one_process_and_pytorch(tmp_path: Path) -> None:
    """The runner's vocabulary-parallel token table, ``lm_head`` and loss (tp 2, gloo, float64) give the
    single-process loss and gradients (every parameter's shard), for the Hugging Face Llama and the
    runner's GPT, and equal PyTorch's ``RowwiseParallel`` embedding / ``ColwiseParallel`` + ``loss_parallel``."""
    import torch.multiprocessing as mp

    from hgopt.profiler.run import free_port

    mp.start_processes(_vocab_rank, args=(f"tcp://127.0.0.1:{free_port()}", str(tmp_path)), nprocs=2, join=True,
                       start_method="spawn")
    for r in range(2):
        res = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert res["hf_split"] == 0.0 and res["gpt_split"] == 0.0  # the tables are really split
        assert all(v <= 1e-12 for v in res.values()), res
