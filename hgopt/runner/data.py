"""Training data without a network: the shipped text (``hgopt/data/corpus.txt``) at byte level, random
tokens, or (``text``) a tokenised token stream of local files. Sample ``i`` of step ``s`` is a pure
function of ``(seed, s, i)``, so every rank builds exactly the rows it needs and the single-process
reference sees the same batch.

``text``: the files are read in order (UTF-8), tokenised with the model's ``tokenizer.json`` through the
``tokenizers`` package (else their bytes), joined into one stream and cut into consecutive windows of
``seq + 1`` tokens (stride ``seq``; every target counts). Global sample ``i`` of step ``s`` is stream
position ``p = s · global_batch + i``: window ``perm_e[p mod W]`` of epoch ``e = p // W`` (one seeded
permutation per epoch). The plan lays a step's samples out pipeline after pipeline, microbatch after
microbatch, and inside a microbatch replica after replica by their row ranges, so each data-parallel
replica reads exactly its share (3 of every 4 rows for a replica with mbs 3 next to one with mbs 1),
the shares tile the step without overlap, and a resumed run at step ``s`` continues at position
``s · global_batch`` (the checkpoint records it and resume checks it).

Corpus samples are cut from one paragraph; a paragraph that ends before ``seq + 1`` bytes leaves the rest
of the sample padded (token 0, target ``IGNORE``), so samples carry uneven numbers of target tokens and
the loss is normalised by the global count of counted targets."""

from __future__ import annotations

import random
from functools import lru_cache
from importlib import resources

import torch

from hgopt.export.runner_plan import ModelConfig, ReplicaSpec, RunnerPipeline, TrainConfig

__all__ = ["IGNORE", "Dataset", "replica_rows", "token_stream"]

IGNORE = -100


@lru_cache(maxsize=1)
def _paragraphs() -> tuple[bytes, ...]:
    text = resources.files("hgopt").joinpath("data/corpus.txt").read_bytes()
    return tuple(p.strip() for p in text.split(b"\n\n") if len(p.strip()) > 2)


def replica_rows(pipe: RunnerPipeline, rep: ReplicaSpec, microbatch: int) -> range:
    """Global sample indices (within a step) that replica ``rep`` of ``pipe`` processes in ``microbatch``."""
    base = pipe.sample_offset + microbatch * pipe.microbatch + rep.offset
    return range(base, base + rep.mbs)


@lru_cache(maxsize=4)
def token_stream(files: tuple[str, ...], tokenizer: str) -> torch.Tensor:
    """The token ids of ``files`` (empty: the shipped corpus) in order, as one int64 vector."""
    texts = [open(f, encoding="utf-8").read() for f in files] if files else \
        [resources.files("hgopt").joinpath("data/corpus.txt").read_text(encoding="utf-8")]
    if tokenizer:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(tokenizer)
        ids = [i for t in texts for i in tok.encode(t).ids]
    else:
        ids = [b for t in texts for b in t.encode("utf-8")]
    return torch.tensor(ids, dtype=torch.long)


class Dataset:
    def __init__(self, model: ModelConfig, train: TrainConfig, global_batch: int = 0) -> None:
        self.seq, self.vocab, self.seed, self.kind = model.seq, model.vocab, train.seed, train.data
        self.global_batch = global_batch
        if self.kind == "text":
            self.stream = token_stream(train.data_files, train.tokenizer)
            self.windows = (self.stream.numel() - 1) // self.seq
            if self.windows < 1:
                raise ValueError(f"the text data has {self.stream.numel()} tokens, fewer than one sample of {self.seq + 1}")
            top = int(self.stream.max())
            if top >= self.vocab:
                raise ValueError(f"the text data has token id {top}, the model's vocabulary is {self.vocab}")
            if global_batch < 1:
                raise ValueError("text data needs the step's global batch")

    def position(self, step: int, index: int = 0) -> int:
        """Stream position of global sample ``index`` of ``step`` (``text`` data)."""
        return step * self.global_batch + index

    @lru_cache(maxsize=64)
    def _perm(self, epoch: int) -> torch.Tensor:
        return torch.randperm(self.windows, generator=torch.Generator().manual_seed(self.seed * 1_000_003 + epoch))

    def _window(self, step: int, index: int) -> torch.Tensor:
        pos = self.position(step, index)
        w = int(self._perm(pos // self.windows)[pos % self.windows])
        return self.stream[w * self.seq : w * self.seq + self.seq + 1]

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
        if self.kind in ("random", "text"):
            return self.seq
        return len(self._chunk(step, index)) - 1

    def sample(self, step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, targets), each ``seq`` long."""
        if self.kind == "random":
            g = torch.Generator().manual_seed(hash((self.seed, step, index)) & 0x7FFFFFFF)
            row = torch.randint(0, self.vocab, (self.seq + 1,), generator=g)
            return row[:-1], row[1:]
        if self.kind == "text":
            row = self._window(step, index)
            return row[:-1].clone(), row[1:].clone()
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
