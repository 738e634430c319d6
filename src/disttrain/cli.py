"""The `disttrain` command: a small dispatcher over subcommands.

Each subcommand is one `add_<name>_parser(subparsers)` function that builds its
argparse parser and sets `handler=<function(args) -> exit code>`; register it in
`COMMANDS` through a small function that imports it, so that a command imports only its
own modules. Handlers turn flags into a validated config and call the library
(`run` -> disttrain/launch/, `checkpoint` -> disttrain/checkpoint/, `plan` -> plan.py,
`cluster` -> disttrain/cluster/ (its `run`: disttrain/launch/), `report` -> disttrain/trace/report.py, `ps` -> disttrain/ps/cli.py), so the library
never sees argparse.
"""

from __future__ import annotations

import argparse
import sys

from disttrain import __version__

__all__ = ["main", "build_parser"]


# NOTE: each subcommand's modules are imported only when it is chosen (or for the full
# help): `disttrain cluster ...` and `--version` then never import torch (seconds).
def _run(subparsers) -> None:
    from disttrain.launch.cli import add_run_parser
    add_run_parser(subparsers)


def _plan(subparsers) -> None:
    from disttrain.plan import add_plan_parser
    add_plan_parser(subparsers)


def _checkpoint(subparsers) -> None:
    from disttrain.checkpoint.cli import add_checkpoint_parser
    add_checkpoint_parser(subparsers)


def _cluster(subparsers) -> None:
    from disttrain.cluster.cli import add_cluster_parser
    from disttrain.launch.cli import run_cluster_command
    add_cluster_parser(subparsers, run=run_cluster_command)


def _report(subparsers) -> None:
    from disttrain.plan import bound
    from disttrain.trace.report import add_report_parser
    add_report_parser(subparsers, bound=bound)


def _ps(subparsers) -> None:
    from disttrain.ps.cli import add_ps_parser
    add_ps_parser(subparsers)


COMMANDS = {"run": _run, "plan": _plan, "checkpoint": _checkpoint, "cluster": _cluster,
            "report": _report, "ps": _ps}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole parser; with `command`, only that subcommand's (none if it is not one)."""
    parser = argparse.ArgumentParser(
        prog="disttrain",
        description="Distributed training of PyTorch models: launch jobs and inspect strategies.",
    )
    parser.add_argument("--version", action="version", version=f"disttrain {__version__}")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    for name, add in COMMANDS.items():
        if command in (None, name):
            add(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `disttrain` script; returns the process exit code."""
    words = sys.argv[1:] if argv is None else argv
    first = words[0] if words else None
    # NOTE: an unknown word, --help or no word at all needs every subcommand, to list them.
    parser = build_parser(first if first in COMMANDS or first == "--version" else None)
    args = parser.parse_args(argv)
    if not hasattr(args, "handler"):
        parser.print_help()
        return 2
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
