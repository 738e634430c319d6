"""`disttrain cluster up|down|list|show|run`: the parser and its handlers (library: net.py).

`run` starts a job, which is the launcher's (disttrain/launch/): the dispatcher (cli.py)
passes its handler in, so this package never imports the launcher.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

__all__ = ["add_cluster_parser"]

EPILOG = """\
examples:
  disttrain cluster up lab --nodes 4 --link 1gbit                 4 nodes on one switch
  disttrain cluster up lab --nodes 4 --link 10gbit --switch 20gbit --cpus-per-node 0.5
  disttrain cluster up lab --nodes 8 --link 1gbit --topology ring
  disttrain run --cluster lab --nproc-per-node 2 train.py          one agent per node
  disttrain cluster show lab
  disttrain cluster down lab                                        idempotent

Nodes are network namespaces dt-NAME-n0.. with addresses 10.213.K.100.. (a range used
only inside them). Rates are tc rates: 100mbit, 1gbit, 10gbit. Needs root.
"""


def add_cluster_parser(subparsers, run: Callable[[argparse.Namespace], int]) -> None:
    """Add `cluster` and its actions; `run(args)` handles `cluster run` (launch/cli.py)."""
    p = subparsers.add_parser(
        "cluster", help="emulate a multi-node cluster on this machine (namespaces, shaped links)",
        description="Create, inspect and remove emulated clusters.", epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(title="actions", metavar="ACTION")
    up = sub.add_parser("up", help="create a cluster", epilog=EPILOG,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    up.add_argument("name", help="cluster name: a lowercase letter then up to 9 letters or digits")
    up.add_argument("--nodes", type=int, required=True, help="number of nodes")
    up.add_argument("--link", required=True, help="rate of every link, each way (e.g. 1gbit)")
    up.add_argument("--topology", default="switch", choices=("switch", "full", "ring"),
                    help="switch: one bridge; full: a link per pair; ring: neighbours only")
    up.add_argument("--switch", help="switch topology: the switch's total capacity (e.g. 2gbit)")
    up.add_argument("--cpus-per-node", type=float,
                    help="CPU quota (cores) that all processes of a node share")
    up.set_defaults(handler=_up)
    down = sub.add_parser("down", help="remove a cluster and whatever still runs in it")
    down.add_argument("name", nargs="?", help="cluster name")
    down.add_argument("--all", action="store_true", help="remove every disttrain cluster and leftover")
    down.set_defaults(handler=_down)
    sub.add_parser("list", help="list clusters").set_defaults(handler=_list)
    show = sub.add_parser("show", help="nodes, addresses, links and rates of a cluster")
    show.add_argument("name")
    show.set_defaults(handler=_show)
    runner = sub.add_parser("run", help="run a script on every node (= disttrain run --cluster NAME)")
    runner.add_argument("name", help="cluster name")
    runner.add_argument("--nproc-per-node", type=int, help="processes per node (default 1)")
    runner.add_argument("--workers", type=int, help="parameter server: workers in the job")
    runner.add_argument("--servers", type=int, help="parameter server: servers in the job")
    runner.add_argument("--master-port", type=int, default=29500, help="rendezvous port on node 0")
    runner.add_argument("--timeout", type=float, help="collective timeout in seconds (as disttrain run)")
    runner.add_argument("--trace", metavar="DIR", help="trace every node's ranks into DIR/trace.json (as disttrain run)")
    runner.add_argument("script")
    runner.add_argument("script_args", nargs=argparse.REMAINDER)
    runner.set_defaults(handler=run)
    p.set_defaults(handler=lambda args: (p.print_help(), 2)[1])


def _fail(err: Exception, code: int) -> int:
    print(f"disttrain cluster: error: {err}", file=sys.stderr)
    return code


def _up(args: argparse.Namespace) -> int:
    from disttrain.cluster import net, spec

    try:
        c = spec.Cluster(args.name, args.nodes, spec.parse_rate(args.link), args.topology,
                         spec.parse_rate(args.switch) if args.switch else None, args.cpus_per_node)
    except ValueError as err:
        return _fail(err, 2)
    try:
        net.up(c)
    except (net.ClusterError, OSError, RuntimeError) as err:
        return _fail(err, 1)
    print(c.describe())
    return 0


def _down(args: argparse.Namespace) -> int:
    from disttrain.cluster import net, spec

    if not args.name and not args.all:
        return _fail(ValueError("name a cluster (`disttrain cluster down NAME`) or pass --all"), 2)
    names = [args.name] if args.name else sorted(set(spec.saved_names()) | {
        ns[len(spec.PREFIX):].rsplit("-", 1)[0] for ns in net.leftover_namespaces()})
    try:
        for name in names:
            removed = net.down(name)
            print(f"cluster {name}: " + (f"removed {len(removed)} namespaces/cgroups/files"
                                         if removed else "nothing to remove"))
    except net.ClusterError as err:
        return _fail(err, 1)
    return 0


def _list(args: argparse.Namespace) -> int:
    from disttrain.cluster import net, spec

    names = spec.saved_names()
    for name in names:
        c = spec.load(name)
        print(f"{name:<10} {c.nodes} nodes  {c.topology:<6} {spec.format_rate(c.link_bps)}"
              + (f"  {c.cpus_per_node:g} cores/node" if c.cpus_per_node else ""))
    orphans = [ns for ns in net.leftover_namespaces()
               if ns[len(spec.PREFIX):].rsplit("-", 1)[0] not in names]
    for ns in orphans:
        print(f"leftover namespace {ns}: remove it with `disttrain cluster down --all`")
    if not names and not orphans:
        print("no clusters (make one with `disttrain cluster up NAME --nodes 2 --link 1gbit`)")
    return 0


def _show(args: argparse.Namespace) -> int:
    from disttrain.cluster import net, spec

    try:
        c = spec.load(args.name)
    except ValueError as err:
        return _fail(err, 1)
    print(c.describe())
    missing = sorted(set(c.namespaces()) - set(net.leftover_namespaces(c.name)))
    if missing:
        print(f"  damaged: namespaces {', '.join(missing)} are gone; "
              f"`disttrain cluster down {c.name}` and bring it up again")
        return 1
    return 0
