"""A parameter-server job with replicas=2 whose server is SIGKILLed mid-run (disttrain run).

argv: mode, kill step (0: no kill), server to kill, when ("pushed": right after the
step's push was sent, before its ack; "acked": once it was acknowledged). Modes:
"sync" trains an MLP with momentum SGD under Sync and worker 0 prints a digest of the
final parameters; "count" runs Async with lr 1 and a constant step, each push a one-hot
gradient at its own (worker, step) entry, so the final parameters count how often each
push was applied. argv[5]: replicas (default 2); argv[6]: a step (default 0: none) at
which, once its push was acknowledged, worker 0 also kills the server that took over
the first one's first key (the first live server of its chain); argv[7] "die": the
server that gets the first range copied again after the kill SIGKILLs itself on the
first `transfer` frame it reads; "late": worker 1 attaches only once the server was
killed (its hello to the dead server is answered by the routes). Server ranks publish their process id in the store;
worker 0 kills them. `reference()` (imported by the test) is the same Sync training in one process, as
the servers compute it: the mean of the workers' gradients summed in worker order, one
momentum step per round; it returns the digest the job must end with.
"""

import hashlib
import os
import signal
import sys
import time

import torch

STEPS, WORKERS = 12, 2


def build(mode: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if mode == "count":
        return torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(WORKERS * STEPS))
                                       for _ in range(6)])
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def gradient(model: torch.nn.Module, mode: str, rank: int, gen: torch.Generator,
             step: int) -> None:
    """Worker `rank`'s gradient of this step into the model's .grad."""
    model.zero_grad(set_to_none=True)
    if mode == "count":
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
            p.grad[rank * STEPS + step - 1] = 1.0
        return
    x = torch.randn(16, 8, generator=gen)  # (16, 8)
    torch.nn.functional.mse_loss(model(x), x[:, :4].sin()).backward()


def digest(model: torch.nn.Module) -> str:
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()


def reference() -> str:
    """The Sync run's final digest, computed in one process (staleness.StaleStep.combine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = build("sync")
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        gens = [torch.Generator().manual_seed(r) for r in range(WORKERS)]
        for step in range(1, STEPS + 1):
            grads = []
            for r in range(WORKERS):
                gradient(model, "sync", r, gens[r], step)
                grads.append([p.grad.clone() for p in model.parameters()])
            for i, p in enumerate(model.parameters()):
                p.grad = grads[0][i] * 1.0
                for g in grads[1:]:
                    p.grad.add_(g[i], alpha=1.0)
                p.grad.div_(WORKERS)
            opt.step()
        return digest(model)
    finally:
        torch.set_num_threads(threads)


def heir(model: torch.nn.Module, servers: int, victim: int, replicas: int) -> int:
    """The server that takes over `victim`'s first key (placement.py's chain)."""
    from disttrain.ps.placement import plan_keys

    plan = plan_keys([(n, p.numel(), p.element_size()) for n, p in model.named_parameters()],
                     servers)
    chain = plan.chain(plan[victim][0].key, replicas)
    return int(chain[1].removeprefix("server"))


def die_on_copy(model: torch.nn.Module, servers: int, victim: int, replicas: int,
                index: int) -> None:
    """Make this server SIGKILL itself on the first transfer frame it reads, if it is the
    first new copy after `victim` dies (recopy.moves)."""
    from disttrain.ps import recopy
    from disttrain.ps.placement import plan_keys

    plan = plan_keys([(n, p.numel(), p.element_size()) for n, p in model.named_parameters()],
                     servers)
    if recopy.moves(plan, replicas, {victim}, victim)[0].target != index:
        return
    hold = recopy.Recopy.hold

    def dying(self, session, msg):
        if msg.op == "transfer":
            print(f"server {index} dies on a transfer frame", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return hold(self, session, msg)

    recopy.Recopy.hold = dying


def main(mode: str, kill_at: int, victim: int, when: str, replicas: int, again: int,
         die: bool, late: bool = False) -> None:
    import disttrain
    from disttrain import ps

    torch.set_num_threads(1)
    disttrain.init()
    store = torch.distributed.distributed_c10d._get_default_store()
    model = build(mode)
    if mode == "sync":
        policy, opt = ps.Sync(), lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)
    else:
        policy, opt = ps.Async(step="constant"), lambda p: torch.optim.SGD(p, lr=1.0)
    if disttrain.role() == "server":
        store.set(f"failover/pid{disttrain.rank() - WORKERS}", str(os.getpid()))
        if die:
            die_on_copy(model, disttrain.world_size() - WORKERS, victim, replicas,
                        disttrain.rank() - WORKERS)
    if late and disttrain.role() == "worker" and disttrain.rank() == 1:
        store.wait(["failover/killed"])  # NOTE: attaches only once the server is dead
    conn = ps.connect(model, policy, optimizer=opt, replicas=replicas)  # servers exit here
    rank = disttrain.rank()
    gen = torch.Generator().manual_seed(rank)
    for step in range(1, STEPS + 1):
        conn.pull().wait()
        gradient(model, mode, rank, gen, step)
        handle = conn.push()
        if rank == 0 and step == kill_at and when == "pushed":
            os.kill(int(store.get(f"failover/pid{victim}")), signal.SIGKILL)
            store.set("failover/killed", "1")
        handle.wait()
        if rank == 0 and step == kill_at and when == "acked":
            os.kill(int(store.get(f"failover/pid{victim}")), signal.SIGKILL)
            store.set("failover/killed", "1")
        if rank == 0 and step == again:
            second = heir(model, disttrain.world_size() - WORKERS, victim, replicas)
            print(f"worker 0 kills server {second} too", flush=True)
            os.kill(int(store.get(f"failover/pid{second}")), signal.SIGKILL)
    finish(conn, model, store, "failover", mode, rank)


def finish(conn, model: torch.nn.Module, store, name: str, mode: str, rank: int) -> None:
    """Wait for every worker's last push, pull, print the digest (Sync) or the counts
    every parameter saw (Async: one-hot gradients), and leave."""
    import disttrain

    store.add(f"{name}/done", 1)  # NOTE: Async: read once every worker's pushes are acked
    while int(store.add(f"{name}/done", 0)) < WORKERS:
        time.sleep(0.01)
    conn.pull().wait()
    if mode == "sync":
        print(f"worker {rank} digest {digest(model)}", flush=True)
    else:
        counts = (-torch.cat([p.detach() for p in model.parameters()])).tolist()
        print(f"worker {rank} counts {sorted(set(counts))}", flush=True)
    conn.close()
    disttrain.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4],
         int(sys.argv[5]) if len(sys.argv) > 5 else 2,
         int(sys.argv[6]) if len(sys.argv) > 6 else 0, sys.argv[7:8] == ["die"],
         sys.argv[7:8] == ["late"])
