"""Chain extension: make server Y a caught-up extra copy (a new tail) of keys headed by X.

The primitive live membership is built on (a server joins, a server drains, a range is
copied again after a failover): van Renesse & Schneider 2004, sec. 3 ("chain
extension"). The current tail T of the keys' chains (T = X with replicas=1) cuts a
consistent state of them between two updates it applies, and sends it to Y in chunked
`transfer` frames on the server-to-server link (replica.py's: authenticated, sequenced,
schema-checked, shared memory on one host): every key's value, every optimizer tensor,
the head's version, and per worker the latest push clock the state holds with the keys
it stepped (so a later takeover on Y applies a re-sent push at most once). In the same
instant T makes Y the next server of those keys' chains, so every later update goes to
Y *after* the state on the same FIFO session: Y
needs no log and no buffering, it installs the state and then applies the forwarded
updates in order. From the cut on, T's commits of those keys (and, if T is the head, its
acks and pulls) wait for Y's commit too. Workers go on training: the moved keys pause
while T copies their state (the cut) and until Y committed its first update; other keys
never wait for Y.

Who talks to whom: `extend` on T (it opens a link to Y if it has none, as replica.py
does), `accept` on Y (it admits T's link and the keys). Y commits each `transfer` frame
like a `replicate` frame. A frame out of order, of keys Y was not told, naming another
head (`origin`), of another shape or dtype (a value's, or a state tensor's against what
the job's optimizer keeps), larger than a chunk, or from another server is refused,
counted by reason, answered with an error naming op and field, and changes nothing. Becoming the head (the
workers re-routed to Y) and the manager's part are not here: docs/design/
parameter-server.md, "Moving key ranges".
"""

from __future__ import annotations

import functools
import time

import torch
import zmq

from disttrain.ps.frame import Message, group_keys
from disttrain.ps.placement import Plan
from disttrain.ps.replica import Replicas
from disttrain.ps.schema import SchemaError
from disttrain.ps.server import PSError
from disttrain.ps.staleness import StaleStep

__all__ = ["extend", "accept", "Extension", "Intake", "SEP"]

SEP = "|"  # a state tensor's name in a frame: key + SEP + optimizer field (the value: key)


def _chain_of(server, plan: Plan, init: dict, optimizer, r: int, secret: bytes,
              chunk_bytes: int) -> Replicas:
    """The server's Replicas; built with r = 1 (no copies yet) when it has none."""
    if server.chain is None:
        server.chain = Replicas(server.index, len(server.workers), plan, r, init, optimizer,
                                server.policy, server.ep, secret, timeout=server.timeout,
                                chunk_bytes=chunk_bytes)
    if server.chain.optimizer is None:
        server.chain.make_optimizer = optimizer  # NOTE: for copies installed later (Intake)
    return server.chain


class Extension:
    """On T: at head version `at_version` or later, cut `keys`' state and make server
    `target` (at `address`) their new tail. `tick()` (the server loop's) never blocks."""

    def __init__(self, server, chain: Replicas, keys: list[str], target: int, address: str,
                 at_version: int):
        self.server, self.chain, self.keys, self.target = server, chain, list(keys), target
        self.address, self.at_version = address, at_version
        heads = {chain.chains[k][0] for k in keys}
        if len(heads) != 1:
            raise ValueError(f"extend: keys headed by servers {sorted(heads)}; extend one "
                             "head's keys at a time")
        self.origin = heads.pop()
        for k in keys:
            if chain.hop.get(k, 0) is not None or server.index not in chain.chains[k]:
                raise ValueError(f"extend on server {server.index}: {k!r} has chain "
                                 f"{chain.chains[k]}, this server is not its tail")
            if target in chain.chains[k]:
                raise ValueError(f"extend: server {target} already holds {k!r}")
        self.stats: dict | None = None  # after the cut: keys, bytes, frames, version, pause

    def _version(self) -> int:
        if self.origin == self.server.index:
            return self.server.policy.version
        return self.chain.version.get(self.origin, 0)

    def tick(self) -> None:
        if self.stats is not None or self._version() < self.at_version:
            return
        if self._ended():  # NOTE: Y would wait for a final marker already sent
            self.stats = {"to": self.target, "keys": 0, "skipped": "the head's job ended"}
        else:
            self.cut()

    def _ended(self) -> bool:
        """Has this server sent its last marker for the head's keys (the job ended)?"""
        ch = self.chain
        if self.origin == self.server.index:
            return ch.final_sent
        return any(o == self.origin for o, _ in ch.finals)

    def _holder(self, k: str):
        """(parameter, optimizer) holding key k here: the head's own or a copy."""
        if self.origin == self.server.index:
            return self.server.params[k], self.server.optimizer
        return self.chain.params[k], self.chain.optimizer

    def cut(self) -> None:
        """Send the state, then extend the chains (between two updates: never blocks)."""
        t0, version = time.perf_counter(), self._version()
        rows = []  # (key, fields, tensors)
        for k in self.keys:
            p, opt = self._holder(k)
            st = opt.state.get(p, {}) if opt is not None else {}
            odd = [n for n, v in st.items() if not torch.is_tensor(v)]
            if odd:  # NOTE: never moved without them: the copy would step differently
                raise PSError(f"server {self.server.index}: cannot move {k!r} to server "
                              f"{self.target}: its optimizer state {odd} is not tensors "
                              f"({type(opt).__name__}); use an optimizer that keeps tensors")
            fields = sorted(st)
            rows.append((k, fields, [p.detach().clone()] + [st[n].detach().clone()
                                                            for n in fields]))
        link = self.chain.links.get(self.target) or self._open(rows)
        frames = _frames(rows, self.chain.chunk_bytes)
        for i, (fields, group) in enumerate(frames):
            meta = {"origin": self.origin, "version": version, "part": i,
                    "parts": len(frames), "fields": fields}
            if i + 1 == len(frames):  # NOTE: cut with the state: what a takeover must not redo
                meta["clocks"] = self._clocks()
            names = [n for k, _, ts in group for n in [k] + [k + SEP + f for f in fields]]
            self.chain.send(self.target, Message("transfer", meta, names,
                                                  [t for _, _, ts in group for t in ts]))
        self._relink()
        self.stats = {"to": self.target, "keys": len(rows), "version": version,
                      "frames": len(frames), "link_reused": link is not None,
                      "bytes": sum(t.numel() * t.element_size() for *_, ts in rows for t in ts),
                      "pause_s": time.perf_counter() - t0}

    def _clocks(self) -> list[dict]:
        """Per worker, the latest push the moved keys' state holds and which of them it
        stepped (a later takeover on the target applies a re-sent push at most once)."""
        moved = set(self.keys)
        return [{"worker": w, "clock": c, "keys": sorted(ks & moved)}
                for w, (c, ks) in sorted(self.chain.clocks.get(self.origin, {}).items())]

    def _open(self, rows) -> None:
        """A link to the target (none carried keys to it yet); returns None."""
        nbytes = sum(t.numel() * t.element_size() for *_, ts in rows for t in ts)
        link = self.chain.open_link(self.target, self.address, [], nbytes)
        self.server.poller.register(link.sock, zmq.POLLIN)

    def _relink(self) -> None:
        """Make the target the next server of every moved key's chain, here."""
        ch, j = self.chain, self.target
        for k in self.keys:
            old = tuple(ch.chains[k])
            at = old.index(self.server.index)
            ch.chains[k] = [*old, j]
            ch.hop[k] = j
            ch.origin_hops[self.origin].add(j)  # NOTE: acks and pulls now wait for j too
            ch.paths[(self.origin, old[at - 1] if at else None)].add(j)
            chunk = next(c for c in ch.ranges[old] if c.key == k)
            ch.ranges[old].remove(chunk)
            ch.ranges[(*old, j)].append(chunk)
            if not ch.ranges[old]:
                del ch.ranges[old]


@functools.lru_cache(maxsize=64)
def _state(make, numel: int, dtype) -> dict[str, tuple]:
    """field -> (shape, dtype) of the state the optimizer `make` builds keeps on a key of
    `numel` entries of `dtype` once stepped: what every copy holds (one factory a job)."""
    p = torch.nn.Parameter(torch.zeros(numel, dtype=dtype))
    opt, p.grad = make([p]), torch.zeros(numel, dtype=dtype)
    opt.step()
    return {n: (tuple(v.shape), v.dtype) for n, v in opt.state[p].items() if torch.is_tensor(v)}


def _frames(rows, chunk_bytes: int) -> list[tuple[list[str], list]]:
    """rows cut into frames of one field set each, at most a chunk of values per frame."""
    by_fields: dict[tuple, list] = {}
    for row in rows:
        by_fields.setdefault(tuple(row[1]), []).append(row)
    out = []
    for fields, group in by_fields.items():
        sizes = [ts[0].numel() * ts[0].element_size() for _, _, ts in group]
        out += [(list(fields), [group[i] for i in g]) for g in group_keys(sizes, chunk_bytes)]
    return out


def extend(server, plan: Plan, init: dict, optimizer, keys: list[str], target: int,
           address: str, *, replicas: int, secret: bytes, chunk_bytes: int,
           at_version: int = 0) -> Extension:
    """On the tail T of `keys`' chains: make server `target` their new tail once the head's
    version reaches `at_version` (during `server.serve()`, from its loop). Call before
    `serve`; does not block. Raises ValueError naming the key when T is not its tail."""
    chain = _chain_of(server, plan, init, optimizer, replicas, secret, chunk_bytes)
    ext = Extension(server, chain, keys, target, address, at_version)
    server.ticks.append(ext.tick)
    return ext


def accept(server, plan: Plan, init: dict, optimizer, source: int, keys: list[str], *,
           replicas: int, secret: bytes, chunk_bytes: int) -> Intake:
    """On Y: take `keys` from server `source`, their chains' tail, as their new tail. Call
    before `serve`; does not block."""
    chain = _chain_of(server, plan, init, optimizer, replicas, secret, chunk_bytes)
    intake = Intake(server, chain, plan, init, source, keys)
    intake.make = optimizer  # NOTE: what state a key may carry (`_state`)
    chain.intake = intake.handle
    return intake


class Intake:
    """On Y: checks, stages and installs the state of `keys` sent by server `source`."""

    def __init__(self, server, chain: Replicas, plan: Plan, init: dict, source: int,
                 keys: list[str]):
        self.server, self.chain, self.source = server, chain, source
        chunks = {c.key: c for cs in plan for c in cs}
        for k in keys:
            if chain.chains[k][-1] != source or server.index in chain.chains[k]:
                raise ValueError(f"accept on server {server.index}: {k!r} has chain "
                                 f"{chain.chains[k]}; take it from its tail, once")
        self.chunks = {k: chunks[k] for k in keys}
        self.shape = {k: (c.numel, init[c.name].dtype) for k, c in self.chunks.items()}
        self.peer = chain.base + source
        chain.admit(self.peer)  # NOTE: its hello comes as worker W + source, with no keys
        self.staged: dict[str, list] = {}
        self.part, self.parts, self.version = 0, None, None
        self.stats: dict | None = None  # once installed: keys, bytes, version, frames

    def handle(self, session, msg: Message) -> None:
        """One `transfer` frame of a predecessor's link (schema checked): stage it,
        commit it; the last one installs the state. A bad one is refused, nothing kept."""
        try:
            rows = self._check(session, msg)
        except SchemaError as e:
            self.server.ep.rejected[e.reason] += 1
            self.server.ep.send(session, Message("error", {"message": (
                f"server {self.server.index} refused a transfer frame from server "
                f"{session.worker - self.chain.base}: {e}")}))
            return
        self.staged.update(rows)
        self.part, self.parts, self.version = self.part + 1, msg.meta["parts"], msg.meta["version"]
        if self.part == self.parts:
            self._install(msg.meta["origin"], msg.meta.get("clocks") or [])
        self.chain.received[self.peer] += 1
        self.server.ep.send(session, Message("commit", {"frame": self.chain.received[self.peer]}))

    def _check(self, session, msg: Message) -> dict[str, list]:
        """key -> [value, *state] of a well-formed next frame; raises SchemaError."""
        m, fields = msg.meta, msg.meta["fields"]
        if session.worker != self.peer or self.stats is not None:
            raise SchemaError("transfer", "worker", f"server {self.server.index} takes a "
                              f"transfer from server {self.source} only, once")
        if m["part"] != self.part or (self.parts is not None and m["parts"] != self.parts):
            raise SchemaError("transfer", "part", f"part {m['part']} of {m['parts']} out of "
                              f"order: expected part {self.part}" + (
                                  f" of {self.parts}" if self.parts is not None else ""))
        if any(self.chain.chains[k][0] != m["origin"] for k in msg.keys if k in self.shape):
            raise SchemaError("transfer", "origin", f"server {m['origin']} does not head "
                              "every key of it")  # NOTE: their version and clocks would go to it
        if self.version is not None and m["version"] != self.version:
            raise SchemaError("transfer", "version", f"version {m['version']} in a transfer "
                              f"cut at version {self.version}")
        if any(SEP in f for f in fields) or len(set(fields)) != len(fields):
            raise SchemaError("transfer", "fields", f"bad optimizer fields {fields[:4]}")
        values = msg.keys[::1 + len(fields)]
        want = [n for k in values for n in [k] + [k + SEP + f for f in fields]]
        if list(msg.keys) != want:
            raise SchemaError("transfer", "keys", "tensors are not [value, *fields] per key")
        rows = {}
        for i, k in enumerate(values):
            if k not in self.shape or k in self.staged or k in rows:
                raise SchemaError("transfer", "keys", f"key {k[:80]!r} is not one this "
                                  "transfer moves, or came twice")
            ts = msg.tensors[i * (1 + len(fields)):(i + 1) * (1 + len(fields))]
            numel, dtype = self.shape[k]
            if ts[0].dim() != 1 or ts[0].dtype != dtype or ts[0].numel() != numel:
                raise SchemaError("transfer", "keys", f"{k!r}: its value must be a 1-D {dtype} "
                                  f"of {numel} entries, got {ts[0].dtype} {list(ts[0].shape)}")
            got = {f: (tuple(t.shape), t.dtype) for f, t in zip(fields, ts[1:])}
            if fields and got != (want := _state(self.make, numel, dtype)):
                raise SchemaError("transfer", "keys", f"{k!r}: optimizer state {got}; this "
                                  f"job's optimizer keeps {want}")
            rows[k] = [t.clone() for t in ts]  # NOTE: the frame may be a view of shm
        size = sum(r[0].numel() * r[0].element_size() for r in rows.values())
        if len(rows) > 1 and size > self.chain.chunk_bytes:
            raise SchemaError("transfer", "keys", f"{size} bytes of values in one frame, more "
                              f"than a chunk ({self.chain.chunk_bytes})")
        if m["part"] + 1 == m["parts"] and set(self.staged) | set(rows) != set(self.shape):
            raise SchemaError("transfer", "parts", f"the last part came with "
                              f"{len(self.shape) - len(self.staged) - len(rows)} keys missing")
        self._check_clocks(m)
        return {k: (ts, fields) for k, ts in rows.items()}

    def _check_clocks(self, m: dict) -> None:
        """Raise SchemaError unless `clocks` (the last part's only) names workers, once
        each, and keys this transfer moves."""
        rows = m.get("clocks")
        if rows is None:
            return
        if m["part"] + 1 != m["parts"]:
            raise SchemaError("transfer", "clocks", f"part {m['part']} of {m['parts']} carries "
                              "clocks: only the last part does")
        workers = [r["worker"] for r in rows]
        if len(set(workers)) != len(workers) or any(w >= self.chain.base for w in workers):
            raise SchemaError("transfer", "clocks", f"workers {workers[:8]}: each a worker of "
                              f"the job (< {self.chain.base}), once")
        odd = next((k for r in rows for k in r["keys"] if k not in self.shape), None)
        if odd is not None:
            raise SchemaError("transfer", "clocks", f"key {odd[:80]!r} is not one this "
                              "transfer moves")

    def _install(self, origin: int, clocks: list[dict]) -> None:
        """Make the staged copies live (values, optimizer state, version, chains, the
        workers' push clocks)."""
        ch, t0 = self.chain, time.perf_counter()
        new = {k: torch.nn.Parameter(ts[0]) for k, (ts, _) in self.staged.items()}
        if ch.optimizer is None:  # NOTE: built by the job's factory, as every copy's is
            ch.optimizer = ch.make_optimizer(list(new.values()))
            ch.stepper = StaleStep(ch.optimizer, self.server.policy.rule)
        else:
            ch.optimizer.add_param_group({"params": list(new.values())})
        for k, (ts, fields) in self.staged.items():
            p = ch.params[k] = new[k]
            if fields:
                ch.optimizer.state[p] = dict(zip(fields, ts[1:]))
            old = tuple(ch.chains[k])
            ch.chains[k] = [*old, self.server.index]
            ch.hop[k] = None
            ch.expect[self.peer][k] = self.shape[k]
            ch.nbytes[k] = p.numel() * p.element_size()
            ch.ranges[tuple(ch.chains[k])].append(self.chunks[k])
        ch.origins.add(origin)
        ch.version[origin] = max(ch.version.get(origin, 0), self.version)
        for row in clocks:  # NOTE: merged with what this server holds of the head's other keys
            w, c, have = row["worker"], row["clock"], ch.clocks[origin].get(row["worker"])
            if have is None or c >= have[0]:
                ch.clocks[origin][w] = (c, set(row["keys"]) | (have[1] if have and have[0] == c
                                                                else set()))
        ch.feeds.add((origin, self.source))
        self.stats = {"from": self.source, "keys": len(new), "version": self.version,
                      "frames": self.parts, "install_s": time.perf_counter() - t0,
                      "bytes": sum(t.numel() * t.element_size() for ts, _ in self.staged.values()
                                   for t in ts)}
        self.staged = {}
