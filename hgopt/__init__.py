"""hgopt: plans training of one model across heterogeneous, geo-distributed GPU clusters.

The planning path (spec, plan, cost, search) never imports torch; the runner lives in
``hgopt.runner`` and needs the ``runner`` extra.
"""

__version__ = "0.1.0"
