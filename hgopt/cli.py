"""Command-line entry point ``hgopt``. Each subcommand lives in ``hgopt/commands/<name>.py`` and
exposes ``register(subparsers)``; user errors (SpecError, PlanError, ValueError raised for bad
settings) print one line and exit with status 2, never a traceback."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from hgopt.errors import PlanError, SpecError

__all__ = ["main"]

# Subcommand modules under hgopt.commands, in the order `hgopt --help` lists them.
COMMANDS: tuple[str, ...] = ("instances", "show", "evaluate", "profile", "compare", "export", "plan", "export_model",
                            "simulate")  # simulate: added by the sim helper


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hgopt",
        description="Plan training of one model across heterogeneous, geo-distributed GPU clusters.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"hgopt.commands.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(message)s",
        stream=sys.stderr,
    )
    try:
        return int(args.func(args) or 0)
    except (SpecError, PlanError) as exc:
        print(f"hgopt: error: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"hgopt: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("hgopt: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into `head` and closed early
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
