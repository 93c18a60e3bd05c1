"""Build hook (the metadata is in pyproject.toml): the wheel ships the repository's instances.

Every data file under ``instances/`` (the instance YAML files and what they read: profiles, Hugging
Face configs, peer plans; not the ``*.py`` scripts that generate them) is copied into the built
package as ``hgopt/data/instances/``, so that ``hgopt instances`` and ``hgopt show NAME``
work outside a source checkout. The files stay where they are in the repository (one copy, no
duplicate to keep in sync); ``hgopt.instances`` finds them in either place."""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

SHIPPED_SUFFIXES = (".yaml", ".yml", ".json", ".csv", ".txt")
"""Files under instances/ that go into the wheel, by suffix."""


class BuildPyWithInstances(build_py):
    def run(self) -> None:
        super().run()
        src = Path(__file__).resolve().parent / "instances"
        dst = Path(self.build_lib) / "hgopt" / "data" / "instances"
        for f in sorted(src.rglob("*")):
            if f.is_file() and f.suffix in SHIPPED_SUFFIXES and "__pycache__" not in f.parts:
                target = dst / f.relative_to(src)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(f, target)


setup(cmdclass={"build_py": BuildPyWithInstances})
