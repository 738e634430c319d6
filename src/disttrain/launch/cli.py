"""`disttrain run`'s flags: the parser and the handler that builds a RunConfig (job.py)."""

from __future__ import annotations

import argparse
import os
import sys

__all__ = ["add_run_parser", "run_cluster_command"]

RUN_EPILOG = """\
examples:
  disttrain run --nproc 4 train.py --lr 3e-4          data parallel, 4 processes
  disttrain run --nproc 4 -m mypkg.train --lr 3e-4    a module, as `python -m` / `torchrun -m`
  disttrain run --workers 4 --servers 2 train.py       parameter server: ranks 0-3 workers, 4-5 servers
  disttrain run --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --nproc 8 train.py   (on node 0)
  disttrain run --nnodes 2 --node-rank 1 --master-addr 10.0.0.1 --local-addr 10.0.0.2 --nproc 8 train.py
  disttrain run --cluster lab --nproc-per-node 2 train.py  every node of an emulated cluster
  disttrain run --cluster lab --workers 4 --servers 2 train.py   ranks spread evenly over its nodes

Options go before the script; everything after it is passed to the script. torchrun's
spellings work too: -m/--module, and --nproc_per_node, --node_rank, --master_addr, ...
Rank 0 writes to the terminal as is; other ranks' lines start with [rankN]:.
When a rank fails, its own traceback comes first (with its prefix), then one line
saying where the other ranks waited; the job exits with that rank's code (1 for an
exception, n for sys.exit(n), 128+n for signal n). A collective that does not complete
within --timeout (default 60 s) while no rank failed ends the job with ONE report: the
missing ranks, where every rank is (op #number, file:line) and each rank's stack;
exit code 124. Collectives are numbered when issued through
disttrain (disttrain.comm.all_reduce, DataParallel, ...).
SIGTERM (a scheduler's preemption) tells the ranks that call disttrain.preempted()
to save and stop: it turns True on every rank at the same step; they get
--grace-seconds (30) before they are stopped; exit code 143.
Ranks get DISTTRAIN_SECRET (a fresh per-job secret unless already set: multi-node
jobs must export the same value on every node), DISTTRAIN_SERVERS and, with several
processes per node, OMP_NUM_THREADS = cores / processes unless set.
Several machines meet through torch elastic's c10d rendezvous at --master-addr:
--master-port (node 0 hosts its store; every node gives the same --nnodes and
--rdzv-id). Each node gets a block of consecutive ranks; c10d orders the nodes by
--local-addr as text (10.0.0.10 before 10.0.0.2), so give each node its address there
to have node i hold ranks i*K...
With --cluster NAME (see `disttrain cluster up`) one agent runs inside every node of
the emulated cluster (node i holds ranks i*K..), lines start with [nI] as well, a
failure is reported as on one node: the cause's traceback first, whichever node it ran
on, and --trace DIR traces every node's ranks into one DIR/trace.json.
"""


def add_run_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "run",
        help="launch a script on N processes (torch elastic launcher underneath)",
        description="Launch script.py on every rank of a job, like torchrun.",
        epilog=RUN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    size = p.add_argument_group("job size (pick one)")
    size.add_argument("--nproc", "--nproc-per-node", "--nproc_per_node", type=int, dest="nproc",
                      help="processes per node (default 1)")
    size.add_argument("--workers", type=int, help="parameter server: worker processes in the job")
    size.add_argument("--servers", type=int, help="parameter server: server processes in the job")
    nodes = p.add_argument_group("several machines")
    nodes.add_argument("--nnodes", type=int, default=1, help="machines in the job (default 1)")
    nodes.add_argument("--node-rank", "--node_rank", type=int, default=0, help="this machine's index (default 0); node 0 "
                       "hosts the rendezvous store (the ranks follow --local-addr's order)")
    nodes.add_argument("--master-addr", "--master_addr", help="address of node 0, reachable from every node")
    nodes.add_argument("--master-port", "--master_port", type=int, default=29500, help="rendezvous port on node 0 (default 29500)")
    nodes.add_argument("--rdzv-id", "--rdzv_id", default="disttrain", help="rendezvous id, the same on every node of "
                       "the job (default disttrain)")
    nodes.add_argument("--local-addr", "--local_addr", help="this node's address as the other nodes reach it (default: "
                       "--master-addr on node 0, the host name elsewhere); nodes get their ranks in its order")
    nodes.add_argument("--cluster", metavar="NAME", help="run on every node of the emulated cluster NAME "
                       "(`disttrain cluster up`): one agent per node, in its namespace")
    p.add_argument("--max-restarts", "--max_restarts", type=int, default=0, help="restart the ranks up to K times after a failure (default 0)")
    p.add_argument("--timeout", type=float, help="seconds a collective may wait before the job is stopped with a report naming the "
                        "missing ranks (DISTTRAIN_TIMEOUT; default 60)")
    p.add_argument("--grace-seconds", type=float, default=30.0, help="after SIGTERM (a scheduler's preemption): "
                   "seconds the ranks get to save a checkpoint (disttrain.preempted()) and exit before they are "
                   "stopped; exit code 143 (default 30; 0: stop at once)")
    p.add_argument("--log-dir", "--log_dir", help="keep every rank's stdout/stderr/error files in this folder")
    p.add_argument("--trace", metavar="DIR", help="trace every rank into DIR: DIR/trace.json (one timeline, open it in "
                        "Perfetto's UI or chrome://tracing) and DIR/metrics.jsonl (per step and rank)")
    p.add_argument("--trace-steps", metavar="A:B", help="with --trace: record only steps A..B-1 (default: all)")
    p.add_argument("-m", "--module", action="store_true", help="the script is a module name, run as "
                   "`python -m MODULE` runs it (the current folder first on sys.path), as torchrun's -m")
    p.add_argument("script", help="the Python script every rank runs (with -m: a module, pkg.train)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    p.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    if args.cluster:
        return _run_in_cluster(args)
    from disttrain.launch import job  # NOTE: imports torch elastic; only `run` pays for it

    try:
        cfg = job.RunConfig(
            script=args.script,
            script_args=args.script_args,
            module=args.module,
            nproc=args.nproc,
            workers=args.workers,
            servers=args.servers,
            nnodes=args.nnodes,
            node_rank=args.node_rank,
            master_addr=args.master_addr,
            master_port=args.master_port,
            rdzv_id=args.rdzv_id,
            local_addr=args.local_addr,
            max_restarts=args.max_restarts,
            timeout=args.timeout,
            log_dir=args.log_dir,
            trace=args.trace,
            trace_steps=args.trace_steps,
            grace_seconds=args.grace_seconds,
        )
        return job.run(cfg)
    except ValueError as err:
        print(f"disttrain run: error: {err}", file=sys.stderr)
        return 2


def _run_in_cluster(args: argparse.Namespace) -> int:
    from disttrain.launch.cluster_run import run_in_cluster
    from disttrain.trace.recorder import parse_steps

    try:
        if args.nnodes != 1 or args.node_rank or args.master_addr or args.local_addr or \
                args.rdzv_id != "disttrain":
            raise ValueError("--cluster places the nodes itself: drop --nnodes, --node-rank, "
                             "--master-addr, --local-addr and --rdzv-id")
        if args.nproc is not None and (args.workers is not None or args.servers is not None):
            raise ValueError("--nproc-per-node and --workers/--servers are mutually exclusive")
        if args.module:
            raise ValueError("--cluster runs a script file: give its path instead of -m MODULE")
        if not os.path.isfile(args.script):
            raise ValueError(f"script {args.script!r} not found; give the path of a .py file")
        if args.trace_steps is not None:
            if not args.trace:
                raise ValueError("--trace-steps needs --trace DIR")
            parse_steps(args.trace_steps)
        flags = [*(["--timeout", str(args.timeout)] if args.timeout else []),
                 *(["--max-restarts", str(args.max_restarts)] if args.max_restarts else []),
                 *(["--trace-steps", args.trace_steps] if args.trace_steps else [])]
        return run_in_cluster(args.cluster, args.script, args.script_args, nproc_per_node=args.nproc,
                              workers=args.workers, servers=args.servers, master_port=args.master_port,
                              run_args=flags, log_dir=args.log_dir, trace=args.trace)
    except ValueError as err:
        print(f"disttrain run: error: {err}", file=sys.stderr)
        return 2


def run_cluster_command(args: argparse.Namespace) -> int:
    """`disttrain cluster run NAME ...` (its flags: cluster/cli.py), the same job as
    `disttrain run --cluster NAME ...`."""
    from disttrain.launch.cluster_run import run_in_cluster

    if args.nproc_per_node is not None and args.workers is not None:
        print("disttrain cluster: error: --nproc-per-node and --workers/--servers are mutually "
              "exclusive", file=sys.stderr)
        return 2
    try:
        return run_in_cluster(args.name, args.script, args.script_args,
                              nproc_per_node=args.nproc_per_node, workers=args.workers,
                              servers=args.servers, master_port=args.master_port,
                              run_args=["--timeout", str(args.timeout)] if args.timeout else [],
                              trace=args.trace)
    except ValueError as err:
        print(f"disttrain cluster: error: {err}", file=sys.stderr)
        return 2
