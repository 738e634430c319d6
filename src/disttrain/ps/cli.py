"""`disttrain ps`: look at and steer a parameter-server group through its server manager.

`disttrain ps status ADDR` prints the ring (version, servers, their keys, bytes, load,
replica chains, membership events); `disttrain ps manager --state FILE` runs a manager by
hand (or again after it died: same file, same address, same ring version); `disttrain
ps drain ADDR --server i` asks it to take a server off the ring: with replicas=1 its keys
move to the other servers while workers train, then it leaves (move.py); with replicas >= 2
its copies take its keys over once it handed over, then it leaves (handover.py); refused
for the last live copy of a key, or a second drain;
`disttrain ps add-server ADDR --workers W -- script.py [args]` starts the job's script as
a server that joins the job and takes its share of the keys while workers train (join_moves.py). ADDR is the manager's address, as `disttrain run
--servers` prints it, or its state file. Every request goes over the job's authenticated
wire: DISTTRAIN_SECRET must be the job's.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys

from disttrain import settings
from disttrain.ps.manager_link import ManagerError, ManagerLink, status_party

__all__ = ["add_ps_parser", "format_status"]


def add_ps_parser(subparsers) -> None:
    p = subparsers.add_parser("ps", help="inspect a parameter-server group (its server manager)",
                              description=__doc__.split("\n\n")[1])
    sub = p.add_subparsers(title="ps commands", metavar="PS_COMMAND")
    s = sub.add_parser("status", help="servers, keys, load, ring version, replica chains")
    s.add_argument("addr", metavar="ADDR", help="manager address (ipc://... or tcp://...) "
                   "or its state file")
    s.add_argument("--timeout", type=float, default=5.0, help="seconds to wait (default 5)")
    s.add_argument("--keys", type=int, default=40, help="keys to list (default 40; 0: none)")
    s.set_defaults(handler=_status)
    d = sub.add_parser("drain", help="take a server off the ring; with replicas=1 its keys "
                           "move to the others first, with replicas >= 2 its copies take "
                           "them over (refused for the last copy)")
    d.add_argument("addr", metavar="ADDR")
    d.add_argument("--server", type=int, required=True, help="the server's index")
    d.add_argument("--timeout", type=float, default=5.0)
    d.set_defaults(handler=_drain)
    a = sub.add_parser("add-server", help="start a script as a server joining the running "
                       "job: it takes its share of the keys while workers train (any replicas)")
    a.add_argument("rest", nargs=argparse.REMAINDER, metavar="ADDR --workers W -- script.py "
                   "[args]", help="the manager's address, the job's number of workers, then "
                   "after -- the job's script and its arguments")
    a.set_defaults(handler=_add_server)
    m = sub.add_parser("manager", help="run a server manager (blocks; SIGTERM stops it)")
    m.add_argument("--state", required=True, help="JSON state file (reloaded if it exists)")
    m.add_argument("--host", default="127.0.0.1", help="interface to bind (default loopback)")
    m.add_argument("--timeout", type=float, default=10.0,
                   help="seconds without a heartbeat before a server is marked dead")
    m.set_defaults(handler=_manager)
    p.set_defaults(handler=lambda _: p.print_help() or 2)


def _address(addr: str) -> str:
    if os.path.isfile(addr):
        with open(addr) as f:
            return json.load(f)["address"]
    return addr


def _ask(args, op: str, **meta):
    """(answer, None) or (None, exit code) after printing the error."""
    try:
        link = ManagerLink(_address(args.addr), status_party(), timeout=args.timeout)
    except (RuntimeError, OSError, ValueError, KeyError) as e:
        print(f"disttrain ps {args.cmd}: error: {e}", file=sys.stderr)
        return None, 2
    try:
        if op != "status":
            link.request("lookup")  # NOTE: a change is asked on the current ring version
        return link.request(op, **meta), None
    except ManagerError as e:
        print(f"disttrain ps {args.cmd}: error: {e}", file=sys.stderr)
        return None, 1
    finally:
        link.close()


def _status(args) -> int:
    args.cmd = "status"
    reply, code = _ask(args, "status")
    if reply is None:
        return code
    print(format_status(reply.meta, _address(args.addr), args.keys))
    return 0


def _drain(args) -> int:
    args.cmd = "drain"
    reply, code = _ask(args, "leave", server=args.server)
    if reply is None:
        return code
    state = next((r["state"] for r in reply.meta["servers"] if r["server"] == args.server), "")
    print(f"server {args.server} left the ring: ring version {reply.meta['version']}"
          if state != "leaving" else f"server {args.server} is leaving: ring version "
          f"{reply.meta['version']}; its keys move to the other servers while workers train, "
          "then it leaves (`disttrain ps status` shows it)")
    return 0


def _add_server(args) -> int:
    """Run the script as a joining server (blocks until it ends); its exit code."""
    cut = args.rest.index("--") if "--" in args.rest else len(args.rest)
    head, script = args.rest[:cut], args.rest[cut + 1:]
    p = argparse.ArgumentParser(prog="disttrain ps add-server", add_help=False,
                                exit_on_error=False)
    p.add_argument("addr")
    p.add_argument("--workers", type=int)
    try:
        args = p.parse_args(head)
    except (argparse.ArgumentError, SystemExit):
        args = None
    if args is None or not script or not args.workers or args.workers < 1:
        print("disttrain ps add-server: error: usage: disttrain ps add-server ADDR --workers W "
              "-- script.py [args] (W: the job's number of workers; the job's script and "
              "arguments after --)", file=sys.stderr)
        return 2
    if not settings.current().secret:
        print("disttrain ps add-server: error: DISTTRAIN_SECRET is not set: export the job's "
              "(the joining server speaks the job's authenticated wire)", file=sys.stderr)
        return 2
    env = {k: v for k, v in os.environ.items() if k not in _GROUP_VARS
           and not k.startswith("TORCHELASTIC_")}  # NOTE: no process group to join
    address = _address(args.addr)
    env.update({settings.PS_MANAGER: address, settings.PS_JOIN: str(args.workers)})
    index = _next_index(address)
    code = subprocess.run([sys.executable, *script], env=env).returncode
    if code >= 0:
        return code
    name = f"server {index}" if index is not None else "the joining server"
    print(f"disttrain ps add-server: error: {name} (the joining server's process, "
          f"{script[0]}) was killed by {_signal_name(-code)}: exit {128 - code}; the "
          "manager marks it dead once its heartbeats stop (`disttrain ps status` names "
          "who kept its keys)", file=sys.stderr)
    return 128 - code  # NOTE: the shell's 128+n for signal n, as `disttrain run` reports a rank


def _next_index(address: str) -> int | None:
    """The index a joiner takes (ps.join: one past the ring's highest), asked of the manager
    before it starts (blocks up to 5 s); None when the manager does not answer."""
    try:
        link = ManagerLink(address, status_party(), timeout=5.0)
    except (RuntimeError, OSError, ValueError):
        return None
    try:
        ring = link.request("lookup").meta
        return max([r["server"] for r in ring["servers"]] + [-1]) + 1
    except (ManagerError, KeyError, TypeError):
        return None
    finally:
        link.close()


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


_GROUP_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
               "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _manager(args) -> int:
    from disttrain.ps.manager import serve_manager
    serve_manager(args.state, host=args.host, timeout=args.timeout)
    return 0


def format_status(state: dict, address: str, max_keys: int = 40) -> str:
    """The `state` answer as the table `disttrain ps status` prints."""
    rows = state["servers"]
    alive = sum(r["state"] == "alive" for r in rows)
    out = [f"ring version {state['version']}: {alive} of {state['expected']} servers alive "
           f"(manager {address})",
           f"{'server':>6}  {'state':<7} {'keys':>5} {'MB':>9} {'version':>8} {'pushes':>8} "
           f"{'push/s':>8} {'silent':>7}  address"]
    for r in rows:
        out.append(f"{r['server']:>6}  {r['state']:<7} {r['keys']:>5} {r['bytes'] / 1e6:>9.3f} "
                   f"{r['version']:>8} {r['pushes']:>8} {r['rate']:>8.1f} "
                   f"{r['silent']:>6.1f}s  {r['address']}")
    keys = state["shard"]
    if keys and max_keys:
        out.append(f"keys ({len(keys)}; replica chain: owner first):")
        out += [f"  {k['key']:<40} {k['bytes'] / 1e6:>9.3f} MB  server {k['server']}  chain "
                + " -> ".join(str(c) for c in k["chain"]) for k in keys[:max_keys]]
        if len(keys) > max_keys:
            out.append(f"  ... {len(keys) - max_keys} more (--keys N)")
    if state["rejected"]:
        out.append("frames refused by the manager: " + ", ".join(
            f"{k} {n}" for k, n in state["rejected"].items()))
    if state["events"]:
        out.append("events:")
        out += [f"  {e}" for e in state["events"]]
    return "\n".join(out)
