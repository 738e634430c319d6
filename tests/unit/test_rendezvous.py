"""The multi-node rendezvous (launch/rendezvous.py): torch's c10d, outliving node 0's store.

A real TCPStore plays node 0's agent's; one handler joins the rendezvous in it, as an
agent on another node does, then the store goes away as node 0's agent does when its
ranks failed. torch's own handler then raises where the agent asks for waiting nodes
(the agent dies and kills its ranks); ours says none are waiting, whether it watches for
them (--max-restarts > 0) or not.
"""

import time

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousParameters
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from disttrain.launch import rendezvous


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend, watch", [("c10d", True), (rendezvous.BACKEND, True),
                                            (rendezvous.BACKEND, False)])
def test_only_our_handler_outlives_the_store_of_node_0(backend, watch, monkeypatch, capfd):
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # as `disttrain run` sets it
    rendezvous.register()
    node0 = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    params = RendezvousParameters(backend, f"127.0.0.1:{node0.port}", "job-1", 1, 1,
                                  local_addr="127.0.0.1", is_host=False, watch=watch)
    handler = get_rendezvous_handler(params)
    try:
        info = handler.next_rendezvous()
        assert (info.rank, info.world_size, handler.get_backend()) == (0, 1, backend)
        assert node0.check(["torch.rendezvous.job-1"])  # the c10d backend's state is in node 0's store
        assert handler.num_nodes_waiting() == 0
        del node0, info  # node 0's agent ends
        time.sleep(1.2)  # NOTE: past the handler's 1 s cache of the rendezvous state
        if backend == "c10d":
            with pytest.raises(RendezvousConnectionError):
                handler.num_nodes_waiting()
        else:
            assert handler.num_nodes_waiting() == 0
            assert handler.num_nodes_waiting() == 0
    finally:
        handler.shutdown()
    if not watch:  # NOTE: nothing touched the store after the meeting: torch's C++ warns of none
        assert "TCPStore" not in capfd.readouterr().err
