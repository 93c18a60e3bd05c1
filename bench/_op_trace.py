"""Diagnostics for the validation benches: the old name of :mod:`hgopt.profiler.optrace`
(``python -m hgopt.profiler.paced SPEED -m bench._op_trace -m hgopt.runner ARGS...`` still works)."""

from __future__ import annotations

import sys

from hgopt.profiler.optrace import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
