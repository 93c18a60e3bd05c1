"""[C4j] Pipelines that share a capped link direction, replayed together (issue #10 items 2/4).

[C4w] prices every boundary of every pipeline over a capped direction as if all of them crossed it at
the same time (each message stretched to the direction's whole load). Two different pipelines' messages
do not do that in the timeline (the runner on per-node emulated links: plan (b), two pipelines a|b and
b|a on one capped link, +21 % in ``evaluate`` against the runner, the simulator within 1.6 %). Here the
pipelines that share a capped direction are replayed replica by replica in ONE timeline
(``pieces.replay_pieces``: every message a flow on its NICs, its node pair and the cap, each resource
shared by the messages on it at the moment, the simulator's point-to-point model), so the cap is shared
by what is in flight together. ``evaluate`` keeps each pipeline's own form (its boundaries priced with
its own load on the cap) and takes, stage by stage, the later of it and the joint replay: never below
the exact timeline of the shared link. Pure functions on the replay's inputs; ``evaluate`` builds them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hgopt.cost.pieces import Piece, compress, replay_pieces

__all__ = ["Parts", "capped_groups", "joint_ends", "joint_replay"]

Parts = tuple[list[list[tuple[str, int]]], list[list[tuple[float, float]]], list[Piece]]
"""One pipeline's replay inputs: per stage its operations in the runner's order, per stage and replica
its (forward, backward) seconds, and its pieces (boundary indices local to the pipeline)."""


def capped_groups(loads: Sequence[dict[tuple[str, str], float]], capped: set[tuple[str, str]]) -> list[list[int]]:
    """Groups (of at least two) of the pipelines ``loads[i]`` (bytes per microbatch per link direction)
    connected by capped directions they both load: each group shares caps only within itself."""
    parent = list(range(len(loads)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    first: dict[tuple[str, str], int] = {}
    for i, load in enumerate(loads):
        for d, x in load.items():
            if x > 0 and d in capped:
                if d in first:
                    parent[root(i)] = root(first[d])
                else:
                    first[d] = i
    groups: dict[int, list[int]] = {}
    for i in range(len(loads)):
        groups.setdefault(root(i), []).append(i)
    return [g for g in groups.values() if len(g) > 1]


def joint_replay(parts: Sequence[Parts], op_limit: int, classes: bool = True) -> list[list[float]] | None:
    """Each pipeline's per-stage end (latest replica) when ``parts`` are replayed in one timeline: the
    pipelines' stages side by side (no dependency between pipelines), their messages sharing every
    resource key they have in common (the caps). None when the replay (after ``pieces.compress``) has
    more than ``op_limit`` operations (a work limit, as ``evaluate.PIECE_REPLAY_OPS``)."""
    orders: list[Sequence[tuple[str, int]]] = []
    times: list[list[tuple[float, float]]] = []
    pieces: list[Piece] = []
    for o, t, ps in parts:
        off = len(orders)
        orders += o
        times += t
        pieces += [Piece(boundary=p.boundary + off, src=p.src, dst=p.dst, fwd=p.fwd, bwd=p.bwd) for p in ps]
    if classes:
        times, pieces = compress(times, pieces)
    if sum(len(o) * len(t) for o, t in zip(orders, times)) > op_limit:
        return None
    ends = replay_pieces(orders, times, pieces)
    out, s = [], 0
    for o, _, _ in parts:
        out.append([max(e) for e in ends[s:s + len(o)]])
        s += len(o)
    return out



def joint_ends(loads: Sequence[dict[tuple[str, str], float]], capped: set[tuple[str, str]], stages: Sequence[int],
               parts_of: Callable[[int, int], Parts], op_limit: int) -> dict[int, list[float]]:
    """Per pipeline i (of ``loads``, ``stages[i]`` stages) that shares a capped direction with another,
    its stages' ends in the joint replay of its group (``capped_groups``); ``parts_of(i, offset)``:
    pipeline i's replay inputs with its stages numbered from ``offset`` in the resource keys. A group
    over ``op_limit`` is left out (the caller keeps [C4w]'s shared load for it)."""
    out: dict[int, list[float]] = {}
    for group in capped_groups(loads, capped):
        offsets = [sum(stages[j] for j in group[:k]) for k in range(len(group))]
        ends = joint_replay([parts_of(i, off) for i, off in zip(group, offsets)], op_limit)
        if ends is not None:
            out.update(zip(group, ends))
    return out
