"""Baseline planners, each implemented from its published description (see docs/planners.md)."""
