"""A server that joins a running job: `ps.join`, the joining server's side.

`disttrain ps add-server ADDR --workers W -- script.py [args]` starts the job's script as
a joining server (DISTTRAIN_PS_JOIN=W, the manager in DISTTRAIN_PS_MANAGER, the job's
DISTTRAIN_SECRET), with no process group: it cannot join the job's gloo group, and needs
none (it talks to the manager and the servers over the job's wire only). There `ps.connect`
(or `ps.join` from a script) builds a `Server` that holds no keys, asks the manager to
`join` the ring as the next free index S (the manager marks it JOINING: a new ring
version), admits the link and the keys of every old owner X that gives it keys
(`joined_owners`, join_moves.py; transfer.accept) and says so (`accepting` = its own index).
With replicas >= 2 (r read from the manager's chains) it admits each range's tail instead
and serves an old owner's moved keys once its `handed` marker came (join_tails.py,
join_route.py: "With `replicas >= 2`" in the design page).
Each X then extends those keys' chains to it and hands them over (join_moves.py); once X's
final marker came (after every update X applied), this server serves X's moved keys as a
route "X@S" (takeover.py's route) and reports it (`adopted`) and their chains, [S]
(`heads`: what `disttrain ps status` lists, join_status.py). Its own loop talks to no
worker: it ends once every route started, and `join` returns when the routes end (every
worker said done). Docs: docs/design/parameter-server.md, "Live membership".
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable

import torch

from disttrain import settings
from disttrain.ps.join_moves import Giving, joined_owners, joiner, routes_done
from disttrain.ps.join_route import JoinRoutes
from disttrain.ps.join_tails import join_intakes
from disttrain.ps.keys import job_secret
from disttrain.ps.manager_link import (
    SERVER_PARTY,
    Heartbeat,
    ManagerError,
    ManagerLink,
    fingerprint,
    status_party,
)
from disttrain.ps.move import say
from disttrain.ps.placement import plan_keys
from disttrain.ps.policy import Policy, Sync
from disttrain.ps.ring import DEFAULT_CHUNK_BYTES
from disttrain.ps.server import PSError, Server
from disttrain.ps.transfer import accept

__all__ = ["join", "joining", "joined", "JOIN_ENV"]

JOIN_ENV = settings.PS_JOIN
"""Set by `disttrain ps add-server` to the job's number of workers: this process is a
server joining a running job (`ps.connect` calls `join`)."""


def joining() -> int:
    """The job's number of workers when this process was started to join a running job
    (`disttrain ps add-server`), else 0. Reads the settings; does not block."""
    return settings.current().ps_join


def joined(manager: str | None = None, *, timeout: float = 120.0, process=None) -> int:
    """Block until a server joined the ring of the manager (default DISTTRAIN_PS_MANAGER):
    its index. Raises ManagerError after `timeout` s (a joining server starts a Python
    process: seconds), or at once when `process` (the joining server's `subprocess.Popen`,
    if given) exited first: its join was refused or it failed. Asks every 0.1 s."""
    address = manager or settings.current().ps_manager
    link = ManagerLink(address, status_party(), timeout=timeout)
    deadline = time.monotonic() + timeout
    try:
        while (new := joiner(link.request("lookup").meta)) is None:
            if process is not None and process.poll() is not None:
                raise ManagerError(f"the joining server's process exited with "
                                   f"{process.returncode} before it joined the ring of the "
                                   f"manager at {address} (its error is in its output)")
            if time.monotonic() > deadline:
                raise ManagerError(f"no server joined the ring of the manager at {address} "
                                   f"within {timeout:g} s")
            time.sleep(0.1)
        return new
    finally:
        link.close()


class _Joiner(Server):
    """The joining server's own loop: no worker talks to it (they reach its routes), so it
    watches no worker's silence and ends once every route started."""

    takes = None

    def _check_liveness(self) -> None:
        return

    def _ended(self) -> bool:
        return self.takes is not None and self.takes.started | self.takes.skipped >= set(
            self.takes.intakes)


class _Takes:
    """The joiner's watch: serve an old owner's moved keys once its final marker came."""

    def __init__(self, server: _Joiner, beat, plan, init, policy, optimizer, secret: bytes,
                 intakes: dict, *, host: str, chunk_bytes: int):
        self.server, self.beat, self.intakes = server, beat, intakes
        self.make = lambda: Giving(server, beat, plan, init, policy, optimizer, secret,
                                     host=host, chunk_bytes=chunk_bytes)
        self.handoff: Giving | None = None  # NOTE: made at the first route, as move.py's
        self.started: set[int] = set()
        self.skipped: set[int] = set()  # old owners whose job ended before they handed over
        server.watch, server.takes = self, self

    def __call__(self) -> None:
        if self.handoff is not None and self.handoff.failure is not None:
            raise PSError(f"server {self.server.index}: keys it took failed: "
                          f"{self.handoff.failure}")
        ring, me = self.beat.ring, self.server.index
        handed = {t["server"] for t in ring.get("takeovers", []) if t["server"] == t["by"]}
        ended = {r["server"] for r in ring.get("servers", []) if r["state"] == "exited"}
        finals = {o for o, _ in self.server.chain.finals}
        for x, intake in sorted(self.intakes.items()):
            if x in self.started | self.skipped:
                continue
            if x in handed and intake.stats is not None and x in finals:
                self.started.add(x)  # NOTE: x's final marker came after all it applied
                self.handoff = self.handoff or self.make()
                self.handoff.start(x, ring.get("version", 0))
                self.server.watch = self  # NOTE: the Takeover made itself the watch
                self.beat.heads = self.beat.heads + [  # NOTE: after `adopted` (join_status.py)
                    {"key": k, "bytes": p.numel() * p.element_size(), "chain": [me], "owner": x}
                    for route, _, row in self.handoff.routes if row["server"] == x
                    for k, p in route.params.items()]
            elif x in ended:
                self.skipped.add(x)
                say(f"[ps server{me}] server {x}'s job ended before it handed its keys over: "
                    "they stayed on it")

    def finish(self) -> list[dict]:
        """Block until the routes end (the job's end); their rows."""
        return routes_done(self.handoff) if self.handoff is not None else []


def _owner_intakes(server, spec, plan, init: dict, optimizer, secret: bytes,
                   chunk_bytes: int) -> dict:
    """replicas=1: admit the link and moved keys of every old owner X that gives `server`
    keys, one Intake per X (X itself extends its keys to it: join_moves.py). Never blocks."""
    intakes = {}
    for x in range(len(plan)):
        owners = joined_owners(spec, len(plan), server.index, x, [c.key for c in plan[x]],
                               chunk_bytes)
        keys = [k for k, o in owners.items() if o == server.index]
        if keys:
            intakes[x] = accept(server, plan, init, optimizer, x, keys, replicas=1,
                                secret=secret, chunk_bytes=chunk_bytes)
    chain = server.chain
    if intakes:
        chain.intake = lambda session, msg: intakes.get(  # NOTE: one Intake per old owner
            session.worker - chain.base, next(iter(intakes.values()))).handle(session, msg)
    return intakes


def _refuse_snapshot(snapshot: str | None) -> None:
    """A join with snapshots is refused: the joiner keeps none, and a restart after the join
    would restore the old owners' snapshots of the hand-over, counting none of the updates
    since as lost (seen: the 4 updates the routes applied lost, reported as 0)."""
    if snapshot:
        raise ValueError(f"ps.join with snapshot={snapshot!r}: a joined server keeps no "
                         "snapshot of the keys it takes, and a restart (disttrain run "
                         "--max-restarts) after the join restores its old owners' snapshots "
                         "of the hand-over, counting none of the updates since as lost: join "
                         "a job without snapshot=, or restart the job with --servers N+1")


def join(model: torch.nn.Module, policy: Policy | None = None,
         optimizer: Callable | None = None, *, workers: int, manager: str | None = None,
         timeout: float | None = None, host: str | None = None,
         chunk_bytes: int = DEFAULT_CHUNK_BYTES, snapshot: str | None = None) -> dict:
    """Join the running job whose server manager is `manager` (default DISTTRAIN_PS_MANAGER)
    as a new server, take its share of the keys while the workers train, serve them until
    every worker is done; return the stats of the routes it served. Blocks for the whole
    job. Needs no process group; the job's DISTTRAIN_SECRET.

    model, policy, optimizer, chunk_bytes: as every other rank passes them (the manager
        refuses another model or policy, naming the fix). workers: the job's number of
        workers. timeout, host: as `ps.serve`'s.
    snapshot: refused (ValueError) when given: `ps.connect` passes the job's `snapshot=`.
    Raises ManagerError with the manager's reason when the join is refused (a job of one
    server, a drain or another join under way or done).
    """
    _refuse_snapshot(snapshot)
    address = manager or settings.current().ps_manager
    if not address:
        raise ValueError("ps.join: no server manager: pass manager=ADDR (the job's, as "
                         "`disttrain run --servers` prints it) or set DISTTRAIN_PS_MANAGER")
    policy = policy if policy is not None else Sync()
    optimizer = optimizer or (lambda params: torch.optim.SGD(params, lr=0.1))
    timeout = timeout if timeout is not None else settings.current().ps_timeout
    spec = [(n, p.numel(), p.element_size()) for n, p in model.named_parameters()]
    ask = ManagerLink(address, status_party(), timeout=timeout)
    try:
        ring = ask.request("lookup").meta
        replicas = max([len(r["chain"]) for r in ask.request("status").meta["shard"]] + [1])
    finally:
        ask.close()
    servers, index = ring["expected"], max([r["server"] for r in ring["servers"]] + [-1]) + 1
    plan, init, fresh = (plan_keys(spec, max(servers, 1), chunk_bytes=chunk_bytes),
                         dict(model.named_parameters()), copy.deepcopy(policy))
    secret, host = job_secret(), host or settings.current().ps_host
    server = _Joiner(index, [], init, policy, optimizer, list(range(workers)), secret,
                     host=host, timeout=timeout, chunk_bytes=chunk_bytes)
    link = ManagerLink(address, SERVER_PARTY + index, timeout=timeout)
    try:
        link.request("lookup")
        link.request("join", server=index, address=server.address,
                     fingerprint=fingerprint(spec, repr(policy), chunk_bytes))
    except ManagerError:
        link.close()
        server.close()
        raise
    beat = Heartbeat(link, index, lambda: (0, 0), min(1.0, timeout / 5))
    beat.start()
    try:
        if replicas >= 2:  # NOTE: the tails copy the moved keys, then each X hands over
            intakes = join_intakes(server, spec, plan, init, optimizer, replicas,
                                   secret=secret, chunk_bytes=chunk_bytes)
            takes = JoinRoutes(server, beat, intakes, plan, init, fresh, optimizer, secret,
                               host=host, chunk_bytes=chunk_bytes)
            gives = {x: len(keys) for x, keys in takes.owners.items()}
        else:
            intakes = _owner_intakes(server, spec, plan, init, optimizer, secret, chunk_bytes)
            takes = _Takes(server, beat, plan, init, fresh, optimizer, secret, intakes,
                           host=host, chunk_bytes=chunk_bytes)
            gives = {x: len(i.chunks) for x, i in intakes.items()}
        print(f"[ps server{index}] joined ring version {link.ring['version']}"
              f"{f' (replicas={replicas})' if replicas > 1 else ''}: takes "
              + ", ".join(f"{n} keys of server {x}" for x, n in gives.items()), flush=True)
        beat.accepting = index  # NOTE: after every Intake admitted its link
        stats = server.serve()
        stats["takeovers"] = takes.finish() if replicas < 2 else routes_done(takes)
    finally:
        beat.stop()
    stats.update(servers=servers + 1, joined=index)
    return stats
