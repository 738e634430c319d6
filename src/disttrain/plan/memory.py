"""Plan memory: per-rank model-state bytes of data parallelism and ZeRO stages 1-3.

The formulas of Rajbhandari et al. 2019 (arXiv 1910.02054), sec. 5 and Figure 1, with
Psi parameters, N data-parallel ranks, and p, g, K bytes per parameter of parameter,
gradient and optimizer state: baseline (p + g + K) Psi, stage 1 (p + g) Psi + K Psi / N,
stage 2 p Psi + (g + K) Psi / N, stage 3 (p + g + K) Psi / N. Mixed precision is
p = g = 2, Adam K = 12 (fp32 master, momentum, variance); fp32 (Zero's default) is
p = g = 4, Adam K = 8, SGD momentum 4. `--params 7.5e9 --dp 64 --optimizer adam
--precision mixed` gives the paper's 120, 31.4, 16.6 and 1.9 GB (docs/design/zero.md,
"Memory, measured").

Who talks to whom: `disttrain plan memory` (cli.py, through `disttrain.plan`'s
`add_plan_parser`) calls this module's handler; tests compare `model_state_bytes` with
what `disttrain.memory` measures.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

__all__ = ["PRECISIONS", "OPTIMIZERS", "MemoryPlan", "model_state_bytes", "plan_table",
           "add_memory_parser"]

PRECISIONS = {"mixed": (2, 2), "fp32": (4, 4)}
"""precision -> (parameter bytes, gradient bytes) per parameter."""

OPTIMIZERS = {"adam": 8, "adamw": 8, "momentum": 4, "sgd": 0}
"""optimizer -> state bytes per parameter in fp32 (without the mixed-precision master)."""

STAGE_NAMES = ("baseline", "stage 1", "stage 2", "stage 3")


@dataclass(frozen=True)
class MemoryPlan:
    """Per-rank model-state bytes for one stage (fields are bytes; floats, Psi may be 7.5e9)."""

    stage: int
    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


def bytes_per_param(optimizer: str, precision: str) -> tuple[int, int, int]:
    """(p, g, K): parameter, gradient and optimizer-state bytes per parameter."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {precision!r}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZERS)}, got {optimizer!r}")
    p, g = PRECISIONS[precision]
    k = OPTIMIZERS[optimizer] + (4 if precision != "fp32" else 0)  # fp32 master copy
    return p, g, k


def model_state_bytes(params: float, dp: int, stage: int, optimizer: str = "adam",
                      precision: str = "mixed") -> MemoryPlan:
    """Per-rank model-state bytes of ZeRO `stage` (0 = plain data parallelism)."""
    if not params > 0:
        raise ValueError(f"params must be > 0 (a count like 7.5e9), got {params!r}")
    if int(dp) != dp or dp < 1:
        raise ValueError(f"dp must be a positive integer (data-parallel ranks), got {dp!r}")
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
    p, g, k = bytes_per_param(optimizer, precision)
    n = dp
    shard = (1 / n, 1 / n, 1 / n)
    full = (1.0, 1.0, 1.0)
    factors = {0: full, 1: (1.0, 1.0, 1 / n), 2: (1.0, 1 / n, 1 / n), 3: shard}[stage]
    return MemoryPlan(stage, p * params * factors[0], g * params * factors[1],
                      k * params * factors[2])


def plan_table(params: float, dp: int, optimizer: str = "adam", precision: str = "mixed") -> str:
    """The estimator's printed table: one line per stage, in GB (1e9 bytes)."""
    p, g, k = bytes_per_param(optimizer, precision)
    lines = [f"model states per rank: {params:.4g} params, dp={dp}, {optimizer}, {precision} "
             f"(p={p}, g={g}, K={k} bytes/param)",
             f"{'':10}{'params':>12}{'grads':>12}{'optimizer':>12}{'total':>12}"]
    for stage in range(4):
        m = model_state_bytes(params, dp, stage, optimizer, precision)
        cells = "".join(f"{v / 1e9:>9.3g} GB" for v in (m.params, m.grads, m.optimizer, m.total))
        lines.append(f"{STAGE_NAMES[stage]:10}{cells}")
    return "\n".join(lines)


def _parse_count(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number (e.g. 7.5e9)") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def add_memory_parser(sub) -> None:
    """Register `disttrain plan memory` on the `plan` command's subparsers."""
    mem = sub.add_parser(
        "memory", help="per-rank model-state memory of DP and ZeRO stages 1-3",
        description="Per-rank model-state memory (ZeRO paper, Figure 1).",
        epilog="example: disttrain plan memory --params 7.5e9 --dp 64 --optimizer adam "
               "--precision mixed   (120, 31.4, 16.6, 1.88 GB)")
    mem.add_argument("--params", type=_parse_count, required=True, help="parameter count, e.g. 7.5e9")
    mem.add_argument("--dp", type=int, required=True, help="data-parallel ranks N")
    mem.add_argument("--optimizer", default="adam", choices=sorted(OPTIMIZERS),
                     help="adam/adamw (K=8 fp32), momentum (SGD, K=4), sgd (K=0); default adam")
    mem.add_argument("--precision", default="mixed", choices=sorted(PRECISIONS),
                     help="mixed: fp16 params+grads, fp32 master (+4 to K); fp32; default mixed")
    mem.set_defaults(handler=_plan_memory)


def _plan_memory(args: argparse.Namespace) -> int:
    try:
        print(plan_table(args.params, args.dp, args.optimizer, args.precision))
    except ValueError as err:
        print(f"disttrain plan memory: error: {err}", file=sys.stderr)
        return 2
    return 0
