"""`python -m disttrain.cluster up|down|list|show ...`: the same as `disttrain cluster ...`."""

import argparse
import sys

from disttrain.cluster.cli import add_cluster_parser


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="disttrain")
    add_cluster_parser(parser.add_subparsers())
    args = parser.parse_args(["cluster", *(sys.argv[1:] if argv is None else argv)])
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
