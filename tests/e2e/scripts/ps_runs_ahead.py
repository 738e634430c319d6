"""A replicated job under a policy whose rounds hold pushes of workers free to push again
(`Policy.runs_ahead`: KBatchAsync(k), KAsync(k), KBatchSync(k), k > 1), run by `disttrain
run --workers W --servers S` (k may exceed W: a worker then pushes several times into a round).

argv: policy ("kbatchasync", "kasync" or "kbatchsync"), k, steps, replicas, kill step (0:
none; worker 0 SIGKILLs a server right after that step's push was sent, or the next push
it sends if that one was cancelled), the server to kill. Each push is a one-hot gradient
at its own (worker, step) entry of every parameter, stepped with lr 1 and a constant
step, so -k x a final parameter counts how often each push was applied (a KBatchAsync
round averages exactly k pushes). Each worker prints, once all are done, `worker R counts
[...]` (the distinct counts) and `worker R zeros [...]` (per parameter, how many pushes it
never saw: KBatchAsync drops the last round's leftovers, at most k - 1 per server). Under
KAsync a worker closes as soon as its steps are done and prints `worker R applied [...]
dropped [...]`, each server's counts at its bye (the last worker's bye comes after every
round: nothing is left).
"""

import os
import signal
import sys
import time

import torch


def main(name: str, k: int, steps: int, replicas: int, kill_at: int, victim: int) -> None:
    import disttrain
    from disttrain import ps

    torch.set_num_threads(1)
    disttrain.init()
    workers = disttrain.world_size() - disttrain.runtime.num_servers()
    store = torch.distributed.distributed_c10d._get_default_store()
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(workers * steps))
                                    for _ in range(6)])
    make = {"kbatchasync": ps.KBatchAsync, "kasync": ps.KAsync, "kbatchsync": ps.KBatchSync}
    policy = make[name](k) if name == "kbatchsync" else make[name](k, step="constant")
    if disttrain.role() == "server":
        store.set(f"ahead/pid{disttrain.rank() - workers}", str(os.getpid()))
    conn = ps.connect(model, policy, optimizer=lambda p: torch.optim.SGD(p, lr=1.0),
                      replicas=replicas)  # servers exit here
    rank, killed = disttrain.rank(), False
    for step in range(1, steps + 1):
        conn.pull().wait()
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
            p.grad[rank * steps + step - 1] = 1.0
        try:
            handle = conn.push()
        except ps.Cancelled:  # NOTE: KBatchSync: the round closed during this step
            continue
        if rank == 0 and kill_at and step >= kill_at and not killed:
            # NOTE: KBatchSync may cancel that step's push: then after the next one sent
            os.kill(int(store.get(f"ahead/pid{victim}")), signal.SIGKILL)
            killed = True
        handle.wait()
    if name == "kasync":  # NOTE: a KAsync pull waits for a round after the worker's push:
        # a worker waiting for the others here could wait for a round only they would fill
        stats = sorted(conn.close(), key=lambda st: st["server"])
        print(f"worker {rank} applied {[st['applied'] for st in stats]} dropped "
              f"{[st['dropped'] for st in stats]}", flush=True)
        disttrain.shutdown()
        return
    store.add("ahead/done", 1)
    while int(store.add("ahead/done", 0)) < workers:
        time.sleep(0.01)
    conn.pull().wait()
    counts = [(-p.detach() * k).tolist() for p in model.parameters()]
    print(f"worker {rank} counts {sorted({round(c, 6) for row in counts for c in row})}",
          flush=True)
    print(f"worker {rank} zeros {[row.count(0.0) for row in counts]}", flush=True)
    conn.close()
    disttrain.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]),
         int(sys.argv[5]) if len(sys.argv) > 5 else 0, int(sys.argv[6]) if len(sys.argv) > 6 else 0)
