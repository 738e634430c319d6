"""`disttrain run --cluster NAME`: one ordinary multi-node `disttrain run` per emulated node.

Node i runs `python -m disttrain run --nnodes N --node-rank i --master-addr <n0's address>
--master-port P ...` inside its network namespace (`ip netns exec`) and, with a CPU
quota, inside its cgroup, so the job meets through the usual static rendezvous on
node 0 and every byte between nodes crosses a shaped link. Each node's environment:
the job's shared DISTTRAIN_SECRET, GLOO_SOCKET_IFNAME (gloo binds the node's interface),
DISTTRAIN_PS_HOST (parameter servers bind the node's address), and the link model for
`all_reduce(algorithm="auto")`.

Output: every line of node i is printed as `[n<i>] line` (the ranks' own `[rankN]:`
prefixes follow). When a node fails, the others get `grace` seconds to stop on their
own (their ranks see the peer go), then SIGTERM, then SIGKILL; the exit code is that
of the first node that failed, 0 when all succeed.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import threading
import time

from disttrain.cluster import cgroups, spec

__all__ = ["run_in_cluster", "node_command"]


def node_command(c: spec.Cluster, node: int, script: str, script_args, *, nproc_per_node=None,
                 workers=None, servers=None, master_port: int = 29500, run_args=()) -> list[str]:
    """The command line that starts node `node`'s agent inside the cluster."""
    size = (["--workers", str(workers), "--servers", str(servers)] if workers is not None
            else ["--nproc", str(nproc_per_node or 1)])
    inner = [sys.executable, "-u", "-m", "disttrain", "run", "--nnodes", str(c.nodes),
             "--node-rank", str(node), "--master-addr", c.addr(0), "--master-port", str(master_port),
             *size, *run_args, script, *script_args]
    cmd = ["ip", "netns", "exec", c.ns(node), *inner]
    if c.cpus_per_node:  # NOTE: join the cgroup first; everything the agent starts inherits it
        tasks = os.path.join(cgroups.path(c.ns(node)), "tasks")
        cmd = ["sh", "-c", f'echo $$ > "{tasks}" && exec "$@"', "dt-node", *cmd]
    return cmd


def node_env(c: spec.Cluster, node: int, environ: dict[str, str], secret: str,
             procs_per_node: int = 1) -> dict[str, str]:
    gbps = c.link_bps / 1e9
    if c.switch_bps:  # NOTE: the model has one rate per node link; a capped switch shares its own
        gbps = min(gbps, c.switch_bps / 1e9 / max(1, c.nodes))
    env = {**environ, "DISTTRAIN_SECRET": secret, "GLOO_SOCKET_IFNAME": c.ifname,
           "DISTTRAIN_PS_HOST": c.addr(node), "DISTTRAIN_CLUSTER": c.name,
           "DISTTRAIN_CLUSTER_NODE": str(node), "DISTTRAIN_LINK_GBPS": environ.get(
               "DISTTRAIN_LINK_GBPS", repr(gbps))}
    if "OMP_NUM_THREADS" not in environ:
        # NOTE: the node's share of the cores (its quota, or the machine split over the
        # nodes), not the machine: each node's `disttrain run` would otherwise give every
        # rank cores // local ranks threads, and N nodes' OpenMP threads spinning on the
        # same cores made a 4-node ring allreduce of 1 MB 15x slower (82 vs 5.6 ms).
        share = c.cpus_per_node or (os.cpu_count() or 1) / c.nodes
        env["OMP_NUM_THREADS"] = str(max(1, int(share / procs_per_node)))
    return env


def _pump(stream, prefix: str, out, lock: threading.Lock) -> None:
    for line in iter(stream.readline, ""):
        with lock:
            out.write(prefix + line)
            out.flush()
    stream.close()


def run_in_cluster(name: str, script: str, script_args=(), *, nproc_per_node: int | None = None,
                   workers: int | None = None, servers: int | None = None, master_port: int = 29500,
                   run_args=(), grace: float = 15.0, out=None) -> int:
    """Run `script` on every node of cluster `name`; blocks; returns the job's exit code.

    `run_args`: further `disttrain run` flags for every node (e.g. ["--timeout", "30"]).
    Raises ValueError when the cluster is not up or the sizes do not fit.
    """
    c = spec.load(name)
    out = out or sys.stdout
    if workers is not None and (servers is None or (workers + servers) % c.nodes):
        raise ValueError(f"--workers {workers} + --servers {servers} must be spread evenly over "
                         f"the {c.nodes} nodes of cluster {name!r}")
    secret = os.environ.get("DISTTRAIN_SECRET") or secrets.token_hex(32)
    lock = threading.Lock()
    procs, pumps = [], []
    try:
        for i in range(c.nodes):
            cmd = node_command(c, i, script, list(script_args), nproc_per_node=nproc_per_node,
                               workers=workers, servers=servers, master_port=master_port,
                               run_args=list(run_args))
            per_node = (workers + servers) // c.nodes if workers is not None else nproc_per_node or 1
            p = subprocess.Popen(cmd, env=node_env(c, i, dict(os.environ), secret, per_node), text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 start_new_session=True)
            procs.append(p)
            t = threading.Thread(target=_pump, args=(p.stdout, f"[n{i}] ", out, lock), daemon=True)
            t.start()
            pumps.append(t)
        return _wait(procs, grace, out, lock)
    finally:
        for p in procs:
            _stop(p, signal.SIGKILL)
        for t in pumps:
            t.join(5)


def _wait(procs, grace: float, out, lock) -> int:
    first: tuple[int, int] | None = None  # (node, code) of the first node that failed
    deadline, signals = None, [signal.SIGTERM, signal.SIGKILL]
    while any(p.poll() is None for p in procs):
        if first is None:
            failed = [(i, p.returncode) for i, p in enumerate(procs) if p.returncode not in (None, 0)]
            if failed:
                first, deadline = failed[0], time.monotonic() + grace
                with lock:
                    out.write(f"disttrain run --cluster: node n{first[0]} exited with code "
                              f"{first[1]}; stopping the other nodes\n")
        if deadline is not None and time.monotonic() > deadline and signals:
            sig = signals.pop(0)
            for p in procs:
                _stop(p, sig)
            deadline = time.monotonic() + grace
        time.sleep(0.05)
    if first is None:
        first = next(((i, p.returncode) for i, p in enumerate(procs) if p.returncode), (0, 0))
    return first[1]


def _stop(p: subprocess.Popen, sig: int) -> None:
    if p.poll() is not None:
        return
    try:
        os.killpg(p.pid, sig)
    except ProcessLookupError:
        return
    if sig == signal.SIGKILL:
        p.wait(10)
