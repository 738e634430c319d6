"""The server manager of a parameter-server job that `disttrain run --servers` launches.

For a one-node job with servers, the launcher forks the manager (disttrain/ps/manager.py)
before the ranks start and tells them its address in DISTTRAIN_PS_MANAGER: servers
register there, workers learn the ring from it. Its state file is `ps-manager.json` in
the job's log folder (`--log-dir` keeps it); it prints its address, which
`disttrain ps status ADDR` reads while the job runs (with the job's DISTTRAIN_SECRET
exported). A job whose environment names a manager already (a standing one) uses that
one; a multi-node job gets none (the store carries the addresses, as before).
"""

from __future__ import annotations

import contextlib
import os

from disttrain import settings
from disttrain.ps.manager import start

__all__ = ["ps_manager"]


@contextlib.contextmanager
def ps_manager(cfg, log_dir: str, env: dict[str, str]):
    """Start the job's manager, put its address into `env` (the ranks' variables), yield
    it (None when the job gets none), stop it at exit (blocks up to 5 s)."""
    s = settings.current()
    if not cfg.servers or cfg.nnodes > 1 or cfg.master_addr or s.ps_manager:
        yield None
        return
    try:
        secret = bytes.fromhex(env.get(settings.SECRET) or s.secret or "")
    except ValueError:  # NOTE: no wire can work: ps.serve and ps.attach say so, naming the fix
        yield None
        return
    state = os.path.join(log_dir, "ps-manager.json")
    with contextlib.suppress(FileNotFoundError):
        os.remove(state)  # NOTE: a new job (a reused --log-dir): its own ring, from version 0
    running = start(state, host=s.ps_host, timeout=s.ps_timeout, secret=secret)
    env[settings.PS_MANAGER] = running.address
    try:
        yield running
    finally:
        running.stop()
