"""Diagnostics: per stage of a pipelined profile (``hgopt profile --pipeline N --pipeline-dir DIR``), the
device time in the profiling run (median over its replicas and steps 2..) against the same layers timed
one by one (``DIR/profile-layers.json``).
  PYTHONPATH=$PWD python bench/validation_diag/pipelined_factors.py DIR PACE
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from hgopt.profiler.pipelined import balanced_cuts, stage_times_of_run


def main(folder: Path, pace: float) -> None:
    layers = json.loads((folder / "profile-layers.json").read_text())
    for t in layers["timings"]:
        mbs = t["mbs"]
        traces = [json.loads(f.read_text()) for f in sorted((folder / f"mbs{mbs}" / "trace").glob("ops-*.json"))]
        stages = 1 + max(tr[0]["stage"] for tr in traces)
        cuts = balanced_cuts([f + b for f, b in zip(t["fwd"], t["bwd"])], stages)
        measured = stage_times_of_run(traces, cuts, mbs, pace=pace, use_steps=range(2, len(traces[0]) + 1))
        for s in sorted(measured, key=lambda s: s.start):
            pf, pb, pu = (sum(t[k][s.start:s.end]) for k in ("fwd", "bwd", "update"))
            print(f"mbs {mbs} stage [{s.start},{s.end}) fwd {s.fwd_s:.4f}/{pf:.4f} ({s.fwd_s / pf - 1:+.0%}) "
                  f"bwd {s.bwd_s:.4f}/{pb:.4f} ({s.bwd_s / pb - 1:+.0%}) "
                  f"update {s.update_s or 0:.4f}/{pu:.4f} ({(s.update_s or 0) / pu - 1:+.0%})")


if __name__ == "__main__":
    main(Path(sys.argv[1]), float(sys.argv[2]))
