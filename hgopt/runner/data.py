"""Training data without a network: the shipped text (``hgopt/data/corpus.txt``) at byte level, or
random tokens. Sample ``i`` of step ``s`` is a pure function of ``(seed, s, i)``, so every rank builds
exactly the rows it needs and the single-process reference sees the same batch.

Corpus samples are cut from one paragraph; a paragraph that ends before ``seq + 1`` bytes leaves the rest
of the sample padded (token 0, target ``IGNORE``), so samples carry uneven numbers of target tokens and
the loss is normalised by the global count of counted targets."""

from __future__ import annotations

import random
from functools import lru_cache
from importlib import resources

import torch

from hgopt.export.runner_plan import ModelConfig, TrainConfig

__all__ = ["IGNORE", "Dataset"]

IGNORE = -100


@lru_cache(maxsize=1)
def _paragraphs() -> tuple[bytes, ...]:
    text = resources.files("hgopt").joinpath("data/corpus.txt").read_bytes()
    return tuple(p.strip() for p in text.split(b"\n\n") if len(p.strip()) > 2)


class Dataset:
    def __init__(self, model: ModelConfig, train: TrainConfig) -> None:
        self.seq, self.vocab, self.seed, self.kind = model.seq, model.vocab, train.seed, train.data

    def _rng(self, step: int, index: int) -> random.Random:
        return random.Random(f"{self.seed}:{step}:{index}")

    def _chunk(self, step: int, index: int) -> bytes:
        docs = _paragraphs()
        rng = self._rng(step, index)
        doc = docs[rng.randrange(len(docs))]
        start = rng.randrange(max(1, len(doc) - self.seq // 2))
        return doc[start : start + self.seq + 1]

    def valid_tokens(self, step: int, index: int) -> int:
        """Targets of sample ``index`` that count in the loss."""
        if self.kind == "random":
            return self.seq
        return len(self._chunk(step, index)) - 1

    def sample(self, step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, targets), each ``seq`` long."""
        if self.kind == "random":
            g = torch.Generator().manual_seed(hash((self.seed, step, index)) & 0x7FFFFFFF)
            row = torch.randint(0, self.vocab, (self.seq + 1,), generator=g)
            return row[:-1], row[1:]
        chunk = torch.tensor(list(self._chunk(step, index)), dtype=torch.long)
        n = chunk.numel() - 1
        tokens = torch.zeros(self.seq, dtype=torch.long)
        targets = torch.full((self.seq,), IGNORE, dtype=torch.long)
        tokens[:n], targets[:n] = chunk[:-1], chunk[1:]
        return tokens, targets

    def batch(self, step: int, indices: range) -> tuple[torch.Tensor, torch.Tensor]:
        rows = [self.sample(step, i) for i in indices]
        return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])

    def global_tokens(self, step: int, samples: int) -> int:
        """Counted targets of the whole step (the loss denominator)."""
        return sum(self.valid_tokens(step, i) for i in range(samples))
