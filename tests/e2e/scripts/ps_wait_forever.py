"""A KAsync(2) job whose worker 0 waits for a reply the live server never sends, run by
`disttrain run --workers 2 --servers S` (argv: servers' replicas, default 1).

Worker 0 pushes once and pulls: a KAsync pull waits for a round after the worker's push,
and that round needs a second push. Worker 1 never pushes: it waits (at the job's store,
as a script barrier would) for worker 0 to finish before it closes. Both stay alive and
beat, so no one is silent; worker 0's pull must end with an error naming the server and
what it waits for (worker_loop.py, "a reply a live server never sends"), not hang.
"""

import sys
import time

import torch


def main(replicas: int) -> None:
    import disttrain
    from disttrain import ps

    torch.set_num_threads(1)
    disttrain.init()
    store = torch.distributed.distributed_c10d._get_default_store()
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(8)) for _ in range(2)])
    conn = ps.connect(model, ps.KAsync(2), replicas=replicas)  # servers exit here
    conn.pull().wait()
    if disttrain.rank() == 0:
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        conn.push().wait()
        conn.pull().wait()  # NOTE: the round it waits for needs worker 1's push
        store.set("forever/done", "1")
    else:
        while not store.check(["forever/done"]):  # NOTE: the script's barrier
            time.sleep(0.05)
    conn.close()
    disttrain.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
