"""The outer synchronisation of DiLoCo-style training (issue #15; Douillard et al., 2023).

Each group of pipelines (``train.outer.groups``) trains its own replica: its gradients are all-reduced
inside the group only (the exporter builds the sync groups per group). Every H inner steps (fragment k
of the delta k·H/F steps later when streamed in F fragments), on every rank:

1. delta = θ_outer − θ for the rank's parameters (θ_outer: the parameters after the last outer step);
2. per layer segment (layers cut at every stage start of every pipeline and at the fragment edges) and
   tp rank, the first holder of the segment in each group (its *representative*) averages the delta
   with the other groups' representatives over a gloo/nccl group spanning them: ``native``: one
   all-reduce in the training dtype; fp32/bf16/fp8/int8: reduce-scatter as an all-to-all of the
   encoded chunks, each member decoding and averaging its chunk, then an all-gather of the re-encoded
   averages (fp8/int8 with one fp32 scale per ``block`` elements) — the volume of a ring all-reduce;
3. the representative broadcasts the average inside its group to the segment's other holders;
4. every holder applies the outer optimizer — ``torch.optim.SGD`` (momentum, Nesterov) on θ_outer with
   the average as its gradient — and sets θ = θ_outer.

Every holder keeps θ_outer and the outer momentum for its own parameters (the same in every holder),
so a checkpoint saves them with the stage (``outer.p<pipeline>.s<stage>.t<tp rank>.pt`` beside the
stage files) and a resume continues exactly.

Why not ``torchft``'s DiLoCo: it averages across replica groups that hold the same model modules, under
its fault-tolerance ``Manager`` (a lighthouse service and a quorum every step); here the groups have
different pipeline shapes, so a rank's layers are averaged with different ranks per segment.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hgopt.cost.outer import fragment_ranges
from hgopt.export.runner_plan import OuterConfig, RunnerPlan

__all__ = ["OuterStep", "decode_delta", "encode_delta", "group_rows", "make_outer", "sync_due"]

log = logging.getLogger(__name__)
_FP8 = torch.float8_e4m3fn
_FP8_MAX = 448.0
_INT8_MAX = 127.0


# ---- codec ------------------------------------------------------------------------------------------
def encode_delta(x: torch.Tensor, precision: str, block: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x`` (1-D, length a multiple of ``block`` for fp8/int8) as (payload, per-block fp32 scales)."""
    if precision == "fp32":
        return x.to(torch.float32), None
    if precision == "bf16":
        return x.to(torch.bfloat16), None
    blocks = x.to(torch.float32).reshape(-1, block)
    top = _FP8_MAX if precision == "fp8" else _INT8_MAX
    amax = blocks.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / top, torch.ones_like(amax))
    scaled = blocks / scale[:, None]
    if precision == "fp8":
        return scaled.to(_FP8).reshape(-1), scale
    return torch.round(scaled).clamp(-top, top).to(torch.int8).reshape(-1), scale


def decode_delta(payload: torch.Tensor, scale: torch.Tensor | None, precision: str, block: int,
                 dtype: torch.dtype) -> torch.Tensor:
    if precision in ("fp32", "bf16"):
        return payload.to(dtype)
    assert scale is not None
    vals = payload.to(torch.float32).reshape(-1, block) * scale[:, None]
    return vals.reshape(-1).to(dtype)


# ---- schedule ---------------------------------------------------------------------------------------
def sync_due(outer: OuterConfig, fragment: int, steps_done: int) -> bool:
    """Fragment ``fragment`` is synchronised after ``steps_done`` inner steps when (n + k·⌊H/F⌋) ≡ 0 (mod H)."""
    return (steps_done + fragment * (outer.steps // outer.fragments)) % outer.steps == 0


def group_rows(rp: RunnerPlan, pipeline: int) -> list[range]:
    """Sample rows of one step that the group of ``pipeline`` trains on (the loss denominator's rows)."""
    assert rp.train.outer is not None
    g = next(m for m in rp.train.outer.groups if pipeline in m)
    return [range(p.sample_offset, p.sample_offset + p.samples) for i, p in enumerate(rp.pipelines) if i in g]


# ---- the exchange plan -----------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class _Segment:
    fragment: int
    lo: int
    hi: int
    tp_rank: int
    reps: tuple[int, ...]
    """One rank per group (group order): the representatives that average."""
    holders: tuple[tuple[int, ...], ...]
    """Per group: every rank holding this segment's shard (representative first)."""


def _segments(rp: RunnerPlan, outer: OuterConfig) -> list[_Segment]:
    L = rp.model.num_layers
    frags = fragment_ranges(L, outer.fragments)
    cuts = sorted({s.start for p in rp.pipelines for s in p.stages} | {a for a, _ in frags} | {L})
    out = []
    for lo, hi in zip(cuts, cuts[1:]):
        frag = next(k for k, (a, b) in enumerate(frags) if a <= lo and hi <= b)
        per_group = []
        for members in outer.groups:
            reps = [rep for i in members for s in rp.pipelines[i].stages if s.start <= lo and hi <= s.end
                    for rep in s.replicas]
            per_group.append(reps)
        tps = {rep.tp for reps in per_group for rep in reps}
        if len(tps) != 1:
            raise ValueError(f"outer: layers [{lo}, {hi}) are held with different tp degrees ({sorted(tps)}); the "
                             "runner averages deltas shard by shard and needs one tp degree per layer")
        for t in range(tps.pop()):
            holders = tuple(tuple(rep.ranks[t] for rep in reps) for reps in per_group)
            out.append(_Segment(fragment=frag, lo=lo, hi=hi, tp_rank=t, reps=tuple(h[0] for h in holders),
                                holders=holders))
    return out


def _layer_of(name: str) -> int:
    return int(name.split(".")[1])


class OuterStep:
    """One rank's outer state and exchange (build with :func:`make_outer` on every rank, in order)."""

    def __init__(self, rp: RunnerPlan, rank: int, model: nn.Module, groups: dict[tuple[int, ...], Any]) -> None:
        assert rp.train.outer is not None
        self.rp, self.rank, self.cfg = rp, rank, rp.train.outer
        self.model = model
        self.params = dict(model.named_parameters())
        first = next(iter(self.params.values()))
        self.dtype = first.dtype if first.dtype == torch.float64 else torch.float32
        self.theta = {n: p.detach().clone().to(self.dtype) for n, p in self.params.items()}
        for t in self.theta.values():
            t.grad = torch.zeros_like(t)
        self.opt = torch.optim.SGD(list(self.theta.values()), lr=self.cfg.lr, momentum=self.cfg.momentum,
                                   nesterov=self.cfg.nesterov and self.cfg.momentum > 0)
        self.groups = groups
        self.mine = [s for s in _segments(rp, self.cfg) if any(rank in h for h in s.holders)]
        self.syncs = 0

    def names(self, seg: _Segment) -> list[str]:
        return sorted((n for n in self.params if seg.lo <= _layer_of(n) < seg.hi),
                      key=lambda n: (_layer_of(n), n))

    def maybe_sync(self, steps_done: int) -> bool:
        """The outer step of every fragment due after ``steps_done`` inner steps; True when one ran."""
        due = [k for k in range(self.cfg.fragments) if sync_due(self.cfg, k, steps_done)]
        if not due:
            return False
        for seg in self.mine:
            if seg.fragment in due:
                self._sync(seg)
        self.syncs += 1
        return True

    @torch.no_grad()
    def _sync(self, seg: _Segment) -> None:
        names = self.names(seg)
        delta = torch.cat([(self.theta[n] - self.params[n].to(self.dtype)).reshape(-1) for n in names])
        g = next(i for i, h in enumerate(seg.holders) if self.rank in h)
        if self.rank == seg.reps[g]:
            delta = self._average(delta, self.groups[seg.reps])
        members = seg.holders[g]
        if len(members) > 1:
            dist.broadcast(delta, src=members[0], group=self.groups[members])
        offset = 0
        for n in names:
            t = self.theta[n]
            t.grad.copy_(delta[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
        self.opt.param_groups[0]["params"] = [self.theta[n] for n in names]  # step only this segment
        self.opt.step()
        self.opt.param_groups[0]["params"] = list(self.theta.values())
        for n in names:
            self.params[n].copy_(self.theta[n].to(self.params[n].dtype))

    def _average(self, delta: torch.Tensor, group: Any) -> torch.Tensor:
        K = len(self.cfg.groups)
        prec = self.cfg.precision
        if prec == "native":
            dist.all_reduce(delta, group=group)
            return delta / K
        n = delta.numel()
        block = self.cfg.block if prec in ("fp8", "int8") else 1
        chunk = math.ceil(n / (K * block)) * block
        padded = torch.zeros(K * chunk, dtype=self.dtype, device=delta.device)
        padded[:n] = delta
        payload, scale = encode_delta(padded, prec, self.cfg.block)
        recv_p = torch.empty_like(_wire(payload))
        dist.all_to_all_single(recv_p, _wire(payload), group=group)
        recv_s = None
        if scale is not None:
            recv_s = torch.empty_like(scale)
            dist.all_to_all_single(recv_s, scale, group=group)
        pieces = [decode_delta(_unwire(recv_p, payload.dtype)[k * chunk : (k + 1) * chunk],
                               None if recv_s is None else recv_s[k * chunk // block : (k + 1) * chunk // block],
                               prec, self.cfg.block, self.dtype) for k in range(K)]
        mean = pieces[0]
        for p in pieces[1:]:
            mean = mean + p
        mean = mean / K
        q, qs = encode_delta(mean, prec, self.cfg.block)
        all_p = torch.empty(K * chunk, dtype=_wire(q).dtype, device=delta.device)
        dist.all_gather_into_tensor(all_p, _wire(q).contiguous(), group=group)
        all_s = None
        if qs is not None:
            all_s = torch.empty(K * chunk // block, dtype=qs.dtype, device=delta.device)
            dist.all_gather_into_tensor(all_s, qs.contiguous(), group=group)
        out = decode_delta(_unwire(all_p, q.dtype), all_s, prec, self.cfg.block, self.dtype)
        return out[:n].contiguous()

    # ---- checkpoints ------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        mom = {n: self.opt.state[t]["momentum_buffer"].detach().cpu().clone()
               for n, t in self.theta.items() if "momentum_buffer" in self.opt.state.get(t, {})}
        return {"theta": {n: t.detach().cpu().clone() for n, t in self.theta.items()}, "momentum": mom,
                "syncs": self.syncs}

    def load(self, blob: dict[str, Any]) -> None:
        with torch.no_grad():
            for n, t in self.theta.items():
                t.copy_(blob["theta"][n])
                if n in blob["momentum"]:
                    self.opt.state[t]["momentum_buffer"] = blob["momentum"][n].to(t.device, t.dtype).clone()
        self.syncs = int(blob["syncs"])


def _wire(t: torch.Tensor) -> torch.Tensor:
    """gloo has no float8 or bf16 collectives on every build: move those as raw bytes."""
    return t.view(torch.uint8) if t.dtype in (_FP8, torch.bfloat16) else t


def _unwire(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.view(dtype) if dtype in (_FP8, torch.bfloat16) else t


def make_outer(rp: RunnerPlan, rank: int, model: nn.Module, timeout: Any) -> OuterStep | None:
    """Every process group the outer exchange needs (created on every rank in the same order), and this
    rank's :class:`OuterStep`; None without ``train.outer``."""
    if rp.train.outer is None:
        return None
    groups: dict[tuple[int, ...], Any] = {}
    for seg in _segments(rp, rp.train.outer):
        for ranks in (seg.reps, *seg.holders):
            if len(ranks) > 1 and ranks not in groups:
                groups[ranks] = dist.new_group(list(ranks), timeout=timeout)
    return OuterStep(rp, rank, model, groups)


def _file(path: Path, rp: RunnerPlan, rank: int) -> Path:
    info = rp.rank_info(rank)
    return path / f"outer.p{info.pipeline}.s{info.stage}.t{info.tp_rank}.pt"


def save(outer: OuterStep, path: Path) -> None:
    """Write this rank's outer state (first replica of each stage) into checkpoint folder ``path``
    before the stage files and the marker are written."""
    if outer.rp.rank_info(outer.rank).replica != 0:
        return
    path.mkdir(parents=True, exist_ok=True)
    f = _file(path, outer.rp, outer.rank)
    tmp = f.with_name(f".{f.name}.tmp")
    torch.save(outer.state(), tmp)
    os.replace(tmp, f)


def restore(outer: OuterStep, path: Path) -> None:
    f = _file(path, outer.rp, outer.rank)
    if not f.exists():
        raise ValueError(f"{f}: the checkpoint has no outer-optimizer state for this rank's stage (saved without "
                         "an outer synchronisation?)")
    outer.load(torch.load(f, weights_only=True, map_location="cpu"))
