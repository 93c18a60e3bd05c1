"""Checks of the files and folders a command will write, run before any work starts, so that a bad
``-o`` fails in a second with a clear message instead of after a long search (with a traceback)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["check_output_dir", "check_output_file"]


def _writable_dir(d: Path, option: str, target: Path) -> None:
    if not d.exists():
        raise ValueError(f"{option}: cannot write {target}: folder {d} does not exist")
    if not d.is_dir():
        raise ValueError(f"{option}: cannot write {target}: {d} is not a folder")
    if not os.access(d, os.W_OK | os.X_OK):
        raise ValueError(f"{option}: cannot write {target}: folder {d} is not writable")


def check_output_file(path: str | os.PathLike[str] | None, option: str) -> None:
    """``path`` can be written as a file: it is not a folder, its folder exists and is writable, and an
    existing file there is writable. ValueError naming ``option`` otherwise; ``None`` passes."""
    if path is None:
        return
    p = Path(path)
    if str(path) == "" or p.is_dir():
        raise ValueError(f"{option}: {str(path)!r} is a folder, expected a file name")
    _writable_dir(p.parent if str(p.parent) else Path("."), option, p)
    if p.exists() and not os.access(p, os.W_OK):
        raise ValueError(f"{option}: cannot write {p}: the file exists and is not writable")


def check_output_dir(path: str | os.PathLike[str], option: str) -> None:
    """``path`` is a writable folder or can be created (its nearest existing parent is a writable
    folder). ValueError naming ``option`` otherwise."""
    p = Path(path)
    if str(path) == "":
        raise ValueError(f"{option}: expected a folder name, got ''")
    if p.exists():
        if not p.is_dir():
            raise ValueError(f"{option}: {p} exists and is not a folder")
        _writable_dir(p, option, p)
        return
    parent = p.absolute().parent
    while not parent.exists():
        parent = parent.parent
    _writable_dir(parent, option, p)
