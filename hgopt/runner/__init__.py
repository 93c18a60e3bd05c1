"""PyTorch runner for exported hgopt plans (``python -m hgopt.runner --plan DIR/plan.json``).

Modules (torch is imported by the modules, not by this package, so ``python -m hgopt.runner.store``
and the exporter stay light):

* :mod:`~hgopt.runner.model` — the GPT-style model built layer by layer (also for profiling);
* :mod:`~hgopt.runner.tp` — Megatron-style tensor parallelism with explicit collectives;
* :mod:`~hgopt.runner.codec` — boundary compression (bf16/fp16 casts, fp8 with scale);
* :mod:`~hgopt.runner.engine` — one rank's step: 1F1B/GPipe, re-sharded boundaries, gradient sync;
* :mod:`~hgopt.runner.worker` — a rank's life: rendezvous, training loop, metrics, checkpoints;
* :mod:`~hgopt.runner.launch` — every rank on this machine, with optional link emulation;
* :mod:`~hgopt.runner.reference` — the same training in one process (cross-check);
* :mod:`~hgopt.runner.timing` — per-layer forward/backward timing of the same model.
"""
