"""Build and tear down an emulated cluster with iproute2: namespaces, veth links, tc shaping.

Each node is a network namespace with loopback and its own address. `switch`: a
namespace `dt-NAME-sw` holds a bridge; node i's `eth0` is one end of a veth pair whose
other end `p<i>` is a bridge port. A token bucket (`tbf`) on each end of every veth
shapes both directions to the link rate; `--switch` redirects every port's ingress
to one `ifb` device with its own `tbf`, so all traffic through the switch shares that
capacity. `full` and `ring`: each link is a veth pair between two nodes (the one to
the next node is `eth0`, holding the node's address as a /32) with /32 routes over it; in a ring the nodes forward
(ip_forward) along the shorter way round. Shaping is egress-only, as tc can do it.

`up` is all or nothing: a failure part way runs `down`, which deletes every namespace
and cgroup with the cluster's prefix (killing what still runs inside), so it also
cleans what a crashed `up` or a killed job left.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time

from disttrain import settings
from disttrain.cluster import cgroups
from disttrain.cluster.spec import PREFIX, Cluster, load, saved_names, state_dir

__all__ = ["up", "down", "alive", "check_privileges", "leftover_namespaces", "ClusterError"]

CAP_NET_ADMIN, CAP_SYS_ADMIN = 12, 21
ETC_NETNS = "/etc/netns"
MTU = 9000  # NOTE: jumbo frames, as on a datacenter network; fewer packets per byte for the CPU


class ClusterError(RuntimeError):
    """A cluster could not be made or removed; the message says what to do."""


def check_privileges() -> None:
    """Raise ClusterError naming the missing capability (DISTTRAIN_CLUSTER_NO_CAPS=1 simulates)."""
    eff = 0
    if not settings.current().cluster_no_caps:
        with open("/proc/self/status") as f:
            eff = next(int(line.split()[1], 16) for line in f if line.startswith("CapEff:"))
    missing = [name for bit, name in ((CAP_NET_ADMIN, "CAP_NET_ADMIN"), (CAP_SYS_ADMIN, "CAP_SYS_ADMIN"))
               if not eff >> bit & 1]
    if missing:
        raise ClusterError(
            f"making network namespaces, links and tc shaping needs root: this process lacks "
            f"{' and '.join(missing)}. Run as root (sudo disttrain cluster ...), or start the "
            "container with --cap-add NET_ADMIN --cap-add SYS_ADMIN")


def _sh(*cmd: str, ns: str | None = None) -> str:
    full = (["ip", "netns", "exec", ns] if ns else []) + list(cmd)
    done = subprocess.run(full, capture_output=True, text=True)
    if done.returncode:
        raise ClusterError(f"`{' '.join(full)}` failed: {done.stderr.strip() or done.returncode}")
    return done.stdout


def _shape(ns: str, dev: str, bps: int) -> None:
    """tbf on `dev`'s egress: `bps` bits/s, a bucket of 200 us of traffic (at least 32 KB).

    NOTE: a big bucket lets small messages through at memory speed, which would make
    64 KB allreduces look free; below 128 KB of bucket the veths' segments are capped
    at one MTU (_gso) so that every packet still fits (at 10 Gbit/s the bucket is 250 KB
    and 64 KB segments stay: one-MTU segments would make the CPU, not the link, the limit)."""
    burst = _burst(bps)
    _sh("tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{bps}bit",
        "burst", str(burst), "latency", "50ms", ns=ns)


def _burst(bps: int) -> int:
    return max(32 * 1024, int(bps / 8 * 200e-6))


def _gso(bps: int) -> str:
    return str(MTU) if _burst(bps) < 128 * 1024 else "65536"


def _new_ns(ns: str, forward: bool = False) -> None:
    _sh("ip", "netns", "add", ns)
    _sh("ip", "link", "set", "lo", "up", ns=ns)
    for key in ("all", "default"):
        _sh("sysctl", "-qw", f"net.ipv4.conf.{key}.rp_filter=0", ns=ns)
    if forward:
        _sh("sysctl", "-qw", "net.ipv4.ip_forward=1", ns=ns)


def _veth(a_ns: str, a_dev: str, b_ns: str, b_dev: str, bps: int) -> None:
    _sh("ip", "link", "add", a_dev, "netns", a_ns, "mtu", str(MTU), "type", "veth",
        "peer", "name", b_dev, "netns", b_ns, "mtu", str(MTU))
    for ns, dev in ((a_ns, a_dev), (b_ns, b_dev)):
        _sh("ip", "link", "set", dev, "gso_max_size", _gso(bps), "up", ns=ns)
        _shape(ns, dev, bps)


def _switch(c: Cluster) -> None:
    sw = c.switch_ns
    _new_ns(sw)
    _sh("ip", "link", "add", "br0", "type", "bridge", ns=sw)
    _sh("ip", "link", "set", "br0", "mtu", str(MTU), "type", "bridge", "forward_delay", "0", ns=sw)
    _sh("ip", "link", "set", "br0", "up", ns=sw)
    if c.switch_bps:
        _sh("ip", "link", "add", "ifb0", "mtu", str(MTU), "type", "ifb", ns=sw)
        _sh("ip", "link", "set", "ifb0", "gso_max_size", _gso(c.switch_bps), "up", ns=sw)
        _shape(sw, "ifb0", c.switch_bps)
    for i in range(c.nodes):
        _veth(c.ns(i), "eth0", sw, f"p{i}", c.link_bps)
        _sh("ip", "addr", "add", f"{c.addr(i)}/24", "dev", "eth0", ns=c.ns(i))
        _sh("ip", "link", "set", f"p{i}", "master", "br0", ns=sw)
        if c.switch_bps:  # NOTE: every port's ingress through one shared ifb queue
            _sh("tc", "qdisc", "add", "dev", f"p{i}", "handle", "ffff:", "ingress", ns=sw)
            _sh("tc", "filter", "add", "dev", f"p{i}", "parent", "ffff:", "protocol", "all", "u32",
                "match", "u32", "0", "0", "action", "mirred", "egress", "redirect", "dev", "ifb0", ns=sw)


def _routed(c: Cluster) -> None:
    for a, b in c.links():
        i, j = int(a[1:]), int(b[1:])
        _veth(c.ns(i), c.dev(i, j), c.ns(j), c.dev(j, i), c.link_bps)
    for i in range(c.nodes):
        if c.nodes > 1:  # NOTE: a /32 on eth0; the node answers ARP for it on every link
            _sh("ip", "addr", "add", f"{c.addr(i)}/32", "dev", "eth0", ns=c.ns(i))
        for j in range(c.nodes):
            if i == j:
                continue
            hop = j if c.topology == "full" else c.ring_next_hop(i, j)
            route = ["ip", "route", "add", f"{c.addr(j)}/32", "dev", c.dev(i, hop), "src", c.addr(i)]
            if hop != j:
                route[4:4] = ["via", c.addr(hop), "onlink"]
            _sh(*route, ns=c.ns(i))


def _name_service(c: Cluster) -> None:
    """/etc/netns/NS/{hosts,resolv.conf}, which `ip netns exec` mounts over /etc: every node
    resolves n0.. and its peers' addresses from a file, and never waits on a DNS server
    it cannot reach (gloo and c10d look up their peers' names)."""
    hosts = "127.0.0.1 localhost\n" + "".join(
        f"{c.addr(i)} n{i} {c.ns(i)}\n::ffff:{c.addr(i)} n{i}\n" for i in range(c.nodes))
    for ns in c.namespaces():
        folder = os.path.join(ETC_NETNS, ns)
        os.makedirs(folder, exist_ok=True)
        for fname, text in (("hosts", hosts), ("resolv.conf", "")):
            with open(os.path.join(folder, fname), "w") as f:
                f.write(text)


def _free_index() -> int:
    used = set()
    for name in saved_names():
        try:
            used.add(load(name).index)
        except (ValueError, TypeError):
            continue
    return min(set(range(256)) - used)


def up(c: Cluster) -> Cluster:
    """Create cluster `c` (blocks, a second or two); returns it with its address index set."""
    check_privileges()
    if c.name in saved_names() or leftover_namespaces(c.name):
        raise ClusterError(f"cluster {c.name!r} exists already (or left namespaces behind); "
                           f"`disttrain cluster down {c.name}` first, or pick another name")
    c.index = _free_index()
    c.save()  # NOTE: first, so that `down` finds a half-built cluster too
    try:
        for i in range(c.nodes):
            _new_ns(c.ns(i), forward=c.topology == "ring")
        if c.topology == "switch":
            _switch(c)
        else:
            _routed(c)
        if c.cpus_per_node:
            for i in range(c.nodes):
                cgroups.create(c.ns(i), c.cpus_per_node)
        _name_service(c)
    except BaseException:
        down(c.name)
        raise
    return c


def leftover_namespaces(name: str | None = None) -> list[str]:
    """Namespaces with the project prefix (of cluster `name` only, if given)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    want = f"{PREFIX}{name}-" if name else PREFIX
    return sorted(line.split()[0] for line in out.splitlines() if line.startswith(want))


def down(name: str) -> list[str]:
    """Remove cluster `name`: kill its processes, delete namespaces, cgroups and its state.

    Idempotent; returns what it removed (empty when nothing was there).
    """
    check_privileges()
    removed = []
    for ns in leftover_namespaces(name):
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
        for pid in pids.split():
            _kill(int(pid))
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        removed.append(ns)
    removed += cgroups.remove_all(f"{PREFIX}{name}-")
    if os.path.isdir(ETC_NETNS):
        for ns in os.listdir(ETC_NETNS):
            if ns.startswith(f"{PREFIX}{name}-"):
                shutil.rmtree(os.path.join(ETC_NETNS, ns), ignore_errors=True)
                removed.append(os.path.join(ETC_NETNS, ns))
    path = os.path.join(state_dir(), f"{name}.json")
    if os.path.exists(path):
        os.remove(path)
        removed.append(path)
    return removed


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    for _ in range(50):  # NOTE: a namespace is only gone once its last process is
        if not alive(pid):
            return
        time.sleep(0.02)


def alive(pid: int) -> bool:
    """True while `pid` runs (a zombie, dead but not yet reaped by its parent, is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
