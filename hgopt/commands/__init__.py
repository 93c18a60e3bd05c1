"""One module per ``hgopt`` subcommand; each exposes ``register(subparsers)``."""
