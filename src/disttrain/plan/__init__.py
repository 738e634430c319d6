"""`disttrain plan`: what a strategy costs before running it, computed from data alone.

One module per plan, each registering its own `disttrain plan <name>` subcommand:
`memory` (ZeRO model-state formulas), `layout` (the layout cost model), `profile`
(per-layer times measured here, for `layout --profile`), `ps` (the parameter-server
simulator). Pure Python over data: nothing here starts a
process group or imports torch.distributed (`profile` imports torch when it runs).
"""

from __future__ import annotations

from disttrain.plan.layout import add_layout_parser
from disttrain.plan.memory import (
    OPTIMIZERS,
    PRECISIONS,
    MemoryPlan,
    add_memory_parser,
    bytes_per_param,
    model_state_bytes,
    plan_table,
)
from disttrain.plan.profile import add_profile_parser

__all__ = ["PRECISIONS", "OPTIMIZERS", "MemoryPlan", "bytes_per_param", "model_state_bytes",
           "plan_table", "add_plan_parser"]



def add_ps_parser(sub) -> None:
    """Register `disttrain plan ps`.

    NOTE: imported here, not at the top: the simulator drives ps/policy.py's objects,
    whose package imports torch, and `import disttrain.plan.layout` stays torch-free.
    """
    from disttrain.plan.ps_cli import add_ps_parser as add

    add(sub)


PLANS = (add_memory_parser, add_layout_parser, add_profile_parser, add_ps_parser)
"""Each plan's `add_<name>_parser(sub)`, in the order `disttrain plan --help` lists them."""


def add_plan_parser(subparsers) -> None:
    """Register `disttrain plan` and every plan's subcommand on the CLI's subparsers."""
    plan = subparsers.add_parser("plan", help="estimate what a strategy costs before running it")
    sub = plan.add_subparsers(title="plans", metavar="PLAN")
    for add in PLANS:
        add(sub)
    plan.set_defaults(handler=lambda args: (plan.print_help(), 2)[1])
