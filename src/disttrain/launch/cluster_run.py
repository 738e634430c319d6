"""`disttrain run --cluster NAME`: one ordinary multi-node `disttrain run` per emulated node.

Node i runs `python -m disttrain run --nnodes N --node-rank i --master-addr <n0>
--local-addr <ni> --rdzv-id <one id per job> ...` inside its network namespace (`ip netns
exec`) and cgroup, so the job meets through torch's c10d rendezvous in node 0's store
(the addresses sort in node order, so node i gets ranks i*K..) and every byte between
nodes crosses a shaped link. Each node gets the job's DISTTRAIN_SECRET,
GLOO_SOCKET_IFNAME, DISTTRAIN_PS_HOST and the link model for `all_reduce(algorithm=
"auto")`; its lines are printed as `[n<i>] line`. With `trace=DIR` every node's ranks
trace into DIR, which this driver clears before and merges once after the job.

Who talks to whom: launch/cli.py calls `run_in_cluster` (`disttrain run --cluster` and
`disttrain cluster run`); it starts one launcher (launch/) per node, in the cluster that
cluster/ built; they write their failure reports into one shared folder
(DISTTRAIN_CLUSTER_REPORTS); once all nodes end, this driver prints the cause's report
first and exits with its code (124 for a hang, 0 when all succeed). Stop order, report
choice and the emulated network: docs/cluster.md, "How it is built".
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid

from disttrain import settings
from disttrain.cluster import cgroups, net, spec
from disttrain.comm.flight import EXIT_HANG
from disttrain.launch.failures import CAUSES
from disttrain.launch.hang_report import collective_report
from disttrain.trace.merge import clear as clear_trace
from disttrain.trace.merge import merge_and_tell

__all__ = ["run_in_cluster", "node_command"]


def node_command(c: spec.Cluster, node: int, script: str, script_args, *, nproc_per_node=None,
                 workers=None, servers=None, master_port: int = 29500, run_args=(),
                 rdzv_id: str = "disttrain") -> list[str]:
    """The command line that starts node `node`'s agent inside the cluster."""
    size = (["--workers", str(workers), "--servers", str(servers)] if workers is not None
            else ["--nproc", str(nproc_per_node or 1)])
    inner = [sys.executable, "-u", "-m", "disttrain", "run", "--nnodes", str(c.nodes),
             "--node-rank", str(node), "--master-addr", c.addr(0), "--master-port", str(master_port),
             "--local-addr", c.addr(node), "--rdzv-id", rdzv_id, *size, *run_args, script, *script_args]
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
    env = {**environ, settings.SECRET: secret, "GLOO_SOCKET_IFNAME": c.ifname,
           settings.PS_HOST: c.addr(node), settings.CLUSTER: c.name,
           settings.CLUSTER_NODE: str(node),
           settings.LINK_GBPS: environ.get(settings.LINK_GBPS) or repr(gbps),
           # NOTE: every node's ranks run on this one machine's cores: one CPU pool (model.py)
           settings.SHARED_CPU: environ.get(settings.SHARED_CPU) or "1"}
    if c.cpus_per_node:  # NOTE: the trace records the quota: the report's CPU pool
        env[settings.CLUSTER_CPUS] = repr(c.cpus_per_node)
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
                   run_args=(), grace: float = 15.0, out=None, log_dir: str | None = None,
                   trace: str | None = None) -> int:
    """Run `script` on every node of cluster `name`; blocks; returns the job's exit code.

    `run_args`: further `disttrain run` flags for every node (e.g. ["--timeout", "30"]);
    `log_dir`: keep node i's rank logs in `log_dir/n<i>`; `trace`: trace every rank into
    this folder and merge it into `trace/trace.json` after the job, whatever its outcome.
    Raises ValueError when the cluster is not up or the sizes do not fit.
    """
    c = spec.load(name)
    out = out or sys.stdout
    missing = sorted(set(c.namespaces()) - set(net.leftover_namespaces(name)))
    if missing:
        raise ValueError(f"cluster {name!r} is damaged: namespaces {', '.join(missing)} are gone; "
                         f"`disttrain cluster down {name}` and bring it up again")
    if workers is not None and (servers is None or (workers + servers) % c.nodes):
        raise ValueError(f"--workers {workers} + --servers {servers} must be spread evenly over "
                         f"the {c.nodes} nodes of cluster {name!r}")
    secret = settings.current().secret or secrets.token_hex(32)
    rdzv_id = f"{name}-{uuid.uuid4().hex[:12]}"  # NOTE: the c10d rendezvous of this job alone
    lock = threading.Lock()
    procs, pumps = [], []
    reports = tempfile.mkdtemp(prefix=f"disttrain-{name}-")
    environ = {**os.environ, settings.CLUSTER_REPORTS: reports}
    if trace is not None:
        trace = os.path.abspath(trace)
        clear_trace(trace)
        run_args = [*run_args, "--trace", trace]
    try:
        for i in range(c.nodes):
            logs = ["--log-dir", os.path.join(log_dir, f"n{i}")] if log_dir else []
            cmd = node_command(c, i, script, list(script_args), nproc_per_node=nproc_per_node,
                               workers=workers, servers=servers, master_port=master_port,
                               run_args=[*run_args, *logs], rdzv_id=rdzv_id)
            per_node = (workers + servers) // c.nodes if workers is not None else nproc_per_node or 1
            p = subprocess.Popen(cmd, env=node_env(c, i, environ, secret, per_node), text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 start_new_session=True)
            procs.append(p)
            t = threading.Thread(target=_pump, args=(p.stdout, f"[n{i}] ", out, lock), daemon=True)
            t.start()
            pumps.append(t)
        first = _wait(procs, grace, out, lock)
        for t in pumps:
            t.join(5)
        return _report(reports, first, out)
    finally:
        for p in procs:
            _stop(p, signal.SIGKILL)
        for t in pumps:
            t.join(5)
        shutil.rmtree(reports, ignore_errors=True)
        if trace is not None:  # NOTE: once every node's ranks have ended: their files are complete
            merge_and_tell(trace, out, "disttrain run --cluster")


def _report(folder: str, first: tuple[int, int], out) -> int:
    """Print the nodes' failure reports, the cause's first; return the job's exit code."""
    found = {}
    for entry in os.listdir(folder):
        if entry.startswith("node") and entry.endswith(".json"):
            with open(os.path.join(folder, entry)) as f:
                found[int(entry[4:-5])] = json.load(f)
    if not found:  # no agent got as far as a report (rendezvous, a killed agent): its output says
        return first[1]
    causes = [(r["kind"] != "exception", r["time"], r["rank"], n) for n, r in found.items()
              if r["kind"] in CAUSES]
    hangs = [n for n, r in sorted(found.items()) if r["code"] == EXIT_HANG]
    node = min(causes)[3] if causes else (hangs or [first[0] if first[0] in found else min(found)])[0]
    text = found[node]["report"]
    if not causes and hangs:  # NOTE: again, now that every node's ranks have left their state here
        ranks = {int(r): v for rep in found.values() for r, v in rep["ranks"].items()}
        text = collective_report(folder, {r: v[0] for r, v in ranks.items()}, found[node]["world"],
                                 {r: (v[1], v[2]) for r, v in ranks.items()}) or text
    out.writelines(f"[n{node}] {line}\n" for line in text.rstrip("\n").split("\n"))
    for n, r in sorted(found.items()):
        if n != node:
            headline = r["report"].split("\n", 1)[0]
            out.write(f"disttrain run --cluster: node n{n} failed too: {headline}\n")
    out.flush()
    return found[node]["code"]


def _wait(procs, grace: float, out, lock) -> int:
    first: tuple[int, int] | None = None  # (node, code) of the first node that failed
    deadline, signals = None, [signal.SIGTERM, signal.SIGKILL]
    while [p.poll() for p in procs].count(None):  # NOTE: poll every node, not up to the first running one
        if first is None:
            failed = [(i, p.returncode) for i, p in enumerate(procs) if p.returncode not in (None, 0)]
            if failed:
                # NOTE: after a hang nothing will stop by itself: SIGTERM now, so the hung
                # ranks record their stacks (entry.py) for the report.
                first = failed[0]
                deadline = time.monotonic() + (0 if first[1] == EXIT_HANG else grace)
        if deadline is not None and time.monotonic() > deadline and signals:
            sig = signals.pop(0)
            if first[1] != EXIT_HANG or sig != signal.SIGTERM:
                with lock:
                    out.write(f"disttrain run --cluster: node n{first[0]} exited with code "
                              f"{first[1]} and the others did not stop in {grace:g} s: {sig.name}\n")
            for p in procs:
                _stop(p, sig)
            deadline = time.monotonic() + grace
        time.sleep(0.05)
    if first is None:
        first = next(((i, p.returncode) for i, p in enumerate(procs) if p.returncode), (0, 0))
    return first


def _stop(p: subprocess.Popen, sig: int) -> None:
    if p.poll() is not None:
        return
    try:
        os.killpg(p.pid, sig)
    except ProcessLookupError:
        return
    if sig == signal.SIGKILL:
        p.wait(10)
