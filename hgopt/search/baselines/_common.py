"""Helpers shared by the baselines: block layout of the model, per-GPU memory of a stage, integer
batch splitting, and the search-budget clock. Pure functions; no state kept between calls."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from hgopt.cost.memory import stage_memory_parts
from hgopt.spec import Instance

__all__ = [
    "Budget",
    "BlockLayout",
    "block_layout",
    "min_shards_to_fit",
    "powers_of_two_upto",
    "split_capped",
    "split_proportional",
    "stage_memory_parts",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class BlockLayout:
    """Megatron's view of a model: ``pre`` leading non-block layers (embedding) that go with the
    first stage, ``blocks`` transformer blocks split evenly, ``post`` trailing layers (head) that go
    with the last stage."""

    pre: int
    blocks: int
    post: int

    def stage_ranges(self, pp: int) -> tuple[tuple[int, int], ...]:
        """Layer ranges of ``pp`` stages holding ``blocks / pp`` blocks each."""
        assert self.blocks % pp == 0, (self.blocks, pp)
        per = self.blocks // pp
        cuts = [self.pre + per * s for s in range(pp + 1)]
        cuts[0], cuts[-1] = 0, self.pre + self.blocks + self.post
        return tuple(zip(cuts, cuts[1:]))


def block_layout(instance: Instance) -> BlockLayout:
    """Split the layer list into leading non-blocks, blocks and trailing non-blocks. A model whose
    blocks are not contiguous is treated as all blocks (every layer counts the same)."""
    kinds = [layer.kind for layer in instance.model.layers]
    if "block" not in kinds:
        return BlockLayout(pre=0, blocks=len(kinds), post=0)
    first = kinds.index("block")
    last = len(kinds) - 1 - kinds[::-1].index("block")
    if any(k != "block" for k in kinds[first : last + 1]):
        return BlockLayout(pre=0, blocks=len(kinds), post=0)
    return BlockLayout(pre=first, blocks=last - first + 1, post=len(kinds) - 1 - last)


def min_shards_to_fit(base: float, optimizer: float, capacity: float) -> float:
    """Smallest ZeRO-1 shard count z with ``base + optimizer / z <= capacity`` (inf: never fits)."""
    if base + optimizer <= capacity:
        return 1.0
    free = capacity - base
    if free <= 0:
        return math.inf
    return float(math.ceil(optimizer / free - 1e-12))


def powers_of_two_upto(n: int) -> tuple[int, ...]:
    out, p = [], 1
    while p <= n:
        out.append(p)
        p *= 2
    return tuple(out)


def split_proportional(total: int, weights: list[float]) -> list[int] | None:
    """Integers >= 1 adding up to ``total``, as close to proportional to ``weights`` as the largest
    remainder method gets; ``None`` when ``total < len(weights)``."""
    n = len(weights)
    if total < n or n == 0:
        return None
    wsum = sum(weights)
    # one sample each first, the rest proportionally
    spare = total - n
    ideal = [w / wsum * total - 1.0 for w in weights]
    base = [max(0, min(spare, math.floor(x))) for x in ideal]
    left = spare - sum(base)
    while left < 0:  # can only happen through the clamping above
        i = max(range(n), key=lambda j: base[j])
        base[i] -= 1
        left += 1
    order = sorted(range(n), key=lambda j: (-(ideal[j] - base[j]), j))
    for j in order[:left]:
        base[j] += 1
    out = [b + 1 for b in base]
    assert sum(out) == total, (out, total)
    return out


def split_capped(total: int, weights: list[float], caps: list[int]) -> list[int] | None:
    """Like :func:`split_proportional`, but no share above its cap: shares that would exceed it are
    fixed at the cap and the rest split again (water filling). ``None`` when ``total`` is below one
    each or above the caps' sum."""
    n = len(weights)
    if n == 0 or total < n or total > sum(caps):
        return None
    fixed: dict[int, int] = {}
    while True:
        free = [i for i in range(n) if i not in fixed]
        share = split_proportional(total - sum(fixed.values()), [weights[i] for i in free])
        if share is None:
            return None
        over = [i for i, x in zip(free, share) if x > caps[i]]
        if not over:
            out = [0] * n
            for i, x in zip(free, share):
                out[i] = x
            for i, x in fixed.items():
                out[i] = x
            return out
        for i in over:
            fixed[i] = caps[i]


class Budget:
    """Wall-clock budget of one search (``time.perf_counter``)."""

    def __init__(self, seconds: float | None) -> None:
        self.start = time.perf_counter()
        self.seconds = seconds

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def exhausted(self) -> bool:
        return self.seconds is not None and self.elapsed() >= self.seconds
