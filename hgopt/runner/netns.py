"""``python -m hgopt.runner.netns up|down DIR/plan.json``: the link-emulation namespaces for the per-node
torchrun scripts of an exported plan (see :mod:`hgopt.export.netns`). Needs root; no torch."""

from hgopt.export.netns import main

if __name__ == "__main__":
    raise SystemExit(main())
