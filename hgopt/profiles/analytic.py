"""Analytic model profile: per-layer times and sizes of a decoder-only transformer computed from its
shape and the GPU table (:mod:`hgopt.profiles.gpus`), for when no measured profile exists.

Layers: ``embedding``, ``layers`` identical ``block``\\ s, ``head`` (final norm + vocabulary
projection + loss). The formulas are written out in ``docs/profiles-analytic.md``; in short, for a
microbatch of ``b`` sequences of ``s`` tokens, hidden ``h``, ``a`` heads, FFN width ``f``,
vocabulary ``V`` and tensor-parallel degree ``t``:

* forward FLOPs of a block ``2bsh(h + 2h_kv) + 2bsh² + 4bs²h + k·2bshf`` with ``k = 2`` (GeLU MLP)
  or ``3`` (gated MLP) and ``h_kv = h·kv_heads/a`` — ``24bsh² + 4bs²h`` for a GPT block with
  ``f = 4h``; head ``2bshV``; the embedding is a memory-bound gather (read + write ``bsh`` values);
* time = FLOPs / (t · peak · efficiency), backward = 2 × forward; with ``t > 1`` a block adds two ring
  all-reduces of ``bsh`` values to its forward and two to its backward (Megatron-style tensor
  parallelism) at the GPU's achievable intra-node bandwidth;
* optimizer step = parameters per GPU × bytes touched per parameter / achievable memory bandwidth;
* activation memory per sample: Korthikanti et al. 2022 (no sequence parallelism), generalised to
  the FFN width, gated MLPs and grouped-query attention; ``10·s·h`` bytes are replicated on every
  tensor-parallel rank, the rest is split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Mapping, Sequence

from hgopt.profiles.gpus import GpuSpec, gpu_spec
from hgopt.spec import DTYPE_BYTES, LayerProfile, ModelProfile, TimingEntry, TpMemory, TrainDtype

__all__ = [
    "OPTIMIZER_BYTES_TOUCHED",
    "SavedTensors",
    "TransformerConfig",
    "block_act_mem_bytes",
    "block_forward_flops",
    "block_params",
    "embedding_params",
    "generate_profile",
    "head_act_mem_bytes",
    "head_forward_flops",
    "head_params",
    "layer_times",
    "ring_allreduce_s",
    "unique_params",
]

Optimizer = Literal["adam", "sgd"]

OPTIMIZER_BYTES_TOUCHED: Mapping[tuple[str, bool], float] = {
    ("adam", False): 28.0,
    ("adam", True): 30.0,
    ("sgd", False): 20.0,
    ("sgd", True): 22.0,
}
"""Bytes read + written per parameter by one optimizer step, keyed by (optimizer, 16-bit training).
Adam reads weight, gradient, two moments and writes weight and moments, all fp32 (7 × 4 bytes); SGD
with momentum reads weight, gradient, momentum and writes weight and momentum (5 × 4); 16-bit
training also writes the 16-bit copy of the weight (+2)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SavedTensors:
    """Which tensors a block's modules keep for backward, as ``transformers``' implementation of one
    family does it (:mod:`hgopt.profiles.hf` sets it; counted with autograd's saved-tensor hooks and by
    walking the autograd graph's ``_saved_*`` attributes of the runner's layers, transformers 5.23 /
    torch 2.13, SDPA attention: ``tests/test_hf_act_mem.py`` checks every family against that count).
    ``None`` on :class:`TransformerConfig` keeps Korthikanti et al.'s accounting (the runner's own GPT
    block saves exactly that)."""

    norm: Literal["layer", "rms_fp32"]
    """``layer``: ``nn.LayerNorm`` keeps its input and its mean and 1/std; ``rms_fp32``: the Llama-family
    RMSNorm upcasts to fp32, so it keeps the fp32 input (``pow``, ``mul``), the fp32 ``rsqrt`` and the
    normalised tensor cast back to the training dtype (for the scale's gradient)."""
    shared_norm_input: bool = False
    """Both norms read the same tensor (GPT-NeoX's parallel residual): its input is kept once."""
    rotary_dims: int = 0
    """Width of the rotary ``cos``/``sin`` tables each block keeps (the runner computes them per block);
    0: learned positions."""
    fused_qkv_kept: bool = False
    """Attention keeps the whole fused QKV projection output (its value is a view of it, GPT-NeoX) on top
    of the rotated query and key copies."""
    out_copy: bool = False
    """The output projection's input is a contiguous copy of SDPA's output (GPT-NeoX), not a view."""
    mlp_tensors: int = 2
    """``f``-wide tensors the MLP keeps: 1 ReLU (its output is the down-projection input), 2 GeLU (input,
    output), 4 gated (gate output, activation output, up output, their product), 5 ``gelu_new`` (its
    tanh formula in separate operations: input, cube, tanh output, two products)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TransformerConfig:
    """Shape of a decoder-only transformer."""

    name: str
    layers: int
    """Number of transformer blocks (the embedding and the head come on top)."""
    hidden: int
    heads: int
    vocab: int
    seq_len: int
    ffn: int | None = None
    """FFN inner width; ``None``: 4 × hidden."""
    kv_heads: int | None = None
    """Key/value heads (grouped-query attention); ``None``: ``heads``."""
    glu: bool = False
    """Gated MLP (SwiGLU, LLaMA style): three matrices instead of two, no biases, RMSNorm."""
    flash_attention: bool = True
    """Attention scores are not kept for backward (FlashAttention); False adds ``5·a·s²`` bytes."""
    dtype: TrainDtype = "bf16"
    # ---- finer architecture (Hugging Face configs, :mod:`hgopt.profiles.hf`); None: GPT style
    # (biases, LayerNorm, learned positions) unless ``glu`` (LLaMA style: none, RMSNorm, rotary) ----
    head_dim: int | None = None
    """Width of one attention head; ``None``: ``hidden / heads`` (Mistral-style configs may differ)."""
    qkv_bias: bool | None = None
    """Biases on the query/key/value projections (Qwen2 has them without the other biases)."""
    out_bias: bool | None = None
    """A bias on the attention output projection."""
    mlp_bias: bool | None = None
    """Biases on every MLP projection (input(s) and output)."""
    rms_norm: bool | None = None
    """RMSNorm (a scale only) instead of LayerNorm (scale and bias)."""
    positions: int | None = None
    """Rows of a learned position table in the embedding layer (GPT-2: ``n_positions``, OPT:
    ``max_position_embeddings + 2``); 0 for rotary models; ``None``: ``seq_len`` in GPT style."""
    dropout: bool = True
    """The model trains with dropout (attention and residual): its masks are kept for backward
    (Korthikanti et al.'s accounting); False drops them from :func:`block_act_mem_bytes`."""
    tied_embeddings: bool = False
    """The vocabulary projection shares the token table. The head still counts ``V·h`` parameters:
    the stage holding it keeps a copy (Megatron-LM's shared embedding, gradients summed with the
    embedding's), so memory and gradient sync are per copy; :func:`unique_params` counts it once."""
    saved: SavedTensors | None = None
    """Saved-activation accounting of a ``transformers`` implementation (:class:`SavedTensors`);
    ``None``: Korthikanti et al.'s (:func:`block_act_mem_bytes`)."""

    @property
    def ffn_width(self) -> int:
        return self.ffn if self.ffn is not None else 4 * self.hidden

    @property
    def q_width(self) -> float:
        """Query (and attention output) width ``heads · head_dim``."""
        return float(self.heads * self.head_dim) if self.head_dim is not None else float(self.hidden)

    @property
    def kv_width(self) -> float:
        kv = self.kv_heads if self.kv_heads is not None else self.heads
        return self.q_width * kv / self.heads

    @property
    def bias(self) -> bool:
        """GPT style (biases, LayerNorm, learned positions) unless ``glu`` (LLaMA style)."""
        return not self.glu

    def _flag(self, value: bool | None) -> bool:
        return self.bias if value is None else value

    @property
    def learned_positions(self) -> int:
        return self.positions if self.positions is not None else (self.seq_len if self.bias else 0)


# ---- parameters ---------------------------------------------------------------------------------
def _norm_params(cfg: TransformerConfig) -> float:
    """LayerNorm has a scale and a bias (2h), RMSNorm only a scale (h)."""
    rms = cfg.rms_norm if cfg.rms_norm is not None else not cfg.bias
    return float(cfg.hidden) if rms else 2.0 * cfg.hidden


def _replicated_params(cfg: TransformerConfig) -> float:
    """Block parameters every tensor-parallel rank holds whole: two norms, the two output biases."""
    out_biases = (cfg.hidden if cfg._flag(cfg.out_bias) else 0.0) + (cfg.hidden if cfg._flag(cfg.mlp_bias) else 0.0)
    return 2 * _norm_params(cfg) + out_biases


def block_params(cfg: TransformerConfig) -> float:
    """Attention ``h(q + 2h_kv) + q·h`` (``q = heads · head_dim``, ``h`` by default), MLP ``k·h·f``
    (k = 2, or 3 with ``glu``), two norms, and the biases ``q + 2h_kv`` (QKV), ``h`` (attention
    output) and ``f + h`` (MLP; ``2f + h`` with ``glu``: gate, up, down) where the architecture has
    them (all of them in GPT style)."""
    h, f, kv, q = cfg.hidden, cfg.ffn_width, cfg.kv_width, cfg.q_width
    mats = 3 if cfg.glu else 2
    weights = h * (q + 2 * kv) + q * h + mats * h * f
    biases = ((q + 2 * kv) if cfg._flag(cfg.qkv_bias) else 0.0) + (h if cfg._flag(cfg.out_bias) else 0.0) \
        + ((mats - 1) * f + h if cfg._flag(cfg.mlp_bias) else 0.0)
    return float(weights + biases + 2 * _norm_params(cfg))


def embedding_params(cfg: TransformerConfig) -> float:
    """Token table ``V·h`` (+ a learned position table, ``s·h`` in GPT style)."""
    return float(cfg.vocab * cfg.hidden + cfg.learned_positions * cfg.hidden)


def unique_params(cfg: TransformerConfig) -> float:
    """Distinct parameters of the model (a tied vocabulary projection counted once): what
    ``transformers``' ``model.num_parameters()`` reports."""
    total = embedding_params(cfg) + cfg.layers * block_params(cfg) + head_params(cfg)
    return total - (cfg.vocab * cfg.hidden if cfg.tied_embeddings else 0.0)


def head_params(cfg: TransformerConfig) -> float:
    """Final norm + untied vocabulary projection ``V·h``."""
    return float(cfg.vocab * cfg.hidden) + _norm_params(cfg)


# ---- FLOPs -------------------------------------------------------------------------------------
def block_forward_flops(cfg: TransformerConfig, mbs: int) -> float:
    """Matmul FLOPs (2 per multiply-add) of one block's forward pass on ``mbs`` sequences."""
    b, s, h, f, kv, q = mbs, cfg.seq_len, cfg.hidden, cfg.ffn_width, cfg.kv_width, cfg.q_width
    qkv = 2.0 * b * s * h * (q + 2 * kv)
    out_proj = 2.0 * b * s * q * h
    scores_and_values = 4.0 * b * s * s * q
    mlp = (3 if cfg.glu else 2) * 2.0 * b * s * h * f
    return qkv + out_proj + scores_and_values + mlp


def head_forward_flops(cfg: TransformerConfig, mbs: int) -> float:
    """Vocabulary projection ``2·b·s·h·V``."""
    return 2.0 * mbs * cfg.seq_len * cfg.hidden * cfg.vocab


# ---- activation memory --------------------------------------------------------------------------
def block_act_mem_bytes(cfg: TransformerConfig, tp: int) -> float:
    """Bytes one block keeps for backward, per sample, on one of ``tp`` tensor-parallel ranks.

    In 16-bit training, in units of ``s·h`` bytes (Korthikanti et al. 2022, Sec. 4.1, generalised):
    two norm inputs 4; attention ``3 + 4·q/h + 4·h_kv/h`` (QKV input 2, Q ``2·q/h``, K and V
    ``2·h_kv/h`` each, output-projection input ``2·q/h``, dropout mask 1; ``q = h`` unless the
    config sets ``head_dim``); MLP ``3 + c·f/h`` (input 2, dropout mask 1; ``c = 4``:
    GeLU input and output, ``c = 6``: gate and up outputs and the down-projection input). Without
    FlashAttention add ``5·a·s²`` (softmax output 2, its dropout mask 1, dropout output 2 per score);
    with it a 4-byte softmax statistic per head and token. For ``f = 4h``, ``h_kv = h``: 34·s·h +
    5·a·s². ``10·s·h`` (norm inputs, QKV and MLP inputs, the two masks) is replicated on every rank,
    the rest split over ``tp``. fp32 training doubles everything (masks included: a slight
    over-estimate). Without dropout (``cfg.dropout`` False: Llama, Mistral, Qwen2, GPT-NeoX configs)
    the two masks go (``8·s·h`` replicated) and a kept score costs 2 bytes (the softmax output)."""
    if cfg.saved is not None:
        return _hf_block_act_mem_bytes(cfg, cfg.saved, tp)
    s, h, a = cfg.seq_len, cfg.hidden, cfg.heads
    r, rq = cfg.kv_width / h, cfg.q_width / h
    masks = 2.0 if cfg.dropout else 0.0
    per_sh = 4 + (2 + 4 * rq + 4 * r) + 2 + masks + (6 if cfg.glu else 4) * cfg.ffn_width / h
    scores = 4.0 * a * s if cfg.flash_attention else (5.0 if cfg.dropout else 2.0) * a * s * s
    total = per_sh * s * h + scores
    replicated = (8.0 + masks) * s * h
    return DTYPE_BYTES[cfg.dtype] / 2.0 * (replicated + (total - replicated) / tp)


def _norm_saved_bytes(cfg: TransformerConfig, saved: SavedTensors) -> float:
    """Bytes per token one norm keeps, its output (the next projection's input) included
    (:attr:`SavedTensors.norm`)."""
    d, h = DTYPE_BYTES[cfg.dtype], cfg.hidden
    if saved.norm == "rms_fp32":
        return 4.0 * h + 4.0 + 2.0 * d * h
    return 2.0 * d * h + 2.0 * d


def _hf_block_act_mem_bytes(cfg: TransformerConfig, saved: SavedTensors, tp: int) -> float:
    """:func:`block_act_mem_bytes` of a ``transformers`` block (:class:`SavedTensors`), per sample.

    Per token, ``d`` bytes per value, ``q``/``k`` the query and key/value widths, ``a`` heads: two norms
    (:func:`_norm_saved_bytes`, less one input ``d·h`` when shared); rotary ``cos``/``sin`` ``2·d·r``;
    attention as SDPA keeps it: query, key and value ``d(q + 2k)`` (with a fused projection output kept
    whole, :attr:`SavedTensors.fused_qkv_kept`, that output ``d(q + 2k)`` plus the rotated query and key
    copies ``d(q + k)``), its output ``d·q`` (the output projection's input; twice with a copy) and a 4-byte
    log-sum-exp per head; the MLP ``n·d·f``; with dropout one 1-byte mask per ``h`` twice. Replicated
    on every tensor-parallel rank: the norms, the rotary tables and the masks; the rest (whole heads,
    MLP columns) is split over ``tp``. Without FlashAttention-style SDPA the kept scores are added as in
    Korthikanti et al."""
    d, s, h, a = DTYPE_BYTES[cfg.dtype], cfg.seq_len, cfg.hidden, cfg.heads
    q, kv = cfg.q_width, cfg.kv_width
    norms = 2 * _norm_saved_bytes(cfg, saved) - (d * h if saved.shared_norm_input else 0.0)
    replicated = norms + 2.0 * d * saved.rotary_dims + (2.0 * h if cfg.dropout else 0.0)
    qkv = d * (q + 2 * kv) + (d * (q + kv) if saved.fused_qkv_kept else 0.0)
    out = d * q * (2 if saved.out_copy else 1)
    scores = 4.0 * a if cfg.flash_attention else (5.0 if cfg.dropout else 2.0) * a * s * d / 2.0
    split = qkv + out + scores + saved.mlp_tensors * d * cfg.ffn_width
    return s * (replicated + split / tp)


def head_act_mem_bytes(cfg: TransformerConfig, tp: int) -> float:
    """Final-norm input and output (training dtype, replicated) + fp32 logits for the loss (split
    over ``tp``, vocabulary-parallel). With :attr:`TransformerConfig.saved`: the norm as the block's
    (:func:`_norm_saved_bytes`) + the fp32 log-softmax (split) + the int64 targets."""
    s = cfg.seq_len
    if cfg.saved is not None:
        return s * (_norm_saved_bytes(cfg, cfg.saved) + 4.0 * cfg.vocab / tp + 8.0)
    return DTYPE_BYTES[cfg.dtype] * 2 * s * cfg.hidden + 4.0 * s * cfg.vocab / tp


def _embedding_act_mem_bytes(cfg: TransformerConfig) -> float:
    """The embedding's output, as Sailor's measured profiles count it (the gather keeps only ids).
    With :attr:`TransformerConfig.saved`: what it really keeps, the int64 token ids (and position ids
    with a learned position table)."""
    if cfg.saved is not None:
        return 8.0 * cfg.seq_len * (2 if cfg.learned_positions else 1)
    return DTYPE_BYTES[cfg.dtype] * cfg.seq_len * cfg.hidden


# ---- times --------------------------------------------------------------------------------------
def ring_allreduce_s(nbytes: float, n: int, bytes_per_s: float) -> float:
    """Bandwidth term of a ring all-reduce among ``n`` ranks, ``2(n-1)/n · bytes / B``: the cost
    kernel's [C5] all-reduce (:func:`hgopt.cost.tables.allreduce_time`) on a constant link without
    latency (one definition of the ring)."""
    from hgopt.cost.tables import allreduce_time
    from hgopt.spec import Bandwidth

    return allreduce_time(Bandwidth(gbyte_s=bytes_per_s / 1e9), nbytes, n)


def layer_times(
    cfg: TransformerConfig, gpu: GpuSpec, tp: int, mbs: int, optimizer: Optimizer = "adam"
) -> dict[str, tuple[float, float, float]]:
    """``{kind: (forward s, backward s, optimizer-step s)}`` of the embedding, one block and the head
    on ``gpu`` at tensor-parallel degree ``tp`` for a microbatch of ``mbs`` sequences."""
    peak = gpu.peak_flops(cfg.dtype)
    if peak is None:
        raise ValueError(f"{gpu.name} cannot train in {cfg.dtype} (no {cfg.dtype} tensor cores): use dtype fp16 or drop {gpu.name}")
    dt = DTYPE_BYTES[cfg.dtype]
    speed = tp * peak * gpu.efficiency
    mem_bw = gpu.memory_gbyte_s * 1e9 * gpu.memory_efficiency
    act = mbs * cfg.seq_len * cfg.hidden * dt
    ar = ring_allreduce_s(act, tp, gpu.intra_node_gbyte_s * 1e9)
    per_param = OPTIMIZER_BYTES_TOUCHED[(optimizer, cfg.dtype != "fp32")] / mem_bw
    block_f = block_forward_flops(cfg, mbs) / speed
    head_f = head_forward_flops(cfg, mbs) / speed
    emb_f = 2.0 * act / mem_bw
    shard = _params_per_rank(cfg, tp)
    return {
        "embedding": (emb_f + ar, 2.0 * emb_f, shard["embedding"] * per_param),
        "block": (block_f + 2 * ar, 2.0 * block_f + 2 * ar, shard["block"] * per_param),
        "head": (head_f, 2.0 * head_f + ar, shard["head"] * per_param),
    }


def _params_per_rank(cfg: TransformerConfig, tp: int) -> dict[str, float]:
    rep = _replicated_params(cfg)
    return {
        # vocabulary-parallel token table (Megatron, the runner's hgopt.runner.tp), replicated positions
        "embedding": cfg.vocab * cfg.hidden / tp + cfg.learned_positions * cfg.hidden,
        "block": (block_params(cfg) - rep) / tp + rep,
        "head": cfg.vocab * cfg.hidden / tp + _norm_params(cfg),
    }


# ---- the profile --------------------------------------------------------------------------------
def _kinds(cfg: TransformerConfig) -> list[str]:
    return ["embedding"] + ["block"] * cfg.layers + ["head"]


def _layers(cfg: TransformerConfig) -> tuple[LayerProfile, ...]:
    boundary = DTYPE_BYTES[cfg.dtype] * cfg.seq_len * cfg.hidden
    sizes = {
        "embedding": (embedding_params(cfg), _embedding_act_mem_bytes(cfg), 0.0),
        "block": (block_params(cfg), block_act_mem_bytes(cfg, 1), block_forward_flops(cfg, 1)),
        "head": (head_params(cfg), head_act_mem_bytes(cfg, 1), head_forward_flops(cfg, 1)),
    }
    names = ["embedding"] + [f"block{i}" for i in range(cfg.layers)] + ["head"]
    return tuple(
        LayerProfile(name=n, kind=k, params=sizes[k][0], activation_bytes=boundary, act_mem_bytes=sizes[k][1],  # type: ignore[arg-type]
                     flops=sizes[k][2])
        for n, k in zip(names, _kinds(cfg))
    )


def _tp_memory(cfg: TransformerConfig, tp: int) -> TpMemory:
    params = _params_per_rank(cfg, tp)
    act = {
        "embedding": _embedding_act_mem_bytes(cfg),
        "block": block_act_mem_bytes(cfg, tp),
        "head": head_act_mem_bytes(cfg, tp),
    }
    kinds = _kinds(cfg)
    return TpMemory(tp=tp, params=tuple(params[k] for k in kinds), act_mem_bytes=tuple(act[k] for k in kinds))


def _check(cfg: TransformerConfig, tps: Sequence[int], mbss: Sequence[int]) -> None:
    for key in ("layers", "hidden", "heads", "vocab", "seq_len"):
        if getattr(cfg, key) < 1:
            raise ValueError(f"{key} must be >= 1, got {getattr(cfg, key)}")
    if cfg.head_dim is None and cfg.hidden % cfg.heads:
        raise ValueError(f"hidden {cfg.hidden} is not a multiple of heads={cfg.heads}")
    for key, values in (("tps", tps), ("mbss", mbss)):
        if not values or min(values) < 1 or len(set(values)) != len(values):
            raise ValueError(f"{key} must list distinct integers >= 1, got {list(values)}")


def generate_profile(
    cfg: TransformerConfig,
    gpus: Sequence[str | GpuSpec],
    *,
    tps: Sequence[int] = (1, 2, 4, 8),
    mbss: Sequence[int] = (1, 2, 4, 8),
    optimizer: Optimizer = "adam",
) -> ModelProfile:
    """Tabulate ``cfg`` on every (GPU type, tp, mbs). ``gpus`` are table names or your own
    :class:`GpuSpec` (e.g. with other efficiency factors). ValueError for a GPU that cannot train
    in ``cfg.dtype`` (bf16 on V100/T4) or a malformed shape."""
    _check(cfg, tps, mbss)
    specs = [g if isinstance(g, GpuSpec) else gpu_spec(g) for g in gpus]
    kinds = _kinds(cfg)
    timings: list[TimingEntry] = []
    for gpu in specs:
        for tp in sorted(tps):
            for mbs in sorted(mbss):
                t = layer_times(cfg, gpu, tp, mbs, optimizer)
                timings.append(
                    TimingEntry(
                        gpu=gpu.name,
                        tp=tp,
                        mbs=mbs,
                        fwd=tuple(t[k][0] for k in kinds),
                        bwd=tuple(t[k][1] for k in kinds),
                        update=tuple(t[k][2] for k in kinds),
                    )
                )
    return ModelProfile(
        name=cfg.name,
        dtype=cfg.dtype,
        seq_len=cfg.seq_len,
        layers=_layers(cfg),
        timings=tuple(timings),
        tp_memory=tuple(_tp_memory(cfg, tp) for tp in sorted(tps) if tp > 1),
        source="analytic: hgopt.profiles.analytic (formulas in docs/profiles-analytic.md), GPU figures from vendor datasheets (hgopt.profiles.gpus)",
    )
