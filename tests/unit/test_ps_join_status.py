"""The chains after a join with replicas >= 2, as the server manager records them
(ps/join_status.py): the joiner's `heads` rows move each moved key from its old owner's
rows to the joiner's with the chain [joiner, c1, ...], so the status lists each key once,
with r copies, under the server that heads it; nonsense from a peer is refused and changes
nothing; the state file keeps the new chains across a restart of the manager.
"""

import pytest

from disttrain.ps.cli import format_status
from disttrain.ps.join_chains import chains_after, join_moves
from disttrain.ps.join_status import record_heads
from disttrain.ps.manager_link import SERVER_PARTY, ManagerError
from disttrain.ps.membership import Membership, Refused
from disttrain.ps.membership_file import from_json, to_json
from disttrain.ps.placement import plan_keys
from tests.unit.test_ps_join import MIXED, MLP
from tests.unit.test_ps_manager import Live, _register

CHUNK = 4 << 20


def _joined(params, servers: int, r: int):
    """A manager's membership of `servers` servers registered with their chains, a joiner
    (index `servers`) whose routes are listed; (membership, plan, moves, heads rows)."""
    plan = plan_keys(params, servers, chunk_bytes=CHUNK)
    size = {n: e for n, _, e in params}
    m = Membership()
    for i in range(servers):
        m.register(i, f"ipc://s{i}", "fp", servers, [
            [c.key, c.numel * size[c.name], plan.indices(c.key, r)] for c in plan[i]], 0.0)
    m.join(servers, f"ipc://s{servers}", "fp", m.version, 1.0)
    moves = join_moves(params, plan, servers, r, CHUNK)
    nbytes = {c.key: c.numel * size[c.name] for chunks in plan for c in chunks}
    rows = [{"key": mv.key, "bytes": nbytes[mv.key], "chain": list(mv.after),
             "owner": mv.before[0]} for mv in moves]
    owners = sorted({mv.before[0] for mv in moves})
    m.adopt(servers, [{"server": x, "by": servers, "address": f"ipc://r{x}", "keys": 1,
                       "bytes": 1, "version": 3, "after": 0.0} for x in owners], 2.0)
    return m, plan, moves, rows


def _chains(m: Membership) -> dict[str, tuple[int, list[int]]]:
    """key -> (the server whose rows list it, its chain); a key listed twice fails."""
    out = {}
    for i, x in m.members.items():
        for k, _, chain in x.shard:
            assert k not in out, f"{k} listed under servers {out[k][0]} and {i}"
            out[k] = (i, chain)
    return out


@pytest.mark.parametrize("params", [MLP, MIXED], ids=["mlp", "few-large-many-small"])
@pytest.mark.parametrize("servers,r", [(2, 1), (3, 1), (2, 2), (3, 2), (3, 3), (5, 2)])
def test_the_status_lists_r_copies_per_key_under_the_server_that_heads_it(params, servers, r):
    m, plan, moves, rows = _joined(params, servers, r)
    before = _chains(m)
    assert all(i == c[0] for i, c in before.values())  # registered: each under its owner
    version, owners = m.version, {mv.before[0] for mv in moves}
    assert record_heads(m, servers, rows)
    assert m.version == version + len(owners)  # one ring version per old owner
    after = _chains(m)
    assert set(after) == set(before)
    assert {k: c for k, (_, c) in after.items()} == chains_after(plan, r, moves)
    moved = {mv.key for mv in moves}
    for k, (i, chain) in after.items():
        assert len(chain) == len(set(chain)) == r and chain[0] == i
        assert (i == servers) == (k in moved)  # the joiner heads exactly the moved keys
    for x in owners:
        assert any(f"server {servers} heads {sum(mv.before[0] == x for mv in moves)} keys "
                   in e and f"of server {x} with {r} cop{'ies' if r > 1 else 'y'} each, chains "
                   f"[{servers}" in e
                   for e in m.events), m.events
    # every later report repeats the rows: nothing changes
    assert not record_heads(m, servers, rows) and m.version == version + len(owners)
    # a restarted manager reads the new chains back
    back = from_json(to_json(m), now=5.0)
    assert back.version == m.version and _chains(back) == after


def test_the_cli_table_names_the_joiner_at_the_head_of_the_moved_keys():
    m, _, moves, rows = _joined(MLP, 2, 2)
    record_heads(m, 2, rows)
    state = {"version": m.version, "expected": 2, "rejected": {}, "events": m.events,
             "servers": [x.row(m.fingerprint, 3.0) for _, x in sorted(m.members.items())],
             "shard": [{"key": k, "bytes": n, "chain": c, "server": x.server}
                       for _, x in sorted(m.members.items()) for k, n, c in x.shard]}
    text = format_status(state, "ipc://manager", max_keys=100)
    for mv in moves:
        assert f"server 2  chain 2 -> {mv.before[1]}" in next(
            line for line in text.splitlines() if line.strip().startswith(mv.key + " "))
    assert text.startswith(f"ring version {m.version}: ")


def _bad(rows: list[dict], i: int, **change) -> list[dict]:
    return [dict(r, **change) if j == i else r for j, r in enumerate(rows)]


@pytest.mark.parametrize("why", ["chain", "order", "long", "bytes", "key", "owner", "twice",
                                 "not-joiner", "no-route"])
def test_rows_the_join_did_not_make_are_refused_and_change_nothing(why):
    m, _, moves, rows = _joined(MLP, 3, 2)
    by, mv = 3, moves[0]
    other = next(i for i in range(3) if i not in mv.before)
    bad, match = {
        "chain": (_bad(rows, 0, chain=[3, other]), r"as \[3, \d\]; a join makes \[3, "),
        "order": (_bad(rows, 0, chain=list(reversed(mv.after))), "a join makes"),
        "long": (_bad(rows, 0, chain=[*mv.after, other]), "a join makes"),
        "bytes": (_bad(rows, 0, bytes=rows[0]["bytes"] + 4), "does not hold with that size"),
        "key": (_bad(rows, 0, key="no.such#0"), "'no.such#0'.*does not hold"),
        "owner": (_bad(rows, 0, owner=other), f"server {other} does not hold|lists its route"),
        "twice": ([*rows, rows[0]], "twice"),
        "not-joiner": (rows, "did not join this job"),
        "no-route": (rows, "before ring version .* lists its route"),
    }[why]
    if why == "not-joiner":
        by = mv.before[1]
    if why == "no-route":
        m.takeovers.clear()
    version, shards = m.version, to_json(m)
    with pytest.raises(Refused, match=match):
        record_heads(m, by, bad)
    assert m.version == version and to_json(m) == shards


@pytest.mark.timeout(30)
def test_a_live_manager_records_the_joiners_chains_refuses_bad_rows_and_keeps_them(tmp_path):
    m, _, moves, rows = _joined(MLP, 2, 2)  # the rows a real plan gives
    state = str(tmp_path / "manager.json")
    live, links = Live(state), []

    def link(party: int, at: Live):
        links.append(at.link(party))
        return links[-1]

    try:
        for i in (0, 1):
            _register(link(SERVER_PARTY + i, live), i, m.members[i].shard)
        y = link(SERVER_PARTY + 2, live)
        y.request("lookup")
        y.request("join", server=2, address="ipc://s2", fingerprint="fp")
        report = dict(server=2, version=0, pushes=0, final=0, adopted=[dict(t) for t in
                                                                        m.takeovers])
        with pytest.raises(ManagerError, match="schema:report.heads"):
            y.request("report", **report, heads=[dict(rows[0], chain="2,1")])
        with pytest.raises(ManagerError, match="server manager refused report: server 2 "
                                               r"reports the chain of key .* as \[2, 2\]"):
            y.request("report", **report, heads=_bad(rows, 0, chain=[2, 2]))
        y.request("report", **report, heads=rows)
        status = link(1 << 30, live).request("status").meta
        version = status["version"]
        listed = {r["key"]: (r["server"], r["chain"]) for r in status["shard"]}
        assert len(listed) == len(status["shard"])  # each key once
        assert {k: c for k, (_, c) in listed.items()} == chains_after(
            plan_keys(MLP, 2, chunk_bytes=CHUNK), 2, moves)
        assert all(listed[mv.key][0] == 2 for mv in moves)
        assert [r["keys"] for r in status["servers"]] == [
            sum(s == i for s, _ in listed.values()) for i in range(3)]
    finally:
        for each in links:  # NOTE: an open socket would hold the process at exit
            each.close()
        live.close()
    again = Live(state)  # a restarted manager, on its state file
    try:
        status = link(1 << 30, again).request("status").meta
        assert status["version"] == version
        assert {r["key"]: (r["server"], r["chain"]) for r in status["shard"]} == listed
    finally:
        links.pop().close()
        again.close()
