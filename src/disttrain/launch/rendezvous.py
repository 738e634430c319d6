"""The multi-node rendezvous: torch elastic's c10d rendezvous, and a store that may go first.

`disttrain run --nnodes N` meets as `torchrun --rdzv-backend c10d --rdzv-endpoint
MASTER_ADDR:MASTER_PORT --rdzv-id ID` does: torch's DynamicRendezvousHandler over its
C10dRendezvousBackend, built by torch's own `create_backend` / `create_handler`, in a
TCPStore that node 0's agent hosts (`is_host`; torch's guess by host name fails inside a
network namespace, where every node has the machine's name).

One difference, registered as the backend BACKEND: while its ranks run, an agent polls
the store for nodes waiting to join. The store lives in node 0's agent, which after a
failure exits as soon as its own ranks ended (only success waits for the other nodes),
and torch's other agents then die of the lost connection, stopping their ranks before
these could record why they failed, or finish. Here a lost store reads as "nobody
waiting": every node's ranks run to their own end, as under torch's static rendezvous,
and each agent reports its own. Joining, restarts (every agent joins the next round)
and shutdown are torch's.
"""

from __future__ import annotations

from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousParameters,
    rendezvous_handler_registry,
)

__all__ = ["BACKEND", "register"]

BACKEND = "disttrain-c10d"


class _Handler(RendezvousHandler):
    """torch's c10d handler; `num_nodes_waiting` survives the loss of node 0's store."""

    def __init__(self, inner: RendezvousHandler):
        self._inner, self._lost = inner, False

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return self._inner.use_agent_store

    def next_rendezvous(self):
        info = self._inner.next_rendezvous()
        self._lost = False
        return info

    def is_closed(self) -> bool:
        return self._inner.is_closed()

    def set_closed(self) -> None:
        self._inner.set_closed()

    def num_nodes_waiting(self) -> int:
        if self._lost:  # NOTE: asked every monitor interval; one failed call is enough
            return 0
        try:
            return self._inner.num_nodes_waiting()
        except RendezvousConnectionError:  # NOTE: node 0's agent ended; see the module docstring
            self._lost = True
            return 0

    def get_run_id(self) -> str:
        return self._inner.get_run_id()

    def shutdown(self) -> bool:
        return self._inner.shutdown()


def _create(params: RendezvousParameters) -> RendezvousHandler:
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    backend, store = create_backend(params)
    return _Handler(create_handler(store, backend, params))


def register() -> None:
    """Make BACKEND known to torch's launcher (idempotent)."""
    rendezvous_handler_registry.register(BACKEND, _create)
