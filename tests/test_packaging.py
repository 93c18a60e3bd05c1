"""The wheel carries the shipped instances: build it from a copy of the sources, install it into a
fresh virtual environment and run ``hgopt`` from outside the checkout.

No network: the wheel is built without build isolation (this interpreter's setuptools, from the
``test`` extra; without it pip fetches setuptools from PyPI) and installed with ``--no-deps --no-index``; the fresh environment reaches the dependencies (numpy, ortools, ...)
through a ``.pth`` line naming the folders this interpreter imports them from. ``hgopt`` itself must
come from the fresh environment, which the test checks. About 5 s."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import hgopt

REPO = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "hgopt", "instances")
DEPENDENCIES = ("numpy", "yaml", "ortools", "pulp", "highspy", "matplotlib")

pytestmark = pytest.mark.packaging


def _run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{cmd}: {r.stdout}\n{r.stderr}"
    return r


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str], Path]:
    """(venv bin folder, environment without PYTHONPATH, a working folder outside the checkout)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in SOURCES:
        p = REPO / name
        if p.is_dir():
            shutil.copytree(p, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(p, src / name)
    # this interpreter's setuptools (the `test` extra installs it); without it pip fetches one from PyPI
    isolation = ["--no-build-isolation"] if importlib.util.find_spec("setuptools") else []
    _run([sys.executable, "-m", "pip", "wheel", ".", "--no-deps", *isolation, "-q", "-w", str(tmp / "dist")], cwd=src)
    wheels = list((tmp / "dist").glob("hgopt-*.whl"))
    assert len(wheels) == 1, wheels
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp)
    py = venv / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index", "--force-reinstall", "-q", str(wheels[0])],
         cwd=tmp)
    purelib = _run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=tmp).stdout.strip()
    dep_dirs = sorted({str(Path(importlib.import_module(m).__file__).resolve().parents[1]) for m in DEPENDENCIES})
    (Path(purelib) / "_hgopt_test_deps.pth").write_text("\n".join(dep_dirs) + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "HGOPT_INSTANCES")}
    work = tmp / "elsewhere"
    work.mkdir()
    return venv / "bin", env, work


def test_the_package_comes_from_the_fresh_venv(installed: tuple[Path, dict[str, str], Path]) -> None:
    bin_dir, env, work = installed
    r = _run([str(bin_dir / "python"), "-c", "import hgopt; print(hgopt.__file__)"], cwd=work, env=env)
    assert Path(r.stdout.strip()).is_relative_to(bin_dir.parent), r.stdout
    assert not Path(r.stdout.strip()).is_relative_to(REPO)
    assert _run([str(bin_dir / "hgopt"), "--version"], cwd=work, env=env).stdout.strip() == f"hgopt {hgopt.__version__}"


def test_every_repository_instance_is_listed_and_loads(installed: tuple[Path, dict[str, str], Path]) -> None:
    bin_dir, env, work = installed
    rows = json.loads(_run([str(bin_dir / "hgopt"), "instances", "--json"], cwd=work, env=env).stdout)
    by_name = {r["name"]: r for r in rows}
    expected = {p.stem for p in (REPO / "instances").glob("*.yaml")} | {"default"}
    assert set(by_name) == expected
    for name, row in by_name.items():
        assert row["error"] == "", (name, row["error"])
        assert Path(row["path"]).is_relative_to(bin_dir.parent), row["path"]
        raw = yaml.safe_load((REPO / "instances" / f"{name}.yaml").read_text()) if name != "default" else None
        if raw is not None:
            assert row["clusters"] == len(raw["topology"]["clusters"]), name


@pytest.mark.parametrize("name", ["geo-4r-llama7b", "sailor-het-16+16"])
def test_show_a_shipped_instance_outside_the_checkout(installed: tuple[Path, dict[str, str], Path], name: str) -> None:
    """geo-4r: the analytic generator; sailor-het: a model profile read from profiles/*.json."""
    bin_dir, env, work = installed
    out = _run([str(bin_dir / "hgopt"), "show", name], cwd=work, env=env).stdout
    assert out.startswith(f"instance {name}  (") and "site-packages" in out.splitlines()[0]
    assert "clusters (" in out


def test_every_data_file_under_instances_is_in_the_wheel(installed: tuple[Path, dict[str, str], Path]) -> None:
    """What an instance may read (profiles, configs, peer plans) travels with it; the scripts do not."""
    bin_dir, env, work = installed
    r = _run([str(bin_dir / "python"), "-c", "import hgopt, pathlib; print(pathlib.Path(hgopt.__file__).parent)"],
             cwd=work, env=env)
    shipped = Path(r.stdout.strip()) / "data" / "instances"
    src = REPO / "instances"
    wanted = {f.relative_to(src) for f in src.rglob("*") if f.is_file() and f.suffix in (".yaml", ".json")}
    got = {f.relative_to(shipped) for f in shipped.rglob("*") if f.is_file()}
    assert wanted <= got and not any(f.suffix == ".py" for f in got), sorted(map(str, got))
