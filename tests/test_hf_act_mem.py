"""The analytic saved-activation bytes of a Hugging Face architecture (``hgopt.profiles.hf`` →
``block_act_mem_bytes`` / ``head_act_mem_bytes`` / the embedding's) equal what the runner's layers —
``transformers``' own modules — really keep for backward: every tensor autograd saves during the layer's
forward, counted once per storage, parameters left out (as ``hgopt/runner/memory.py`` counts them), for
every supported family and for float32 and bfloat16 compute."""

from __future__ import annotations

import json
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hgopt.export.runner_plan import ModelConfig  # noqa: E402
from hgopt.profiles.analytic import (  # noqa: E402
    _embedding_act_mem_bytes,
    block_act_mem_bytes,
    head_act_mem_bytes,
)
from hgopt.profiles.hf import hf_transformer_config  # noqa: E402
from hgopt.runner.model import build_stage  # noqa: E402
from tests.test_hf_config import CONFIGS  # noqa: E402

SEQ = 24
VARIANTS: dict[str, dict[str, Any]] = {
    **CONFIGS,
    "gpt2-gelu": dict(CONFIGS["gpt2"], activation_function="gelu"),
    "gpt2-gelu-tanh": dict(CONFIGS["gpt2"], activation_function="gelu_pytorch_tanh"),
    "gpt2-gelu-fast": dict(CONFIGS["gpt2"], activation_function="gelu_fast"),
    "opt-gelu": dict(CONFIGS["opt"], activation_function="gelu"),
    "gpt-neox-serial": dict(CONFIGS["gpt-neox"], use_parallel_residual=False, rotary_pct=0.5),
}
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def _saved_bytes(module: Any, x: Any, loss: bool = False) -> int:
    """Bytes of the distinct storages autograd saves in ``module(x)`` (parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen: dict[int, int] = {}

    def pack(t: Any) -> Any:
        st = t.untyped_storage()
        if st.data_ptr() not in params and st.data_ptr() != 0:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = module(x)
        if loss:  # as the runner's last stage: fp32 cross-entropy against int64 targets
            targets = torch.zeros(y.shape[:-1], dtype=torch.long)
            torch.nn.functional.cross_entropy(y.float().reshape(-1, y.shape[-1]), targets.reshape(-1))
    return sum(seen.values())


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name", list(VARIANTS))
def test_saved_activation_bytes_equal_the_runner_layers(name: str, dtype: str) -> None:
    cfg = dict(VARIANTS[name], tie_word_embeddings=False)
    text = json.dumps(cfg, sort_keys=True)
    mc = ModelConfig(layers=("embedding", "block", "head"), hidden=0, heads=1, vocab=cfg["vocab_size"], seq=SEQ,
                     hf_config=text)
    model = build_stage(mc, 0, 3, dtype=DTYPES[dtype])
    tc = hf_transformer_config(cfg, seq_len=SEQ, dtype=dtype)  # type: ignore[arg-type]
    h = tc.hidden
    x = torch.randn(1, SEQ, h, dtype=getattr(torch, DTYPES[dtype]), requires_grad=True)
    tokens = torch.randint(0, cfg["vocab_size"], (1, SEQ))
    block = _saved_bytes(model.layers["1"], x)
    head = _saved_bytes(model.layers["2"], x, loss=True)
    emb = _saved_bytes(model.layers["0"], tokens)
    # transformers' GELU modules keep a few 8-byte scalar constants: at most 32 B per layer
    assert abs(block_act_mem_bytes(tc, 1) - block) <= 32, (block, block_act_mem_bytes(tc, 1))
    assert abs(head_act_mem_bytes(tc, 1) - head) <= 32, (head, head_act_mem_bytes(tc, 1))
    assert _embedding_act_mem_bytes(tc) == emb


def test_korthikanti_accounting_stays_for_non_hf_profiles() -> None:
    """A profile not made from a Hugging Face config keeps Korthikanti et al.'s block accounting (the
    runner's own GPT block saves exactly that: bench/memory_check.py)."""
    from hgopt.profiles.analytic import TransformerConfig

    tc = TransformerConfig(name="g", layers=1, hidden=64, heads=4, vocab=256, seq_len=32, dtype="bf16")
    assert tc.saved is None
    assert block_act_mem_bytes(tc, 1) == pytest.approx(32 * 64 * 34 + 4 * 4 * 32, rel=1e-12)
