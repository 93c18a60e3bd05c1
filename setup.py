"""Build hook (the metadata is in pyproject.toml): the wheel ships the repository's instances.

``instances/*.yaml`` and the profile files they read (``instances/profiles/*.json``) are copied into
the built package as ``hgopt/data/instances/``, so that ``hgopt instances`` and ``hgopt show NAME``
work outside a source checkout. The files stay where they are in the repository (one copy, no
duplicate to keep in sync); ``hgopt.instances`` finds them in either place."""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

SHIPPED = ("*.yaml", "profiles/*.json")
"""Patterns under instances/ that go into the wheel."""


class BuildPyWithInstances(build_py):
    def run(self) -> None:
        super().run()
        src = Path(__file__).resolve().parent / "instances"
        dst = Path(self.build_lib) / "hgopt" / "data" / "instances"
        for pattern in SHIPPED:
            for f in sorted(src.glob(pattern)):
                target = dst / f.relative_to(src)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(f, target)


setup(cmdclass={"build_py": BuildPyWithInstances})
