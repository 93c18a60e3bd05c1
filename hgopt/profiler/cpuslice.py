"""Emulated devices on a CPU host: each rank in its own CPU slice (a cgroup with a CFS bandwidth quota).

On a GPU machine every rank owns its device, so a rank's compute speed does not depend on what the
other ranks do. When the ranks of an emulated run share a few CPU cores that is false: four busy
stages on two cores each run at half speed, and a layer profiled alone is twice too fast. Giving every
rank (and the profiler) a slice of ``cores`` CPU — ``cpu.cfs_quota_us = cores × cpu.cfs_period_us`` —
makes each rank a device of fixed speed again, as long as the slices together fit in the machine
(other processes can still take CPU from them; the benchmarks record the load).

Linux cgroup v1 ``cpu`` controller (``/sys/fs/cgroup/cpu``) or cgroup v2 (``cpu.max``); needs root.
``python -m hgopt.profiler.cpuslice CGROUP -- CMD ...`` joins CGROUP and execs CMD, for use as a
per-rank command prefix.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from pathlib import Path
from typing import Iterator

__all__ = ["cgroup_root", "cpu_slices", "join_slice", "slice_prefix"]

log = logging.getLogger(__name__)

_V1 = Path("/sys/fs/cgroup/cpu")
_V2 = Path("/sys/fs/cgroup")


def cgroup_root() -> Path:
    """The cgroup folder that has CPU bandwidth control; ValueError if there is none."""
    if (_V1 / "cpu.cfs_quota_us").exists():
        return _V1
    if (_V2 / "cgroup.controllers").exists() and "cpu" in (_V2 / "cgroup.controllers").read_text().split():
        return _V2
    raise ValueError("CPU slices need the cgroup cpu controller (/sys/fs/cgroup/cpu or cgroup v2 with cpu); "
                     "run without --cpu-slice")


def _set_quota(path: Path, cores: float, period_us: int, weight: float) -> None:
    quota = max(1000, int(round(cores * period_us)))
    if (path / "cpu.cfs_quota_us").exists():
        (path / "cpu.cfs_period_us").write_text(str(period_us))
        (path / "cpu.cfs_quota_us").write_text(str(quota))
        (path / "cpu.shares").write_text(str(int(1024 * weight)))
    else:
        (path / "cpu.max").write_text(f"{quota} {period_us}")
        (path / "cpu.weight").write_text(str(min(10000, int(100 * weight))))


def _remove(path: Path) -> None:
    """Move whatever still runs in ``path`` to the parent and delete it (retrying briefly)."""
    parent = path.parent / "cgroup.procs"
    for _ in range(50):
        try:
            for pid in (path / "cgroup.procs").read_text().split():
                with contextlib.suppress(OSError):
                    parent.write_text(pid)
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.1)
    log.warning("could not remove cgroup %s", path)


@contextlib.contextmanager
def cpu_slices(names: list[str], cores: float, period_us: int | None = None, weight: float = 1.0) -> Iterator[list[Path]]:
    """One cgroup per name, each capped at ``cores`` CPUs; removed again on exit.

    The throttle is not a uniform slow-down: within each period a slice runs at full speed until its
    quota is spent, then stops. A process that was idle therefore gets up to one quota of work done at
    full speed, and an operation much shorter than the period can run several times faster than the
    slice's average rate. The default period keeps the quota at the kernel's minimum of 1 ms
    (``period = 1 ms / cores``), so that operations of tens of milliseconds see the average rate to
    within a few percent.

    ``weight``: the slice's CPU weight relative to one ordinary process (``cpu.shares`` = 1024·weight).
    Above 1 the slice gets its ``cores`` first when other processes compete for the machine; the quota
    still caps it, so the others keep what the slices leave."""
    if cores <= 0:
        raise ValueError(f"--cpu-slice must be > 0 cores, got {cores}")
    if period_us is None:
        period_us = max(1000, int(round(1000 / cores)))
    if not 1000 <= period_us <= 1_000_000:
        raise ValueError(f"cpu slice period must be in [1000, 1000000] us, got {period_us}")
    made: list[Path] = []
    if not names:
        yield made
        return
    root = cgroup_root()
    try:
        for name in names:
            path = root / f"hgopt-{os.getpid()}-{name}"
            path.mkdir(exist_ok=False)
            made.append(path)
            _set_quota(path, cores, period_us, weight)
        yield made
    finally:
        for path in made:
            _remove(path)


def join_slice(path: Path, pid: int | None = None) -> None:
    """Move process ``pid`` (default: this one) into the slice."""
    (path / "cgroup.procs").write_text(str(pid or os.getpid()))


def slice_prefix(path: Path) -> tuple[str, ...]:
    """Command prefix that runs a command inside the slice."""
    return (sys.executable, "-m", "hgopt.profiler.cpuslice", str(path), "--")


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m hgopt.profiler.cpuslice CGROUP -- CMD [ARGS...]", file=sys.stderr)
        return 2
    join_slice(Path(argv[0]))
    os.execvp(argv[2], argv[2:])
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
