"""Who heads a moved key once a server joined: the manager records the joiner's chains, pure.

A join with `replicas=r` (docs/design/parameter-server.md, "A server joins", "With
`replicas >= 2`") makes a moved key's chain [X, c1, ..., c(r-1)] into [Y, c1, ..., c(r-1)]:
the joiner Y's route replaces the old owner X at the head, the copies stay
(join_chains.py's `chains_after`). The manager knows the chains the servers registered;
Y's route knows the chain it heads. So Y's heartbeat carries, from the loop turn its route
of X starts, one `heads` row per key of that route (schema.HEAD_ROW: key, bytes, chain
with Y first, owner X), repeated in every report like the `adopted` row beside it, and
`record_heads` moves those keys from X's rows to Y's with the new chains: `disttrain ps
status` then lists each key once, under the server that heads it, with r copies, and the
state file (membership_file.py) keeps it across a restart of the manager.

A row is taken only if it is what the join makes: Y joined this job, the ring lists Y's
route of X (`adopted`), X registered the key with that many bytes, and the chain is X's
with Y in X's place. Anything else is refused (`Refused`, naming the key and the chain
expected), nothing recorded. Rows already recorded are skipped, so the repeats change
nothing. `check_rows` checks the same report's `adopted` and `copied` rows against what
a join (or a takeover) makes, before the manager records any. Pure: no sockets, no clocks.
"""

from __future__ import annotations

from collections import defaultdict

from disttrain.ps.membership import DEAD, LEFT, Membership, Refused

__all__ = ["check_rows", "record_heads"]


def record_heads(members: Membership, by: int, rows: list[dict]) -> bool:
    """Record that server `by` heads the keys of `rows` (its report's `heads`): moved from
    their old owner's rows to `by`'s, with the chains the rows name. True if anything new
    was recorded: one new ring version and event per old owner. Raises Refused for a row
    the join did not make (nothing is recorded then)."""
    taken: dict[int, list[list]] = defaultdict(list)
    seen: set[str] = set()
    for r in rows:
        if r["key"] in seen:
            raise Refused(f"server {by} reports heading key {r['key']!r} twice")
        seen.add(r["key"])
        if _check(members, by, r):
            taken[r["owner"]].append([r["key"], r["bytes"], list(r["chain"])])
    for owner, new in sorted(taken.items()):
        x, y, keys = members.members[owner], members.members[by], {k for k, _, _ in new}
        x.shard = [row for row in x.shard if row[0] not in keys]
        y.shard += new
        chains, r = sorted({tuple(c) for _, _, c in new}), len(new[0][2])
        members.change(
            f"server {by} heads {len(new)} keys ({sum(n for _, n, _ in new) / 1e6:.2f} MB) of "
            f"server {owner} with {r} cop{'ies' if r > 1 else 'y'} each, chains "
            + ", ".join(str(list(c)) for c in chains[:3]) + (" ..." if chains[3:] else "")
            + f"; server {owner} heads {len(x.shard)} keys")
    return bool(taken)


def _check(members: Membership, by: int, r: dict) -> bool:
    """True if row `r` is new and what the join makes; False if recorded already. Raises
    Refused naming what is wrong."""
    key, owner, chain = r["key"], r["owner"], list(r["chain"])
    y, x = members.members.get(by), members.members.get(owner)
    if y is None or by < members.expected:
        raise Refused(f"server {by} reports heading keys of server {owner}, but it did not "
                      "join this job: only a joiner heads keys moved to it")
    if [key, r["bytes"], chain] in y.shard:
        return False
    if x is None or not any((t["server"], t["by"]) == (owner, by) for t in members.takeovers):
        raise Refused(f"server {by} reports heading key {key!r} of server {owner} before "
                      f"ring version {members.version} lists its route of server {owner}'s "
                      "keys (report it in `adopted` first)")
    old = next((row for row in x.shard if row[0] == key), None)
    if old is None or old[1] != r["bytes"]:
        raise Refused(f"server {by} reports heading key {key!r} ({r['bytes']} bytes), which "
                      f"server {owner} does not hold" + (f" with that size ({old[1]} bytes)"
                                                        if old else ""))
    if chain != [by, *old[2][1:]]:
        raise Refused(f"server {by} reports the chain of key {key!r} as {chain}; a join makes "
                      f"{[by, *old[2][1:]]} (server {owner}'s {old[2]} with server {by} at "
                      "its head)")
    return True


def _heir(members: Membership, x: int, by: int) -> bool:
    """Old server `by` may serve alive old owner x's moved keys: the ring lists a route of
    x on a joiner it marks dead (takeover.py's `_joiner_routes`: their first live copy)."""
    return by < members.expected and any(
        t["server"] == x and t["by"] >= members.expected
        and getattr(members.members.get(t["by"]), "state", None) == DEAD
        for t in members.takeovers)


def check_rows(members: Membership, by: int, adopted: list[dict], copied: list[dict]) -> None:
    """Raise Refused, before anything is recorded, for a report's `adopted` route of an
    alive server that no join makes (only the old owner's own route X@X, a joiner's X@Y
    of an old owner, or, once that joiner is dead, an old server's, `_heir`) or a new
    `copied` row naming an owner or copier that is not a member,
    or, a joiner's install, a range the old owner's registered chains do not give the
    joiner through that tail ([X, ..., T], at least that many keys)."""
    for r in adopted:
        x = members.members.get(r["server"])
        if x is None or x.state in (DEAD, LEFT):
            continue  # NOTE: a takeover's row: Membership.adopt's own checks
        if not (r["server"] < members.expected and (
                r["server"] == by or by >= members.expected and by in members.members
                or _heir(members, r["server"], by))):
            raise Refused(f"server {by} reports in `adopted` a route of alive server "
                          f"{r['server']}'s keys: only server {r['server']} itself or a server "
                          "that joined this job serves them (a join's routes)")
    for r in (r for r in copied if r not in members.copies):
        x, t = members.members.get(r["server"]), r["by"]
        if x is None or t not in members.members:  # NOTE: t == x: a recopy of x's own keys
            raise Refused(f"server {by} reports in `copied` a copy of server "
                          f"{r['server']}'s keys from server {t}: both must be members of "
                          "this job")
        tails = sum(c[0] == x.server and c[-1] == t for _, _, c in x.shard)
        if by >= members.expected and r["keys"] > tails:
            raise Refused(f"server {by} reports in `copied` {r['keys']} keys of server "
                          f"{x.server} from server {t}, which is the tail of {tails} of its "
                          "registered chains: a join copies each moved key from its tail")
