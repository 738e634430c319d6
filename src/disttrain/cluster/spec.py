"""What an emulated cluster is: nodes, addresses, links and rates, and where that is kept.

A `Cluster` is pure data, validated on construction; net.py builds it, run.py starts
jobs in it. Everything it names carries the project prefix `dt-` (namespaces
`dt-NAME-n0`.., the switch `dt-NAME-sw`, cgroups `dt-NAME-n0`..) and addresses come from
the project's own range 10.213.0.0/16, used only inside those namespaces: cluster k
gives node i the address 10.213.k.(100+i) (three digits, so the addresses sort as text in
node order, the order in which c10d's rendezvous gives the nodes their ranks).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass

from disttrain import settings

__all__ = ["Cluster", "parse_rate", "format_rate", "state_dir", "load", "saved_names", "PREFIX"]

PREFIX = "dt-"
TOPOLOGIES = ("switch", "full", "ring")
MAX_NODES = 32
_NAME = re.compile(r"^[a-z][a-z0-9]{0,9}$")
_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmg]?)(bit|bps)?\s*$", re.IGNORECASE)
_UNIT = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}


def parse_rate(text: str) -> int:
    """'1gbit', '10Gbit', '100mbit', '2.5g' -> bits per second."""
    m = _RATE.match(str(text))
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"rate {text!r} is not a rate; write e.g. 1gbit, 10gbit or 100mbit")
    return int(float(m.group(1)) * _UNIT[m.group(2).lower()])


def format_rate(bps: float) -> str:
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bps >= scale:
            return f"{bps / scale:g}{unit}"
    return f"{bps:g}bit"


def state_dir() -> str:
    """Where cluster descriptions live (DISTTRAIN_CLUSTER_DIR, default /run/disttrain/clusters)."""
    return settings.current().cluster_dir


@dataclass
class Cluster:
    """One emulated cluster; validated on construction, nothing created yet."""

    name: str
    """Short name: a lowercase letter then up to 9 lowercase letters or digits."""
    nodes: int
    """Number of nodes (network namespaces), 1..32."""
    link_bps: int
    """Rate of every link, bits/s, each direction (tbf on both ends)."""
    topology: str = "switch"
    """switch: every node on one bridge; full: a link per pair; ring: neighbours only."""
    switch_bps: int | None = None
    """switch only: the bridge's total capacity (all ports share one queue), bits/s."""
    cpus_per_node: float | None = None
    """CPU quota every process of a node shares (cgroup cpu.cfs_quota_us), cores."""
    index: int = 0
    """Third octet of the node addresses: 10.213.index.(100+i)."""

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ValueError(f"cluster name {self.name!r}: use a lowercase letter then up to 9 "
                             "lowercase letters or digits (it becomes part of interface names)")
        if not 1 <= self.nodes <= MAX_NODES:
            raise ValueError(f"--nodes must be in 1..{MAX_NODES}, got {self.nodes}")
        if self.topology not in TOPOLOGIES:
            raise ValueError(f"--topology {self.topology!r}: pick one of {', '.join(TOPOLOGIES)}")
        if self.nodes == 1 and self.topology != "switch":
            raise ValueError(f"a {self.topology} of one node has no links; use --topology switch "
                             "for a one-node cluster")
        if self.switch_bps is not None and self.topology != "switch":
            raise ValueError(f"--switch caps a switch; the {self.topology} topology has none "
                             "(drop --switch or use --topology switch)")
        if self.cpus_per_node is not None:
            cores = os.cpu_count() or 1
            if self.cpus_per_node <= 0:
                raise ValueError(f"--cpus-per-node must be > 0, got {self.cpus_per_node}")
            if self.cpus_per_node * self.nodes > cores + 1e-9:
                raise ValueError(
                    f"--nodes {self.nodes} x --cpus-per-node {self.cpus_per_node:g} = "
                    f"{self.nodes * self.cpus_per_node:g} cores, more than this machine's {cores}; "
                    f"use --cpus-per-node {cores / self.nodes:g} or fewer nodes")
        if not 0 <= self.index <= 255:
            raise ValueError(f"cluster index {self.index} outside 0..255")

    def ns(self, node: int) -> str:
        """Network namespace of `node`."""
        return f"{PREFIX}{self.name}-n{node}"

    @property
    def switch_ns(self) -> str:
        return f"{PREFIX}{self.name}-sw"

    def namespaces(self) -> list[str]:
        extra = [self.switch_ns] if self.topology == "switch" else []
        return [self.ns(i) for i in range(self.nodes)] + extra

    def addr(self, node: int) -> str:
        """The node's own address: what gloo binds and what other nodes connect to."""
        return f"10.213.{self.index}.{100 + node}"  # NOTE: 3 digits: text order = node order

    ifname = "eth0"
    """The interface that holds each node's address (GLOO_SOCKET_IFNAME)."""

    def dev(self, node: int, peer: int) -> str:
        """full/ring: `node`'s end of its link to `peer`; the one to the next node is eth0."""
        return "eth0" if peer == (node + 1) % self.nodes else f"l{peer}"

    def links(self) -> list[tuple[str, str]]:
        """Every physical link as (end, end): node names or 'switch'."""
        n = self.nodes
        if self.topology == "switch":
            return [(f"n{i}", "switch") for i in range(n)]
        if self.topology == "full":
            return [(f"n{i}", f"n{j}") for i in range(n) for j in range(i + 1, n)]
        pairs = {tuple(sorted((i, (i + 1) % n))) for i in range(n) if n > 1}
        return [(f"n{i}", f"n{j}") for i, j in sorted(pairs)]

    def ring_next_hop(self, src: int, dst: int) -> int:
        """The neighbour `src` forwards to on the way to `dst` (shortest way; ties go right)."""
        n = self.nodes
        return (src + 1) % n if (dst - src) % n <= n // 2 else (src - 1) % n

    def describe(self) -> str:
        lines = [f"cluster {self.name}: {self.nodes} nodes, {self.topology}, links "
                 f"{format_rate(self.link_bps)} each way"
                 + (f", switch capacity {format_rate(self.switch_bps)}" if self.switch_bps else "")
                 + (f", {self.cpus_per_node:g} cores per node" if self.cpus_per_node else "")]
        for i in range(self.nodes):
            lines.append(f"  n{i}  {self.addr(i):<15} netns {self.ns(i)}  dev {self.ifname}")
        lines.append("  links: " + ", ".join(f"{a}-{b}" for a, b in self.links()))
        return "\n".join(lines)

    def save(self) -> str:
        os.makedirs(state_dir(), exist_ok=True)
        path = os.path.join(state_dir(), f"{self.name}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(asdict(self), f, indent=1)
        os.replace(path + ".tmp", path)
        return path


def load(name: str) -> Cluster:
    """The saved description of cluster `name`; ValueError saying how to make one if none."""
    path = os.path.join(state_dir(), f"{name}.json")
    try:
        with open(path) as f:
            return Cluster(**json.load(f))
    except FileNotFoundError:
        raise ValueError(f"no cluster {name!r} is up (nothing at {path}); start one with "
                         f"`disttrain cluster up {name} --nodes 2 --link 1gbit`") from None


def saved_names() -> list[str]:
    try:
        return sorted(f[:-5] for f in os.listdir(state_dir()) if f.endswith(".json"))
    except FileNotFoundError:
        return []
