"""The ``pipeloom`` command line: one module per command, the run's shared flags in :mod:`.flags`."""

from __future__ import annotations

import argparse
import os
import sys

from ..errors import PipeloomError
from ..techniques import load_plugins
from . import generate, plan, profile, simulate, train


def main(argv: list[str] | None = None) -> int:
    try:
        try:
            return _main(sys.argv[1:] if argv is None else list(argv))
        finally:
            sys.stdout.flush()  # a reader that went away (`| head`) shows here, not at exit
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing left for the exit to flush
        return 141  # 128 + SIGPIPE, as for any command whose reader stopped
    except KeyboardInterrupt:
        return 130  # 128 + SIGINT


def _main(argv: list[str]) -> int:
    try:
        load_plugins()  # before the flags: plug-in techniques add theirs
    except PipeloomError as err:
        print(f"pipeloom: error: {err}", file=sys.stderr)
        return 2
    args = _parser().parse_args(argv)
    args.argv = argv[argv.index(args.command) + 1:]  # what a subcommand was given, to pass on
    try:
        return args.run(args)
    except PipeloomError as err:
        print(f"pipeloom {args.command}: error: {err}", file=sys.stderr)
        return 2


class _Parser(argparse.ArgumentParser):
    """argparse, with a mistake said in one line (not the whole usage first), and no abbreviated
    flags (``--kfac`` is not taken for ``--kfac-every``)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        #: the subcommands' parsers by name (set on the top parser)
        self.commands: dict[str, argparse.ArgumentParser] = {}

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_args(self, args=None, namespace=None):
        """As argparse's, an unknown flag said by the subcommand it was given to."""
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:
            (self.commands.get(getattr(parsed, "command", None)) or self).error(
                f"unrecognized arguments: {' '.join(extra)}")
        return parsed


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="pipeloom", description="Plan, simulate, draw and run pipeline-parallel training.")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in (simulate, profile, plan, train, generate):
        command.add_parser(sub)
    parser.commands = sub.choices
    return parser
