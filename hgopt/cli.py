"""Command-line entry point ``hgopt``. Each subcommand lives in ``hgopt/commands/<name>.py`` and
exposes ``register(subparsers)``; user errors (SpecError, PlanError, ValueError raised for bad
settings) print one line and exit with status 2, never a traceback.

``-v/--verbose`` (debug logging) and ``-q/--quiet`` (warnings and errors only; no progress lines) are
accepted before or after the subcommand; commands read them as ``args.verbose`` / ``args.quiet``."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import time

from hgopt import __version__
from hgopt.errors import PlanError, SpecError, truncate

__all__ = ["COMMANDS", "build_parser", "main"]

# Subcommand modules under hgopt.commands, in the order `hgopt --help` lists them.
COMMANDS: tuple[str, ...] = (
    "instances", "show", "init", "evaluate", "profile", "compare", "export", "plan", "export_model", "model",
    "simulate",  # simulate: added by the sim helper
    "replan",  # replan: re-planning for changed resources (issue 14)
)


def _add_verbosity(p: argparse.ArgumentParser, default: object) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("-v", "--verbose", action="store_true", default=default, help="debug logging")
    g.add_argument("-q", "--quiet", action="store_true", default=default,
                   help="only warnings and errors on stderr (no progress lines)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hgopt",
        description="Plan training of one model across heterogeneous, geo-distributed GPU clusters.",
    )
    parser.add_argument("--version", action="version", version=f"hgopt {__version__}")
    _add_verbosity(parser, False)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"hgopt.commands.{name}").register(sub)
    for sp in dict.fromkeys(sub.choices.values()):  # after the subcommand too; SUPPRESS keeps the top-level value
        _add_verbosity(sp, argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    rc = _main(argv)
    if argv is None:  # sigint: the process's own command line: a search thread left running ends with it
        from hgopt.commands._search import exit_past_searches

        exit_past_searches(rc)
    return rc


def _main(argv: list[str] | None) -> int:
    started = time.monotonic()
    if argv is None:  # deadline: the process's own command line: its limit counts from the process start
        from hgopt.commands._deadline import process_elapsed_s

        started -= process_elapsed_s()
    parser = build_parser()
    args = parser.parse_args(argv)
    args.started_at = started  # deadline: when a command's --time-limit started (time.monotonic)
    if args.verbose and args.quiet:
        parser.error("-v/--verbose and -q/--quiet exclude each other")
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING if args.quiet else logging.INFO,
        format="%(message)s",
        stream=sys.stderr,
    )
    try:
        return int(args.func(args) or 0)
    except (SpecError, PlanError) as exc:
        print(f"hgopt: error: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"hgopt: error: {truncate(str(exc), 2000)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("hgopt: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into `head` and closed early
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as exc:  # a file that cannot be read or written after all (full disk, permissions, ...)
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"hgopt: error: {where}{exc.strerror or exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
