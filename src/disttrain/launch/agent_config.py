"""The torch elastic `LaunchConfig` that `disttrain run` hands to `elastic_launch`.

Built as torchrun would build it, from a `RunConfig` (job.py); the fields newer torch
added are passed only where the installed torch has them (pyproject allows torch >= 2.3).
"""

from __future__ import annotations

import os
import uuid
from dataclasses import fields

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
from torch.distributed.launcher.api import LaunchConfig

from disttrain.launch import rendezvous
from disttrain.launch.failures import PREFIX_TEMPLATE
from disttrain.launch.preemption import AGENT_SIGNALS

__all__ = ["launch_config"]


def launch_config(cfg, log_dir: str) -> LaunchConfig:
    """The torch elastic LaunchConfig for `cfg` (job.py's RunConfig), as torchrun would build it."""
    n = cfg.nproc_per_node
    if cfg.nnodes == 1 and cfg.master_addr is None:
        backend, endpoint, run_id, rdzv_configs = "c10d", "localhost:0", uuid.uuid4().hex, {}
    else:  # NOTE: c10d (rendezvous.py); node 0 hosts the store: no guess from host names
        rendezvous.register()
        backend, endpoint = rendezvous.BACKEND, f"{cfg.master_addr or '127.0.0.1'}:{cfg.master_port}"
        run_id, rdzv_configs = cfg.rdzv_id, {"is_host": cfg.node_rank == 0, "watch": cfg.max_restarts > 0}
    # Local rank 0 of node 0 (global rank 0 when node 0 sorts first) keeps the terminal.
    first_teed = 1 if cfg.node_rank == 0 else 0
    tee = {local: Std.ALL for local in range(first_teed, n)}
    return LaunchConfig(
        min_nodes=cfg.nnodes,
        max_nodes=cfg.nnodes,
        nproc_per_node=n,
        run_id=run_id,
        role="default",
        rdzv_endpoint=endpoint,
        rdzv_backend=backend,
        rdzv_configs=rdzv_configs,
        max_restarts=cfg.max_restarts,
        monitor_interval=0.1,
        logs_specs=DefaultLogsSpecs(log_dir=log_dir, tee=tee),
        log_line_prefix_template=PREFIX_TEMPLATE,
        local_addr=cfg.local_addr or (cfg.master_addr if cfg.node_rank == 0 else None),
        **_newer_fields(),
    )


def _newer_fields() -> dict:
    """LaunchConfig's fields that older torch lacks, where it has them (2.11 has no shutdown_timeout).

    NOTE: the agent of recent torch also reads TORCHELASTIC_SIGNALS_TO_HANDLE (set here
    too): SIGTERM stays preemption.py's. A torch with neither is not checked.
    """
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = AGENT_SIGNALS
    have = {f.name for f in fields(LaunchConfig)}
    extra = {"shutdown_timeout": int(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", 10)),
             "signals_to_handle": AGENT_SIGNALS}
    return {k: v for k, v in extra.items() if k in have}
