"""The one cost model: tables built from the instance, and ``evaluate`` that scores every plan."""

from hgopt.cost.evaluate import Evaluation, PipelineReport, StageReport, evaluate
from hgopt.cost.tables import CostTables, build_tables

__all__ = ["CostTables", "Evaluation", "PipelineReport", "StageReport", "build_tables", "evaluate"]
