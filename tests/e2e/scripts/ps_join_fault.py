"""scripts/ps_join.py's job, whose joining server (or, after the join, an old server) is
SIGKILLed at a chosen moment.

argv: mode, join step (as ps_join.py), fault, replicas (default 1). The joiner's faults
are armed only in the joining server (the process `disttrain ps add-server` starts with
these same arguments):
"die-copy": on the first `transfer` frame it reads, while an old owner copies the keys
to it (before that owner handed them over: the owners must keep them);
"die-handed": when it is about to serve the first old owner's moved keys (that owner
handed them over and its final marker came: the keys are lost with it, replicas=1);
"die-serving": on the third push frame its routes receive (the workers re-routed to it).
The old servers' faults (replicas >= 2) are a launcher rank SIGKILLed by worker 0 at its
second pull after it re-routed every old owner's keys (the hand-over is done):
"kill-owner": the lowest old owner X that handed keys over;
"kill-copy": the first copy c1 of X's moved keys (their chain after the join [Y, c1]);
"die-serving+kill-copy": the joiner dies as in "die-serving", then worker 0 kills c1 at
its second pull after it re-routed X's moved keys to c1 (a second death: every copy of
those keys is gone).
Worker 0 prints which server it kills; server ranks publish their process id in the store.
"""

import os
import signal
import sys

import ps_join
import torch


def _die(text: str) -> None:
    print(text, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def arm(fault: str) -> None:
    """Make this (joining) server SIGKILL itself at `fault` (see the module's docstring)."""
    from disttrain.ps import move, server, transfer

    if fault == "die-copy":
        transfer.Intake.handle = lambda self, session, msg: _die(
            "joining server dies on a transfer frame")
    elif fault == "die-handed":
        move.Handoff.start = lambda self, d, ring: _die(
            f"joining server dies as server {d} handed its keys over")
    elif fault == "die-serving":
        push, seen = server.Server._push, []

        def dying(self, w, msg, session=None):
            seen.append(w)
            if len(seen) == 3:
                _die("joining server dies on its routes' third push frame")
            return push(self, w, msg, session)

        server.Server._push = dying
    elif fault not in ("kill-owner", "kill-copy"):
        raise SystemExit(f"unknown fault {fault!r}: die-copy, die-handed, die-serving, "
                         "kill-owner, kill-copy or die-serving+kill-copy")


def victim(model: torch.nn.Module, servers: int, replicas: int, fault: str) -> int:
    """The old server `fault` kills: the lowest old owner X that gives keys, or the first
    copy of X's moved keys."""
    from disttrain.ps.join_chains import join_moves
    from disttrain.ps.placement import plan_keys
    spec = [(n, p.numel(), p.element_size()) for n, p in model.named_parameters()]
    moves = join_moves(spec, plan_keys(spec, servers), servers, replicas, 4 << 20)
    x = min(m.before[0] for m in moves)
    return x if fault == "kill-owner" else next(m.after[1] for m in moves if m.before[0] == x)


def due(conn, give: set[int], fault: str, model, servers: int, dead: int) -> bool:
    """Whether worker 0 has re-routed what `fault` waits for (see the module docstring)."""
    if not fault.startswith("die-serving"):
        return bool(give) and give <= set(conn.routes.routes)
    x = victim(model, servers, 2, "kill-owner")
    return (x, dead) in conn.routes.hosts.values()


def arm_kill(fault: str, replicas: int) -> None:
    """Servers publish their process id; worker 0 kills the victim at its second pull
    after it re-routed every old owner that gave keys (wraps `ps.connect`)."""
    import disttrain
    from disttrain import ps

    connect = ps.connect

    def connecting(model, *args, **kwargs):
        store = torch.distributed.distributed_c10d._get_default_store()
        servers = disttrain.world_size() - ps_join.WORKERS
        if disttrain.role() == "server":
            store.set(f"joinfault/pid{disttrain.rank() - ps_join.WORKERS}", str(os.getpid()))
        conn = connect(model, *args, **kwargs)
        if disttrain.rank() != 0:
            return conn
        give = ps_join.givers(model, servers)
        dead = victim(model, servers, replicas, fault.rpartition("+")[2])
        pull, seen = conn.pull, []

        def pulling(*a, **kw):
            if due(conn, give, fault, model, servers, dead):
                seen.append(1)
                if len(seen) == 2:
                    print(f"worker 0 kills server {dead} ({fault}) after the hand-over",
                          flush=True)
                    os.kill(int(store.get(f"joinfault/pid{dead}")), signal.SIGKILL)
            return pull(*a, **kw)

        conn.pull = pulling
        return conn

    ps.connect = connecting


if __name__ == "__main__":
    from disttrain import ps

    fault, replicas = sys.argv[3], int(sys.argv[4]) if len(sys.argv) > 4 else 1
    if ps.joining():
        arm(fault.partition("+")[0])
    elif "kill-" in fault:
        arm_kill(fault, replicas)
    ps_join.main(sys.argv[1], int(sys.argv[2]), replicas)
