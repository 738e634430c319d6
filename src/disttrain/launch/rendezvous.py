"""The multi-node rendezvous: torch elastic's c10d rendezvous, and a store that may go first.

`disttrain run --nnodes N` meets as `torchrun --rdzv-backend c10d --rdzv-endpoint
MASTER_ADDR:MASTER_PORT --rdzv-id ID` does: torch's DynamicRendezvousHandler over its
C10dRendezvousBackend, built by torch's own `create_backend` / `create_handler`, in a
TCPStore that node 0's agent hosts (`is_host`; torch's guess by host name fails inside a
network namespace, where every node has the machine's name).

What differs, registered as the backend BACKEND, is after the meeting. torch's agent
keeps polling the store for nodes that wait to join (to restart the group with them) and
sends heartbeats. The store lives in node 0's agent, which after a failure exits as soon
as its own ranks ended (only success waits for the other nodes); torch's other agents
then die of the lost connection, stopping their ranks before these could record why they
failed, or finish. So: without restarts (`watch=False`, `--max-restarts 0`) an agent
leaves the store alone once the job has met (no heartbeats, nobody waiting, no closing
write), as under torch's static rendezvous; with restarts it watches as torch does,
every agent joins the next round, and a lost store reads as "nobody waiting".
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
QUIET_S = 10**9
"""Heartbeat interval without restarts: none after the meeting (torch's default is 5 s)."""


class _Handler(RendezvousHandler):
    """torch's c10d handler; after the meeting it needs node 0's store only to restart."""

    def __init__(self, inner: RendezvousHandler, watch: bool):
        self._inner, self._watch, self._lost = inner, watch, False

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
        if not self._watch or self._lost:  # NOTE: the agent asks every monitor interval (0.1 s)
            return 0
        try:
            return self._inner.num_nodes_waiting()
        except RendezvousConnectionError:  # NOTE: node 0's agent ended; see the module docstring
            self._lost = True
            return 0

    def get_run_id(self) -> str:
        return self._inner.get_run_id()

    def shutdown(self) -> bool:
        # NOTE: closing tells agents waiting for the next round to give up; without
        # restarts none waits, and the store may be gone already
        return self._inner.shutdown() if self._watch and not self._lost else True


def _create(params: RendezvousParameters) -> RendezvousHandler:
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    watch = bool(params.get_as_bool("watch", True))
    if not watch:
        params.config.setdefault("keep_alive_interval", QUIET_S)
    backend, store = create_backend(params)
    return _Handler(create_handler(store, backend, params), watch)


def register() -> None:
    """Make BACKEND known to torch's launcher (idempotent)."""
    rendezvous_handler_registry.register(BACKEND, _create)
