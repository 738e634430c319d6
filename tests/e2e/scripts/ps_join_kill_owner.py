"""scripts/ps_join.py's job with replicas=2, whose old owner X dies after its tail's cut.

argv: mode, join step (as ps_join.py), X (an old owner that gives the joiner keys). Server
ranks publish their process ids in the store; the tail T of X's moved range (join_tails.py's
pair (X, T)) SIGKILLs X right after it cut that range for the joiner (the copy is on its
way to the joiner, X has not handed it over: it hands over only once the ring lists the
joiner's install). The joiner runs this script too (`disttrain ps add-server`) and arms
nothing. Worker 0 skips ps_join's wait for the manager to list the joiner at the head of
every moved key (with X dead some are never moved).
"""

import os
import signal
import sys

import ps_join
import torch


def arm(victim: int) -> None:
    """Publish this server's pid; as X's tail, kill X right after cutting its range."""
    import disttrain
    from disttrain import ps
    from disttrain.ps import join_tails

    connect, cut = ps.connect, join_tails.TailJoins._cut

    def publishing(*args, **kw):
        if not ps.joining() and disttrain.role() == "server":
            store = torch.distributed.distributed_c10d._get_default_store()
            store.set(f"join/pid{disttrain.rank() - ps_join.WORKERS}", str(os.getpid()))
        return connect(*args, **kw)

    def cutting(self, address, broken):
        cut(self, address, broken)
        if (victim, self.server.index) in self.pairs and self.exts.get(victim) is not None:
            store = torch.distributed.distributed_c10d._get_default_store()
            pid = int(store.get(f"join/pid{victim}"))
            print(f"server {self.server.index} kills server {victim} after its cut", flush=True)
            os.kill(pid, signal.SIGKILL)

    ps.connect, join_tails.TailJoins._cut = publishing, cutting


if __name__ == "__main__":
    arm(int(sys.argv[3]))
    ps_join.print_chains = lambda *_: None
    ps_join.main(sys.argv[1], int(sys.argv[2]), 2)
