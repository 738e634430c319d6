"""The `disttrain` command: a small dispatcher over subcommands.

Each subcommand is one `add_<name>_parser(subparsers)` function that builds its
argparse parser and sets `handler=<function(args) -> exit code>`; register it in
`COMMANDS`. Handlers turn flags into a validated config and call the library
(`run` -> disttrain/launch/, `checkpoint` -> disttrain/checkpoint/, `plan` -> plan.py,
`cluster` -> disttrain/cluster/ (its `run`: disttrain/launch/), `report` -> disttrain/trace/report.py, `ps` -> disttrain/ps/cli.py), so the library
never sees argparse.
"""

from __future__ import annotations

import argparse
import functools
import sys

from disttrain import __version__
from disttrain.checkpoint.cli import add_checkpoint_parser
from disttrain.cluster.cli import add_cluster_parser
from disttrain.launch.cli import add_run_parser, run_cluster_command
from disttrain.plan import add_plan_parser
from disttrain.plan import bound as plan_bound
from disttrain.ps.cli import add_ps_parser
from disttrain.trace.report import add_report_parser

__all__ = ["main", "build_parser"]

COMMANDS = (add_run_parser, add_plan_parser, add_checkpoint_parser,
            functools.partial(add_cluster_parser, run=run_cluster_command),
            functools.partial(add_report_parser, bound=plan_bound),
            add_ps_parser)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="disttrain",
        description="Distributed training of PyTorch models: launch jobs and inspect strategies.",
    )
    parser.add_argument("--version", action="version", version=f"disttrain {__version__}")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    for add in COMMANDS:
        add(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `disttrain` script; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "handler"):
        parser.print_help()
        return 2
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
