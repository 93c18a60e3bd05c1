"""Export a plan for the PyTorch runner: the runner plan (JSON) and the torchrun command of every node.

Nothing here imports torch; :mod:`hgopt.runner` reads what this writes.
"""

from hgopt.export.build import ExportOptions, build_runner_plan
from hgopt.export.commands import ExportFiles, node_command, write_export
from hgopt.export.runner_plan import RunnerPlan, load_runner_plan

__all__ = [
    "ExportFiles",
    "ExportOptions",
    "RunnerPlan",
    "build_runner_plan",
    "load_runner_plan",
    "node_command",
    "write_export",
]
