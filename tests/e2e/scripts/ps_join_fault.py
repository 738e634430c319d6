"""scripts/ps_join.py's job, whose joining server SIGKILLs itself at a chosen moment.

argv: mode, join step (as ps_join.py), fault. Only the joining server (the process
`disttrain ps add-server` starts with these same arguments) arms the fault:
"die-copy": on the first `transfer` frame it reads, while an old owner copies the keys
to it (before that owner handed them over: the owners must keep them);
"die-handed": when it is about to serve the first old owner's moved keys (that owner
handed them over and its final marker came: the keys are lost with it, replicas=1);
"die-serving": on the third push frame its routes receive (the workers re-routed to it).
"""

import os
import signal
import sys

import ps_join


def _die(text: str) -> None:
    print(text, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def arm(fault: str) -> None:
    """Make this (joining) server SIGKILL itself at `fault` (see the module's docstring)."""
    from disttrain.ps import move, server, transfer

    if fault == "die-copy":
        transfer.Intake.handle = lambda self, session, msg: _die(
            "joining server dies on a transfer frame")
    elif fault == "die-handed":
        move.Handoff.start = lambda self, d, ring: _die(
            f"joining server dies as server {d} handed its keys over")
    elif fault == "die-serving":
        push, seen = server.Server._push, []

        def dying(self, w, msg, session=None):
            seen.append(w)
            if len(seen) == 3:
                _die("joining server dies on its routes' third push frame")
            return push(self, w, msg, session)

        server.Server._push = dying
    else:
        raise SystemExit(f"unknown fault {fault!r}: die-copy, die-handed or die-serving")


if __name__ == "__main__":
    from disttrain import ps

    if ps.joining():
        arm(sys.argv[3])
    ps_join.main(sys.argv[1], int(sys.argv[2]))
