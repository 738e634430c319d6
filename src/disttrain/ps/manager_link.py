"""A party's connection to the server manager (manager.py): request, answer, bounded waits.

Servers register and send heartbeats through one (`Heartbeat`, a thread of the server
process), workers look the ring up through one, `disttrain ps status` asks for the
state through one. The link is the worker end of the job's authenticated wire
(transport.WorkerLink: a hello signed with the job secret, then a session), one request
at a time. A manager that forgot the session (it was restarted) drops the frames; the
link then says hello again and sends the request again (after 0.5 s of silence, then 1,
2, up to 4 s), until its deadline: so a
restarted manager is reconnected to without anyone else's help. Requests that change the
membership carry the ring version the link holds (compare and set); every `ring` answer
replaces the held ring when it is newer, never with an older one.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import sys
import threading
import time

import zmq

from disttrain.ps.frame import DEFAULT_LIMITS, Message
from disttrain.ps.keys import encrypt_setting, job_secret, mac_setting
from disttrain.ps.membership import ALIVE, LEAVING, LEFT, MANAGER_INDEX
from disttrain.ps.schema import SchemaError
from disttrain.ps.transport import WorkerLink

__all__ = ["ManagerLink", "ManagerError", "Heartbeat", "SERVER_PARTY", "status_party",
           "fingerprint", "register_server", "lookup_addresses"]

SERVER_PARTY = 1 << 24  # a server's party id is SERVER_PARTY + its index; a worker's, its rank
_RETRY = 0.5  # seconds without an answer before saying hello again (a restarted manager)
_RETRY_MAX = 4.0  # doubled after each silence up to this (a manager slow under load)
_ANSWERS = {"status": "state"}  # every other request is answered by "ring"
_ATTACHABLE = (ALIVE, LEAVING, LEFT)
"""States in which a worker may attach to a server: a drained one (leaving, left) serves its
keys until its hand-over, then answers `moved` (or nothing), and the worker re-routes
(reroute.py), as one attached before the drain does."""


def status_party() -> int:
    """A fresh party id for a one-off client (`disttrain ps status`)."""
    return (1 << 30) + secrets.randbelow(1 << 29)


class ManagerError(RuntimeError):
    """The manager refused a request (its reason) or did not answer in time."""


class ManagerLink:
    """One party's session with the manager; `request` blocks until the answer."""

    def __init__(self, address: str, party: int, *, timeout: float = 10.0,
                 secret: bytes | None = None):
        self.address, self.party, self.timeout = address, party, timeout
        self.ring: dict = {"version": -1}  # the newest `ring` answer's meta
        self._retry = _RETRY
        self._ctx = zmq.Context()
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, DEFAULT_LIMITS.max_frame_bytes)
        sock.connect(address)
        self.link = WorkerLink(sock, secret or job_secret(), party, MANAGER_INDEX,
                               DEFAULT_LIMITS, encrypt_setting(), mac_setting())

    def close(self) -> None:
        """Close the socket (never blocks)."""
        self.link.close()
        self._ctx.term()

    def request(self, op: str, timeout: float | None = None, **meta) -> Message:
        """Send `op` with `meta` (plus the held ring version) and return the answer.

        Blocks up to `timeout` (default the link's): says hello again and resends while
        the manager does not answer. Raises ManagerError for a refusal or no answer."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        want = _ANSWERS.get(op, "ring")
        if op != "status":
            meta.setdefault("ring", self.ring["version"])
        while True:
            if self.link.session is None:
                self._hello(deadline)
            self.link.send(Message(op, dict(meta)))
            reply = self._wait({want, "error"}, deadline)
            if reply is None:
                self.link.session = None  # NOTE: a restarted manager forgot it: greet again
                continue
            self._retry = _RETRY
            if reply.op == "error":
                raise ManagerError(reply.meta["message"])
            if reply.op == "ring" and reply.meta["version"] >= self.ring["version"]:
                self.ring = dict(reply.meta)
            return reply

    def _hello(self, deadline: float) -> None:
        while True:
            self.link.send(Message("hello", {"keys": [], "policy": ""}))
            reply = self._wait({"welcome", "error"}, deadline)
            if reply is not None and reply.op == "error":
                raise ManagerError(reply.meta["message"])
            if reply is not None:
                return

    def _wait(self, ops: set[str], deadline: float) -> Message | None:
        """The next answer of one of `ops`; None after `_retry` s of silence. Raises
        ManagerError past the deadline."""
        end = min(deadline, time.monotonic() + self._retry)
        while True:
            left = end - time.monotonic()
            if left <= 0:
                if time.monotonic() >= deadline:
                    raise ManagerError(self._silent())
                self._retry = min(2 * self._retry, _RETRY_MAX)
                return None
            if self.link.sock.poll(int(left * 1000) + 1):
                try:
                    msg = self.link.recv()
                except SchemaError as e:
                    raise ManagerError(f"the server manager at {self.address} answered "
                                       f"with a malformed frame: {e}") from None
                if msg is not None and msg.op in ops:
                    return msg

    def _silent(self) -> str:
        where = self.address.removeprefix("ipc://")
        if self.address.startswith("ipc://") and not os.path.exists(where):
            return (f"no server manager at {self.address}: no such socket (is the job still "
                    "running? `disttrain run --servers` prints its manager's address)")
        bad = self.link.rejected
        return (f"no answer from the server manager at {self.address} within "
                f"{self.timeout:g} s: it is not running there, or it holds another "
                "DISTTRAIN_SECRET than this process (export the job's secret)"
                + (f"; frames refused here: {dict(bad)}" if bad else ""))


class Heartbeat(threading.Thread):
    """A server's heartbeats to the manager, every `interval` seconds, from its own thread.

    `read()` returns (parameter version, push frames received): plain ints the server
    loop updates (reading them needs no lock). A manager that does not answer is reported
    once per outage and tried again at the next beat; the server keeps serving. `ring`
    is the newest ring the manager answered with (the server loop reads it: takeover.py),
    `adopted` the dead servers' keys this server serves, sent with every report (and
    `copied`, `heads`: the ranges it copied, a joiner's chains, join_status.py).
    """

    def __init__(self, link: ManagerLink, server: int, read, interval: float):
        super().__init__(name=f"ps-heartbeat-{server}", daemon=True)
        self.link, self.server, self.read, self.interval = link, server, read, interval
        self._quit = threading.Event()
        self.failed = False
        self.adopted: list[dict] = []  # NOTE: replaced whole by the server loop, never mutated
        self.copied: list[dict] = []  # the same: ranges copied here again (recopy.py)
        self.heads: list[dict] = []  # the same: a joiner's moved keys, their chains (join_route.py)
        self.accepting, self.drained = -1, False  # a drain's moves: whose keys, done (move.py)

    @property
    def ring(self) -> dict:
        """The newest ring answer's meta (never blocks; a dict replaced whole)."""
        return self.link.ring

    def run(self) -> None:
        while not self._quit.wait(self.interval):
            self._beat(final=False)

    def stop(self) -> None:
        """Stop beating, send the last report (the job ended), close the link (blocks up
        to one request's timeout)."""
        self._quit.set()
        self.join()
        self._beat(final=True)
        self.link.close()

    def _beat(self, final: bool) -> None:
        version, pushes = self.read()
        heads = self.heads  # NOTE: before `adopted`, set after it: a head's route is in this report
        extra = {n: v for n, v in (("adopted", self.adopted), ("copied", self.copied),
                                   ("heads", heads)) if v}
        extra.update(accepting=self.accepting, drained=int(self.drained))
        try:
            self.link.request("report", timeout=max(self.interval, 1.0), server=self.server,
                              version=version, pushes=pushes, final=int(final), **extra)
            self.failed = False
        except ManagerError as e:
            if not self.failed:
                print(f"[ps server{self.server}] heartbeat: {e}", file=sys.stderr, flush=True)
            self.failed = True


def fingerprint(params: list[tuple[str, int, int]], policy: str, chunk_bytes: int) -> str:
    """What every server of one group must agree on: the model's parameters (name, numel,
    element size), the policy and the chunk size, hashed (blake2b, the same in every
    process)."""
    text = json.dumps([params, policy, chunk_bytes])
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def register_server(address: str, index: int, servers: int, listen: str, finger: str,
                    shard: list[tuple[str, int, list[int]]], read, timeout: float,
                    attempt: int = 0) -> Heartbeat:
    """Register server `index` (of `servers`, listening at `listen`, holding `shard`:
    (key, bytes, chain) rows) with the manager at `address` and start its heartbeats
    (every timeout / 5 s, at most 1 s). Blocks until the manager answers (at most
    `timeout` s); raises ManagerError when it refuses (e.g. another model) or is silent."""
    link = ManagerLink(address, SERVER_PARTY + index, timeout=timeout)
    try:
        link.request("register", server=index, address=listen, fingerprint=finger,
                     expected=servers, attempt=attempt, pid=os.getpid(), shard=[{"key": k, "bytes": n, "chain": list(c)}
                                              for k, n, c in shard])
    except ManagerError:
        link.close()
        raise
    beat = Heartbeat(link, index, read, min(1.0, timeout / 5))
    beat.start()
    return beat


def lookup_addresses(address: str, rank: int, servers: int, timeout: float,
                     attempt: int = 0) -> tuple[int, list[str]]:
    """(ring version, the address of each of servers 0..servers-1) from the manager at
    `address`, once all of them registered in launch `attempt` and are alive or drained
    (`_ATTACHABLE`); blocks until then, at most `timeout` seconds (ManagerError naming who
    is missing).

    NOTE: a drain may start before a slow worker looks up: waiting for the drained server
    to be alive again would wait for ever, and under Sync the drain waits for that
    worker's push (its hand-over comes between two rounds), so the servers lost it."""
    link = ManagerLink(address, rank, timeout=timeout)
    deadline = time.monotonic() + timeout
    try:
        while True:
            ring = link.request("lookup", timeout=max(0.1, deadline - time.monotonic())).meta
            rows = {r["server"]: r for r in ring["servers"]}
            missing = [f"{i} ({_where(rows.get(i), attempt)})" for i in range(servers)
                       if _where(rows.get(i), attempt) not in _ATTACHABLE]
            if not missing:
                return ring["version"], [rows[i]["address"] for i in range(servers)]
            if time.monotonic() >= deadline:
                raise ManagerError(
                    f"worker {rank}: servers {', '.join(missing)} of ring version "
                    f"{ring['version']} at the manager {address} after {timeout:g} s; a "
                    "server that failed to start says why above")
            time.sleep(0.05)
    finally:
        link.close()


def _where(row: dict | None, attempt: int) -> str:
    if row is None:
        return "not registered"
    if row["attempt"] != attempt:
        return f"registered in launch attempt {row['attempt']}, this is {attempt}"
    return row["state"]
