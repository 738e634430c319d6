"""A parameter-server job one of whose servers is drained mid-run (disttrain run).

argv: mode ("sync" or "count", as scripts/ps_failover.py; "count-ssp": "count" under
SSP(2)), drain step (0: none), server
to drain, when ("pushed": right after the step's push was sent, before its ack;
"acked": once it was acknowledged), replicas (default 1), fault (default none).
Worker 0 asks the job's server manager to drain the
server (`ps.drain`): with replicas=1 its keys move to the others while both workers
train on, with replicas >= 2 its copies take them over (handover.py); then it
leaves. Worker 0 prints the final parameters' digest (sync) or each push's apply count
(count); `reference()` is the single-process Sync digest of these STEPS. Faults:
"self-kill": the drained server SIGKILLs itself at its hand-over (replicas=1: right
after its first cut, its keys half moved; replicas >= 2: once it told the workers
`moved`, before its copies committed); "kill": worker 0 SIGKILLs it 0.5 s after the
drain was accepted; "die-target": a server that takes the drained server's keys
SIGKILLs itself on the first `transfer` frame it reads (replicas=1); "late": worker 1
attaches only once the drain was accepted (a worker slower than the drain).
"""

import os
import signal
import sys
import time

import ps_failover as base
import torch

# NOTE: more steps than the kill's script, and worker 0 paced while the keys move, so the
# drain (heartbeats of 1 s apart) lands mid-run, not after the last step
STEPS = base.STEPS = 30
WORKERS, build, digest, gradient, reference = (base.WORKERS, base.build, base.digest,
                                               base.gradient, base.reference)
PACE = 0.25  # worker 0's pause per step from the drain until it re-routed


def _die_after(cls, name: str, text: str) -> None:
    """Make this process SIGKILL itself right after `cls.name` ran (once)."""
    real = getattr(cls, name)

    def dying(self, *args):
        out = real(self, *args)
        print(text, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        return out

    setattr(cls, name, dying)


def _faults(fault: str, victim: int, index: int) -> None:
    """Arm this server's fault (see the module's docstring)."""
    if not fault:
        return
    from disttrain.ps import handover, transfer

    if fault == "self-kill" and index == victim:
        text = f"server {index} dies at its hand-over"
        _die_after(transfer.Extension, "cut", text)
        _die_after(handover.Handover, "_close", text)
    if fault == "die-target" and index != victim:
        real = transfer.Intake.handle

        def dying(self, session, msg):
            print(f"server {index} dies on a transfer frame", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
            return real(self, session, msg)

        transfer.Intake.handle = dying


def drain(ps, store, victim: int, step: int, fault: str) -> None:
    """Worker 0 drains `victim` (and, fault "kill", SIGKILLs it 0.5 s later)."""
    print(f"worker 0: draining server {victim} at step {step}", flush=True)
    ps.drain(victim)
    store.set("drain/asked", "1")
    if fault == "kill":
        time.sleep(0.5)
        print(f"worker 0 kills server {victim}", flush=True)
        os.kill(int(store.get(f"drain/pid{victim}")), signal.SIGKILL)


def main(mode: str, drain_at: int, victim: int, when: str, replicas: int = 1,
         fault: str = "") -> None:
    import disttrain
    from disttrain import ps

    torch.set_num_threads(1)
    disttrain.init()
    store = torch.distributed.distributed_c10d._get_default_store()
    if disttrain.role() == "server":
        index = disttrain.rank() - WORKERS
        store.set(f"drain/pid{index}", str(os.getpid()))
        _faults(fault, victim, index)
    policy = {"sync": ps.Sync(), "count": ps.Async(step="constant"),
              "count-ssp": ps.SSP(2, step="constant")}[mode]
    mode = "count" if mode.startswith("count") else mode
    model = build(mode)
    if mode == "sync":
        opt = lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)  # noqa: E731
    else:
        opt = lambda p: torch.optim.SGD(p, lr=1.0)  # noqa: E731
    if fault == "late" and disttrain.role() == "worker" and disttrain.rank() == 1:
        store.wait(["drain/asked"])  # NOTE: attaches while the drained server is leaving
    conn = ps.connect(model, policy, optimizer=opt, replicas=replicas)  # servers exit here
    rank = disttrain.rank()
    gen = torch.Generator().manual_seed(rank)
    for step in range(1, STEPS + 1):
        conn.pull().wait()
        gradient(model, mode, rank, gen, step)
        handle = conn.push()
        if rank == 0 and step == drain_at and when == "pushed":
            drain(ps, store, victim, step, fault)
        handle.wait()
        if rank == 0 and step == drain_at and when == "acked":
            drain(ps, store, victim, step, fault)
        if rank == 0 and drain_at and step >= drain_at and victim not in conn.routes.routes:
            time.sleep(PACE)
    base.finish(conn, model, store, "drain", mode, rank)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4],
         int(sys.argv[5]) if len(sys.argv) > 5 else 1, sys.argv[6] if len(sys.argv) > 6 else "")
