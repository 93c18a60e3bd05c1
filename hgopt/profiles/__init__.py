"""Sources of model profiles and topologies: importers of peer planners' measured data (Sailor,
Metis), the analytic generator and its GPU table.

An instance's ``model`` mapping with a ``generator`` key is built here by :func:`generate`
(called from :func:`hgopt.spec.instance_from_dict`):

- ``generator: analytic`` — ``name, layers, hidden, heads, vocab, seq_len`` and optionally ``ffn,
  kv_heads, glu, dtype, flash_attention, gpus, tps, mbss, optimizer`` (see
  :mod:`hgopt.profiles.analytic`);
- ``hf_config: PATH`` (``generator`` optional, analytic) — the shape from a Hugging Face
  ``config.json``, optionally ``name, seq_len, dtype, flash_attention, gpus, tps, mbss, optimizer``
  (see :mod:`hgopt.profiles.hf`);
- ``generator: sailor`` — ``root`` (Sailor's data folder), ``model``, optional ``gpus``, ``seq_len``;
- ``generator: metis`` — ``dir``, ``seq_len``, ``hidden``, optional ``gpu, name, dtype,
  bytes_per_param``.

Relative paths are taken from the folder of the file that holds the instance.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping

from hgopt.errors import SpecError
from hgopt.profiles.gpus import GPUS, GpuSpec, gpu_spec
from hgopt.spec import ModelProfile, _At

__all__ = ["GENERATORS", "generate"]

GENERATORS: tuple[str, ...] = ("analytic", "sailor", "metis")


def generate(data: Mapping[str, Any], source: str = "<inline>", path: str = "",
             gpus: Mapping[str, GpuSpec] | None = None) -> ModelProfile:
    """Build the model profile described by ``data`` (a mapping with a ``generator`` key). ``gpus``:
    the GPU table the analytic generator reads (default :data:`hgopt.profiles.gpus.GPUS`; an
    instance passes the table with its own ``gpus:`` added)."""
    at = _At(source, path, data)
    if "hf_config" in data and "generator" not in data:
        kind = "analytic"
    else:
        kind = at.get("generator").choice(GENERATORS)
    build: Callable[[_At], ModelProfile] = {
        "analytic": lambda a: _analytic(a, gpus if gpus is not None else GPUS), "sailor": _sailor, "metis": _metis,
    }[kind]
    try:
        return build(at)
    except ValueError as exc:
        if isinstance(exc, SpecError):
            raise
        raise at.fail(str(exc)) from None


def _base_dir(source: str) -> Path:
    p = Path(source)
    return p.parent if p.is_file() else Path.cwd()


def _dir(at: _At, key: str) -> Path:
    p = Path(at.get(key).string())
    p = p if p.is_absolute() else _base_dir(at.source) / p
    if not p.is_dir():
        raise at.get(key).fail(f"folder {p} does not exist")
    return p


def _ints(at: _At | None, default: tuple[int, ...], limit: str) -> tuple[int, ...]:
    if at is None:
        return default
    out = tuple(item.limited(limit) for item in at.items())
    if not out:
        raise at.fail("must list at least one value")
    return out


def _strings(at: _At) -> tuple[str, ...]:
    out = tuple(item.string() for item in at.items())
    if not out:
        raise at.fail("must list at least one GPU type")
    return out


def _hf(at: _At, table: Mapping[str, GpuSpec]) -> ModelProfile:
    """``hf_config: PATH`` (a Hugging Face config.json) with optional ``name, seq_len, dtype,
    flash_attention, gpus, tps, mbss, optimizer``: see :mod:`hgopt.profiles.hf`."""
    from hgopt.profiles.hf import hf_profile, read_hf_config

    at.only({"generator", "hf_config", "name", "seq_len", "dtype", "flash_attention", "gpus", "tps", "mbss",
             "optimizer"})
    p = Path(at.get("hf_config").string())
    p = p if p.is_absolute() else _base_dir(at.source) / p
    if not p.is_file():
        raise at.get("hf_config").fail(f"file {p} does not exist")
    seq, name = at.opt("seq_len"), at.opt("name")
    return hf_profile(
        read_hf_config(p),
        [gpu_spec(n, table) for n in _strings(at.get("gpus"))] if at.has("gpus") else None,
        source=str(p),
        seq_len=seq.limited("seq_len") if seq else None,
        dtype=at.get("dtype").choice(("fp32", "bf16", "fp16")) if at.has("dtype") else "bf16",  # type: ignore[arg-type]
        name=name.string() if name else p.parent.name,
        tps=_ints(at.opt("tps"), (1, 2, 4, 8), "tp"),
        mbss=_ints(at.opt("mbss"), (1, 2, 4, 8), "mbs"),
        optimizer=at.get("optimizer").choice(("adam", "sgd")) if at.has("optimizer") else "adam",  # type: ignore[arg-type]
        flash_attention=_flag(at, "flash_attention", True),
    )


def _analytic(at: _At, table: Mapping[str, GpuSpec]) -> ModelProfile:
    from hgopt.profiles.analytic import TransformerConfig, generate_profile

    if at.has("hf_config"):
        return _hf(at, table)

    at.only({
        "generator", "name", "layers", "hidden", "heads", "vocab", "seq_len", "ffn", "kv_heads", "glu",
        "dtype", "flash_attention", "gpus", "tps", "mbss", "optimizer",
    })
    opt_int = {k: v.limited(lim) for k, lim in (("ffn", "ffn"), ("kv_heads", "heads")) if (v := at.opt(k)) is not None}
    cfg = TransformerConfig(
        name=at.get("name").string(),
        layers=at.get("layers").limited("layers"),
        hidden=at.get("hidden").limited("hidden"),
        heads=at.get("heads").limited("heads"),
        vocab=at.get("vocab").limited("vocab"),
        seq_len=at.get("seq_len").limited("seq_len"),
        glu=_flag(at, "glu", False),
        flash_attention=_flag(at, "flash_attention", True),
        dtype=at.get("dtype").choice(("fp32", "bf16", "fp16")) if at.has("dtype") else "bf16",  # type: ignore[arg-type]
        **opt_int,
    )
    if cfg.hidden % cfg.heads:
        raise at.get("hidden").fail(f"{cfg.hidden} is not a multiple of heads={cfg.heads}")
    if cfg.kv_heads is not None and cfg.heads % cfg.kv_heads:
        raise at.get("kv_heads").fail(f"{cfg.kv_heads} does not divide heads={cfg.heads}")
    optimizer = at.get("optimizer").choice(("adam", "sgd")) if at.has("optimizer") else "adam"
    names = _strings(at.get("gpus"))
    specs = []
    for item, n in zip(at.get("gpus").items(), names):
        try:
            specs.append(gpu_spec(n, table))
        except ValueError as exc:
            raise item.fail(str(exc)) from None
    return generate_profile(
        cfg,
        specs,
        tps=_ints(at.opt("tps"), (1, 2, 4, 8), "tp"),
        mbss=_ints(at.opt("mbss"), (1, 2, 4, 8), "mbs"),
        optimizer=optimizer,
    )


def _flag(at: _At, key: str, default: bool) -> bool:
    v = at.opt(key)
    if v is None:
        return default
    if not isinstance(v.value, bool):
        raise v.fail(f"expected true or false, got {v.value!r}")
    return v.value


def _sailor(at: _At) -> ModelProfile:
    from hgopt.profiles.sailor import import_sailor_profile

    at.only({"generator", "root", "model", "gpus", "seq_len"})
    gpus = _strings(at.get("gpus")) if at.has("gpus") else None
    seq = at.opt("seq_len")
    return import_sailor_profile(_dir(at, "root"), at.get("model").string(), gpus,
                                 seq_len=seq.limited("seq_len") if seq else None)


def _metis(at: _At) -> ModelProfile:
    from hgopt.profiles.metis import import_metis_profile

    at.only({"generator", "dir", "seq_len", "hidden", "gpu", "name", "dtype", "bytes_per_param"})
    gpu, name, bpp = at.opt("gpu"), at.opt("name"), at.opt("bytes_per_param")
    return import_metis_profile(
        _dir(at, "dir"),
        seq_len=at.get("seq_len").limited("seq_len"),
        hidden=at.get("hidden").limited("hidden"),
        gpu=gpu.string() if gpu else None,
        name=name.string() if name else None,
        dtype=at.get("dtype").choice(("fp32", "bf16", "fp16")) if at.has("dtype") else "fp16",
        bytes_per_param=bpp.number(positive=True) if bpp else 2.0,
    )
