"""Where a drained server's keys go (ps/move.py, pure): every party computes the same
owners from the ring, the placement without the leaving server, so nobody sends them."""

import pytest

from disttrain.ps.move import gone, owners_after
from disttrain.ps.placement import place, plan_keys
from disttrain.ps.server import PSError

PARAMS = [("0.weight", 64 * 64, 4), ("0.bias", 64, 4), ("2.weight", 64 * 10, 4), ("2.bias", 10, 4)]


def _ring(states: dict[int, str]) -> dict:
    return {"version": 7, "servers": [{"server": i, "address": f"ipc://s{i}", "state": st,
                                       "attempt": 0} for i, st in states.items()]}


@pytest.mark.parametrize("servers,leaving", [(3, 0), (3, 2), (4, 1), (6, 5)])
def test_a_drained_servers_keys_go_where_the_placement_without_it_puts_them(servers, leaving):
    plan = plan_keys(PARAMS, servers)
    keys = [c.key for c in plan[leaving]]
    ring = _ring({i: "leaving" if i == leaving else "alive" for i in range(servers)})
    owners = owners_after(PARAMS, ring, leaving, keys, 4 << 20)
    rest = place(PARAMS, [f"server{i}" for i in range(servers) if i != leaving])
    assert owners == {k: int(rest.owner(k).removeprefix("server")) for k in keys}
    assert keys and leaving not in owners.values()
    # the same from a later ring where it left and another server's job ended
    later = _ring({i: "left" if i == leaving else "exited" if i == (leaving + 1) % servers
                   else "alive" for i in range(servers)})
    assert owners_after(PARAMS, later, leaving, keys, 4 << 20) == owners
    assert gone(later) == {leaving: "left"}


def test_with_one_server_left_it_takes_every_key_and_with_none_it_is_an_error():
    plan = plan_keys(PARAMS, 2)
    keys = [c.key for c in plan[1]]
    assert set(owners_after(PARAMS, _ring({0: "alive", 1: "leaving"}), 1, keys, 4 << 20).values()) == {0}
    with pytest.raises(PSError, match="server 1 is leaving and no other server serves"):
        owners_after(PARAMS, _ring({0: "dead", 1: "leaving"}), 1, keys, 4 << 20)
