"""The shipped instances: ``instances/*.yaml`` plus the embedded default (``hgopt/data/default.yaml``).
In a source checkout they are read from the repository's ``instances/``; an installed wheel carries
the same files as ``hgopt/data/instances/`` (copied there by setup.py at build time). Everywhere the
CLI takes INSTANCE, a listed name or a path works."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from hgopt.errors import SpecError
from hgopt.spec import Instance, instance_from_dict, load_document

__all__ = ["DEFAULT_INSTANCE", "InstanceEntry", "instance_dirs", "list_instances", "load_instance"]

DEFAULT_INSTANCE = "default"
_PACKAGE_DATA = Path(__file__).resolve().parent / "data"
_WHEEL_INSTANCES = _PACKAGE_DATA / "instances"
_REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True, kw_only=True, slots=True)
class InstanceEntry:
    name: str
    path: Path


def _repo_instances() -> Path | None:
    """``instances/`` of the source checkout this package runs from (None when installed: a folder
    named ``instances`` next to site-packages' ``hgopt`` is not ours)."""
    if (_REPO / "pyproject.toml").is_file() and (_REPO / "instances").is_dir():
        return _REPO / "instances"
    return None


def instance_dirs() -> tuple[Path, ...]:
    """Folders searched for instances: $HGOPT_INSTANCES (colon-separated), the checkout's
    ``instances/`` or the wheel's ``hgopt/data/instances/``, the package's embedded data."""
    extra = [Path(p) for p in os.environ.get("HGOPT_INSTANCES", "").split(os.pathsep) if p]
    shipped = _repo_instances() or _WHEEL_INSTANCES
    return tuple(d for d in (*extra, shipped, _PACKAGE_DATA) if d.is_dir())


def list_instances() -> list[InstanceEntry]:
    """Every ``*.yaml``/``*.yml`` instance file found, by name (the file stem); first folder wins."""
    seen: dict[str, InstanceEntry] = {}
    for d in instance_dirs():
        for p in sorted([*d.glob("*.yaml"), *d.glob("*.yml")]):
            seen.setdefault(p.stem, InstanceEntry(name=p.stem, path=p))
    return sorted(seen.values(), key=lambda e: e.name)


def load_instance(name_or_path: str | Path) -> Instance:
    """Load a listed instance by name, or any instance file by path."""
    p = Path(name_or_path)
    if not p.exists():
        matches = [e for e in list_instances() if e.name == str(name_or_path)]
        if not matches:
            names = ", ".join(e.name for e in list_instances())
            raise SpecError(str(name_or_path), "<file>", f"no such file or listed instance (listed: {names})")
        p = matches[0].path
    return instance_from_dict(load_document(p), str(p), p.parent)
