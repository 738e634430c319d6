"""Allreduce algorithms built from torch.distributed point-to-point sends and receives.

`all_reduce(t, algorithm="ring", group=g)` sums `t` in place over `g`, bitwise identical
on every rank (each element is summed on exactly one rank, then copied). Algorithms:
`ring` (Patarasuk & Yuan 2009; Baidu 2017), `halving-doubling` (Rabenseifner 2004;
Thakur, Rabenseifner & Gropp 2005), `tree` (binomial reduce + broadcast, small
messages), `hierarchical` (Horovod's; one ring per local rank as NCCL's channels; ranks
must be node-major), `native` (the backend's own) and `auto` (cheapest under the
alpha-beta model of comm/cost.py). Costs and measurements: docs/cluster.md,
"Allreduce algorithms".

`all_reduce` is also `disttrain.comm.all_reduce`: torch.distributed's signature plus
`algorithm=`; "native" (the default) is the recorded backend call of comm/ops.py.

Who talks to whom: DataParallel and ZeRO (through comm/reducer.py) and users call
`all_reduce`; it is one flight-recorder entry (comm/ops.py), so a hang names
`all_reduce[ring]` and the user's line, not an inner send; `async_op=True` runs the
algorithm on the group's thread (comm/threads.py).
"""

from __future__ import annotations

import os
from concurrent import futures
from concurrent.futures import Future

import torch
import torch.distributed as dist

from disttrain.comm import ops
from disttrain.comm.cost import choose_algorithm
from disttrain.comm.threads import submit_on_group_thread
from disttrain.trace import hooks as trace_hooks

__all__ = ["ALGORITHMS", "all_reduce", "AsyncAllReduce"]

ALGORITHMS = ("native", "ring", "halving-doubling", "tree", "hierarchical", "auto")
_PIECE_BYTES = 1 << 20  # NOTE: ring steps move 1 MB pieces so adding one overlaps the next's transfer


def all_reduce(tensor: torch.Tensor, op=ops.ReduceOp.SUM, group=None, async_op: bool = False, *,
               algorithm: str = "native", local_size: int | None = None):
    """Reduce `tensor` in place over `group` (None = the world) with `algorithm`; blocks
    unless `async_op` (then returns a handle whose `wait()` blocks and re-raises).
    "native" is the backend's own all_reduce, any `op`; the others sum (op=SUM).
    `local_size`: ranks per node for `hierarchical`/`auto` (default: the group's members on
    this node, from LOCAL_WORLD_SIZE ranks per node and their global ranks)."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"all_reduce: unknown algorithm {algorithm!r}; pick one of "
                         f"{', '.join(ALGORITHMS)}")
    if algorithm == "native":
        return ops.all_reduce(tensor, op, group, async_op)
    if op != ops.ReduceOp.SUM:
        raise ValueError(f"all_reduce: algorithm {algorithm!r} only sums; pass op=SUM, or "
                         "algorithm='native' for the backend's other reductions")
    if async_op:
        return submit_on_group_thread(group, f"all_reduce[{algorithm}]", _all_reduce, tensor,
                                      algorithm, group, local_size)
    return _all_reduce(tensor, algorithm, group, local_size)


def _all_reduce(tensor: torch.Tensor, algorithm: str, group, local_size: int | None) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"all_reduce: tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if not dist.is_initialized():
        raise RuntimeError("all_reduce needs a process group: call disttrain.init() first "
                           "(it works alone too, as a world of one)")
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    if algorithm == "auto":
        algorithm = choose_algorithm(tensor.numel() * tensor.element_size(), len(ranks),
                                     _local_size(local_size, ranks))
    if algorithm == "native" or len(ranks) == 1:
        ops.all_reduce(tensor, group=group)
        return
    local = _local_size(local_size, ranks) if algorithm == "hierarchical" else 1

    def run() -> None:
        flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1).clone()
        _RUN[algorithm](flat, ranks, ranks.index(dist.get_rank()), local)
        if flat.data_ptr() != tensor.data_ptr():
            tensor.copy_(flat.view_as(tensor))
    run_recorded(f"all_reduce[{algorithm}]", tensor, group, ranks, run)


def run_recorded(op: str, tensor: torch.Tensor, group, ranks: list[int], run) -> None:
    """`run()` (blocking point-to-point work on `tensor`) as one collective `op`: one
    flight-recorder entry (a failure becomes ops.CollectiveError naming it) and, while
    tracing, one traced collective the calling thread waited for."""
    rec = ops.recorder()
    entry = rec.start(op, _group_name(group, ranks), ranks, [list(tensor.shape)],
                      str(tensor.dtype).replace("torch.", ""))
    tracer = trace_hooks.active  # NOTE: None unless tracing is on (disttrain.trace)
    if tracer is not None:
        tracer.issued(entry)
    try:
        run()
    except Exception as err:  # noqa: BLE001 - becomes the recorded CollectiveError
        message = rec.fail(entry, err)
        raise ops.CollectiveError(message, entry, rec.status == "timeout") from err
    rec.end(entry)
    if tracer is not None:  # blocking: the calling thread waited for all of it
        tracer.finished(entry, exposed=tracer.on_main())


class AsyncAllReduce:
    """Runs `all_reduce(t, algorithm, group)` calls one after another on the group's
    algorithm thread (comm/threads.py: one per group, shared with DataParallel's and
    ZeRO's reductions on that group, so their point-to-point messages never interleave).

    `submit(t)` never blocks and returns a handle whose `wait()` blocks until `t` holds
    the sum (and re-raises the call's error). Calls run in submission order, so ranks
    that submit in the same order run the same algorithms in the same order. The
    algorithms use point-to-point messages only, which gloo matches by peer and tag,
    apart from the collectives the main thread issues meanwhile.
    """

    def __init__(self, algorithm: str, group=None, local_size: int | None = None):
        if algorithm not in ALGORITHMS:
            raise ValueError(f"unknown algorithm {algorithm!r}; pick one of {', '.join(ALGORITHMS)}")
        self.algorithm, self.group, self.local_size = algorithm, group, local_size
        self._submitted: list[Future] = []

    def submit(self, tensor: torch.Tensor) -> Future:
        """Start summing `tensor` in place; returns a Future (`.wait()` is `.result()`)."""
        fut = all_reduce(tensor, group=self.group, async_op=True, algorithm=self.algorithm,
                         local_size=self.local_size)
        self._submitted = [f for f in self._submitted if not f.done()] + [fut]
        return fut

    def close(self) -> None:
        """Wait for what was submitted (blocks); errors stay with their handles."""
        futures.wait(self._submitted)
        self._submitted = []


def _group_name(group, ranks) -> str:
    if group is None or group is dist.group.WORLD:
        return "world"
    return f"group [{','.join(map(str, ranks))}]"


def _local_size(local_size: int | None, ranks: list[int]) -> int:
    """Ranks per node in the group: `local_size`, else counted from the group's global
    ranks with LOCAL_WORLD_SIZE ranks per node (a dp group of a mesh may hold fewer)."""
    world = len(ranks)
    if local_size is None:
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        nodes = [r // max(per_node, 1) for r in ranks]  # node of each group member, in order
        local = nodes.count(nodes[0])
        if any(nodes[i] != nodes[i - i % local] for i in range(world)) or world % local:
            raise ValueError(f"all_reduce: the group's ranks {ranks} are not node-major blocks of "
                             f"equal size (LOCAL_WORLD_SIZE={per_node} ranks per node); "
                             "hierarchical needs them so: pass local_size= or use 'ring'")
        return local
    if local_size < 1 or world % local_size:
        raise ValueError(f"all_reduce: local_size ({local_size}) must divide the group size "
                         f"({world}): every node must hold the same number of ranks; pass "
                         "local_size=")
    return local_size


def _bounds(n: int, parts: int) -> list[int]:
    """Split n elements into `parts` contiguous chunks; chunk i is [b[i], b[i+1])."""
    return [i * n // parts for i in range(parts + 1)]


def _exchange(send: torch.Tensor, dst: int, recv: torch.Tensor, src: int) -> None:
    """Send `send` to `dst` while receiving `recv` from `src` (global ranks); blocks."""
    works = []
    if recv.numel():
        works.append(dist.irecv(recv, src))
    if send.numel():
        works.append(dist.isend(send, dst))
    for w in works:
        w.wait()


def _pieces(n: int, itemsize: int) -> int:
    return max(1, min(16, (n * itemsize) // _PIECE_BYTES))


def _send_recv_add(out: torch.Tensor, send: torch.Tensor, dst: int, src: int) -> None:
    """out += what `src` sends, while sending `send` to `dst`, in overlapping pieces."""
    # NOTE: each side splits by its own message's size: my send is my peer's receive
    tmp = torch.empty_like(out)
    rb = _bounds(out.numel(), _pieces(out.numel(), out.element_size()))
    sb = _bounds(send.numel(), _pieces(send.numel(), send.element_size()))
    recvs = [(dist.irecv(tmp[a:z], src), a, z) for a, z in zip(rb, rb[1:]) if z > a]
    sends = [dist.isend(send[a:z], dst) for a, z in zip(sb, sb[1:]) if z > a]
    for w, a, z in recvs:  # NOTE: add piece i while piece i+1 is on the wire
        w.wait()
        out[a:z] += tmp[a:z]
    for w in sends:
        w.wait()


def _post_recvs(views: list[torch.Tensor], src: int) -> list[list]:
    """irecv every view, in pieces, now; returns [(work, piece)] per view (in order)."""
    out = []
    for v in views:
        b = _bounds(v.numel(), _pieces(v.numel(), v.element_size()))
        out.append([(dist.irecv(v[a:z], src), v[a:z]) for a, z in zip(b, b[1:]) if z > a])
    return out


def _post_sends(view: torch.Tensor, dst: int) -> list:
    b = _bounds(view.numel(), _pieces(view.numel(), view.element_size()))
    return [dist.isend(view[a:z], dst) for a, z in zip(b, b[1:]) if z > a]


def ring_reduce_scatter(flat: torch.Tensor, peers: list[int], me: int) -> int:
    """Reduce-scatter `flat` around the ring `peers` (global ranks, this one at index me).

    Returns the chunk index (of len(peers) chunks, `_bounds`) this rank now holds summed.
    NOTE: every step's receive is posted before the first send, so a receive is always
    waiting when data arrives (gloo's receiver-ready notice never sits behind our own
    data in the link's queue); step k's send is chunk (me-k), summed at step k-1.
    """
    n = len(peers)
    b = _bounds(flat.numel(), n)
    right, left = peers[(me + 1) % n], peers[(me - 1) % n]
    chunk = [(me - step - 1) % n for step in range(n - 1)]  # received and summed at each step
    tmp = [torch.empty(b[c + 1] - b[c], dtype=flat.dtype, device=flat.device) for c in chunk]
    recvs, sends = _post_recvs(tmp, left), []
    for step in range(n - 1):
        s, r = (me - step) % n, chunk[step]
        sends += _post_sends(flat[b[s]:b[s + 1]], right)
        offset = b[r]
        for work, piece in recvs[step]:  # add piece i while piece i+1 is on the wire
            work.wait()
            out = flat[offset:offset + piece.numel()]
            out += piece
            offset += piece.numel()
    for w in sends:
        w.wait()
    return (me + 1) % n


def ring_all_gather(flat: torch.Tensor, peers: list[int], me: int) -> None:
    """The inverse of ring_reduce_scatter: every rank ends with every summed chunk.

    Every receive lands in its final place, so all are posted up front; step k sends
    the chunk received at step k-1.
    """
    n = len(peers)
    b = _bounds(flat.numel(), n)
    right, left = peers[(me + 1) % n], peers[(me - 1) % n]
    recvs = _post_recvs([flat[b[r]:b[r + 1]] for r in ((me - k) % n for k in range(n - 1))], left)
    sends = []
    for step in range(n - 1):
        s = (me + 1 - step) % n
        if step:
            for work, _ in recvs[step - 1]:
                work.wait()
        sends += _post_sends(flat[b[s]:b[s + 1]], right)
    for work, _ in recvs[-1] if recvs else []:
        work.wait()
    for w in sends:
        w.wait()


def _ring(flat: torch.Tensor, peers: list[int], me: int, _local: int = 1) -> None:
    ring_reduce_scatter(flat, peers, me)
    ring_all_gather(flat, peers, me)


def _hierarchical(flat: torch.Tensor, peers: list[int], me: int, local: int) -> None:
    node, lr = divmod(me, local)
    nodes = len(peers) // local
    in_node = peers[node * local:(node + 1) * local]
    across = [peers[m * local + lr] for m in range(nodes)]  # same local rank on every node
    b = _bounds(flat.numel(), local)
    own = ring_reduce_scatter(flat, in_node, lr) if local > 1 else 0
    share = flat[b[own]:b[own + 1]]
    if nodes > 1:
        # NOTE: every rank of one ring holds the same chunk index (`own` depends on lr only)
        _ring(share, across, node)
    if local > 1:
        ring_all_gather(flat, in_node, lr)


def _halving_doubling(flat: torch.Tensor, peers: list[int], me: int, _local: int = 1) -> None:
    n = len(peers)
    p = 1 << (n.bit_length() - 1)  # largest power of two <= n
    extra = n - p
    # NOTE: fold: among the first 2*extra ranks, each even one hands its data to the odd
    # one after it and sits out; the p survivors are renumbered 0..p-1.
    if not flat.numel():
        return
    if me < 2 * extra:
        if me % 2 == 0:
            dist.send(flat, peers[me + 1])
            dist.recv(flat, peers[me + 1])  # the result, once the survivors are done
            return
        tmp = torch.empty_like(flat)
        dist.recv(tmp, peers[me - 1])
        flat += tmp
        virt = me // 2
    else:
        virt = me - extra

    def real(v: int) -> int:
        return peers[2 * v + 1] if v < extra else peers[v + extra]

    b = _bounds(flat.numel(), p)
    lo, hi, mask = 0, p, p // 2
    while mask:  # recursive halving: keep the half of [lo, hi) that holds chunk `virt`
        mid = (lo + hi) // 2
        keep, give = ((lo, mid), (mid, hi)) if virt & mask == 0 else ((mid, hi), (lo, mid))
        _send_recv_add(flat[b[keep[0]]:b[keep[1]]], flat[b[give[0]]:b[give[1]]],
                       real(virt ^ mask), real(virt ^ mask))
        lo, hi = keep
        mask //= 2
    mask = 1
    while mask < p:  # recursive doubling: swap ever larger summed blocks
        mine, theirs = (virt // mask) * mask, ((virt ^ mask) // mask) * mask
        _exchange(flat[b[mine]:b[mine + mask]], real(virt ^ mask),
                  flat[b[theirs]:b[theirs + mask]], real(virt ^ mask))
        mask *= 2
    if me < 2 * extra:
        dist.send(flat, peers[me - 1])


def _tree(flat: torch.Tensor, peers: list[int], me: int, _local: int = 1) -> None:
    n = len(peers)
    if not flat.numel():
        return
    tmp = torch.empty_like(flat)
    mask = 1
    while mask < n:  # binomial reduce to index 0: children at me + 1, 2, 4, ...
        if me & mask:
            dist.send(flat, peers[me - mask])
            break
        if me + mask < n:
            dist.recv(tmp, peers[me + mask])
            flat += tmp
        mask *= 2
    if me:  # binomial broadcast back down the same tree
        dist.recv(flat, peers[me - (me & -me)])
    mask = (me & -me) if me else 1 << (n - 1).bit_length()
    mask //= 2
    while mask:
        if me + mask < n:
            dist.send(flat, peers[me + mask])
        mask //= 2


_RUN = {"ring": _ring, "halving-doubling": _halving_doubling, "tree": _tree,
        "hierarchical": _hierarchical}
