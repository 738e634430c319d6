"""Staleness-aware updates: how a parameter server steps gradients computed on old parameters.

A policy that applies stale gradients (Async, KAsync, KBatchAsync, SSP) carries an
`UpdateRule`; the server builds a `StaleStep` over its optimizer and steps through it.

- step="inverse-staleness" (Zhang, Gupta, Lian, Liu 2016, "Staleness-aware Async-SGD for
  distributed deep learning", IJCAI): a gradient of staleness tau (server version at
  apply time minus the version it was computed on) gets learning rate lr / tau; a fresh
  one (tau = 0) keeps lr, hence lr / max(1, tau).
- momentum="corrected" (Mitliagkas, Zhang, Hadjis, Re 2016, "Asynchrony begets momentum,
  with an application to deep learning"): under the paper's queueing model, M
  asynchronous workers make the staleness geometric with mean M - 1 and add an implicit
  momentum 1 - 1/M; the total momentum is about the explicit plus the implicit one. The
  server measures the mean staleness s of the gradients it applied, takes M = s + 1, so
  implicit = s / (s + 1), and steps with explicit momentum max(0, user's momentum -
  implicit): the total stays at the user's value.

What is done to the user's optimizer, exactly (docs/design/parameter-server.md,
"Staleness-aware updates"):
- torch.optim.SGD: each gradient is multiplied by its scale before averaging. SGD is
  linear in the gradient, so that gradient's whole contribution (through the momentum
  buffer, with dampening or Nesterov) is made with lr / tau, which is what a per-gradient
  learning rate means; scaling the group's lr instead would also shrink the steps the
  buffer still owes to earlier, fresher gradients. Weight decay (SGD adds it to the
  gradient from the current parameters, which are not stale) is not scaled.
- any other optimizer with an `lr` in every param group (Adam, AdamW, RMSprop...): Adam
  divides by the gradient's own scale, so scaling the gradient would do nothing; instead
  the step's lr is multiplied by the mean scale of the update and restored afterwards:
  the stale gradient still enters the moment estimates at full weight, only the step
  taken now is shorter.
- momentum="corrected" sets every param group's `momentum` for the step and restores it;
  an optimizer without one (Adam's betas are not what the analysis covers) is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from disttrain.ps.runs import RunStep, eligible, mean

__all__ = ["UpdateRule", "StaleStep", "STEPS", "MOMENTA", "implicit_momentum",
           "mean_staleness", "divergence_warning"]

STEPS = ("constant", "inverse-staleness")
MOMENTA = ("as-given", "corrected")


@dataclass(frozen=True)
class UpdateRule:
    """How a server steps stale gradients (an option of the asynchronous policies)."""

    step: str = "constant"
    """"constant": every gradient at the optimizer's lr; "inverse-staleness": lr / max(1, tau)."""
    momentum: str = "as-given"
    """"as-given": the optimizer's momentum; "corrected": minus the implicit momentum of
    asynchrony, s / (s + 1) for a measured mean staleness s."""

    def __post_init__(self) -> None:
        if self.step not in STEPS:
            raise ValueError(f"step={self.step!r}: use one of {', '.join(map(repr, STEPS))}")
        if self.momentum not in MOMENTA:
            raise ValueError(f"momentum={self.momentum!r}: use one of "
                             f"{', '.join(map(repr, MOMENTA))}")

    def scale(self, staleness: int) -> float:
        """The factor on the learning rate of one gradient of this staleness."""
        return 1.0 / max(1, staleness) if self.step == "inverse-staleness" else 1.0


def implicit_momentum(staleness: float) -> float:
    """Mitliagkas et al. 2016: M = staleness + 1 asynchronous workers add 1 - 1/M."""
    return max(0.0, staleness) / (max(0.0, staleness) + 1.0)


def mean_staleness(histogram: dict) -> float:
    """Mean of a {staleness: count} histogram (keys may be strings, as in a trace); 0 if empty."""
    n = sum(int(c) for c in histogram.values())
    return sum(int(k) * int(c) for k, c in histogram.items()) / n if n else 0.0


class StaleStep:
    """Steps one server's optimizer under an `UpdateRule`; never blocks.

    With `runs` (the default) an optimizer that `runs.eligible` accepts steps adjacent
    keys as one tensor (runs.py: bitwise the same, far fewer torch calls); `runs=False`
    steps key by key (a benchmark's baseline)."""

    def __init__(self, optimizer: torch.optim.Optimizer | None, rule: UpdateRule,
                 runs: bool = True):
        self.optimizer, self.rule = optimizer, rule
        self.runs = RunStep(optimizer) if runs and eligible(optimizer) else None
        self.scale_grads = isinstance(optimizer, torch.optim.SGD)
        groups = optimizer.param_groups if optimizer is not None else []
        name = type(optimizer).__name__
        if rule.step != "constant" and any("lr" not in g for g in groups):
            raise ValueError(f"step={rule.step!r} scales the learning rate, but {name} has no "
                             "'lr' in its param groups; use step='constant'")
        if rule.momentum == "corrected" and any("momentum" not in g for g in groups):
            raise ValueError(
                f"momentum='corrected' lowers an SGD-style 'momentum' (Mitliagkas et al. 2016), "
                f"which {name} does not have; use torch.optim.SGD(..., momentum=m) or "
                "momentum='as-given'")
        # the first param group's momentum as the user built it: reported, warned about
        self.user_momentum = float(groups[0].get("momentum", 0.0)) if groups else 0.0
        self.last_momentum = self.user_momentum

    def combine(self, grads: list[torch.Tensor], staleness: list[int],
                dtype: torch.dtype) -> torch.Tensor:
        """The gradient to step with: the mean of `grads`, each scaled by its staleness
        when the optimizer is SGD (else scaled in `step`). One unscaled gradient is
        returned as it is (no copy)."""
        return mean(grads, self._scales(staleness), dtype)

    def _scales(self, staleness: list[int]) -> list[float]:
        return [self.rule.scale(s) if self.scale_grads else 1.0 for s in staleness]

    def apply(self, params: list[torch.nn.Parameter], grads: list[list[torch.Tensor]],
              staleness: list[int], measured: Callable[[], float], keep: bool = False
              ) -> tuple[list | None, tuple]:
        """One update of `params` (keys): `combine` each key's gradients (`grads`: one
        list per push, a gradient per key, pushes of these staleness values), then `step`.
        Returns (with `keep`, the gradient stepped per key, else None; what `step`
        returned): what a replica needs to take the same step."""
        if self.runs is not None:
            stepped = self.runs.load(params, grads, self._scales(staleness), keep)
        else:
            stepped = []
            for i, p in enumerate(params):
                p.grad = self.combine([g[i] for g in grads], staleness, p.dtype)
                stepped.append(p.grad)
        return stepped if keep else None, self.step(staleness, measured)

    def step(self, staleness: list[int], measured: Callable[[], float]) -> tuple:
        """optimizer.step() for gradients of these staleness values, with the lr and
        momentum the rule asks for (restored afterwards); then zero_grad. `measured()`
        gives the mean staleness so far (asked only by momentum="corrected"). Returns
        (lr factor, implicit momentum or None): what `replay` needs to take the same step."""
        lr_factor = 1.0
        if not self.scale_grads:
            lr_factor = sum(self.rule.scale(s) for s in staleness) / len(staleness)
        implicit = implicit_momentum(measured()) if self.rule.momentum == "corrected" else None
        self.replay(lr_factor, implicit)
        return lr_factor, implicit

    def replay(self, lr_factor: float, implicit: float | None) -> None:
        """optimizer.step() with lr x `lr_factor` and momentum lowered by `implicit` (None:
        as built), then zero_grad: a replica's copy of a step `step` took (replica.py)."""
        with _hyper(self.optimizer, lr_factor, implicit):
            if self.runs is not None:
                self.runs.step()  # NOTE: clears what it stepped
            else:
                self.optimizer.step()
        if self.runs is None:
            self.optimizer.zero_grad(set_to_none=True)
        if implicit is not None:
            self.last_momentum = max(0.0, self.user_momentum - implicit)

    def stats(self, policy_stats: dict) -> dict:
        """The rule and momenta for the server's report (plain types), and "warning" when
        `policy_stats` (with its staleness histogram) is in the diverging range."""
        out = {"step_rule": self.rule.step, "momentum_rule": self.rule.momentum,
               "momentum": self.user_momentum, "applied_momentum": self.last_momentum}
        warning = divergence_warning({**policy_stats, **out})
        return dict(out, warning=warning) if warning else out


@contextmanager
def _hyper(optimizer: torch.optim.Optimizer, lr_factor: float, implicit: float | None):
    """Inside the block every param group's lr is multiplied by `lr_factor` and its
    momentum lowered by `implicit` (not below 0; None: kept); the user's values are put
    back after, even on an error."""
    saved = [(g.get("lr"), g.get("momentum")) for g in optimizer.param_groups]
    try:
        for g, (lr, m) in zip(optimizer.param_groups, saved):
            if lr_factor != 1.0:
                g["lr"] = lr * lr_factor
            if implicit is not None:
                g["momentum"] = max(0.0, m - implicit)
        yield
    finally:
        for g, (lr, m) in zip(optimizer.param_groups, saved):
            if lr is not None:
                g["lr"] = lr
            if m is not None:
                g["momentum"] = m


def divergence_warning(stats: dict) -> str | None:
    """A sentence when a server stepped stale gradients at full learning rate with a
    momentum that, with the implicit momentum of its measured staleness, reaches 1; else
    None. `stats`: a server's report (Server.stats() or the trace's "ps server stats").

    The threshold is Mitliagkas et al. 2016's model: the total momentum is about explicit
    + implicit, implicit = s / (s + 1) for mean staleness s, and at a total momentum of 1
    or more the momentum recursion no longer decays (heavy-ball SGD converges only below
    1). So a momentum mu is in that range once mu >= 1 / (s + 1). It is the model's edge,
    not a measured one: a small enough learning rate may still train there. Not flagged: Sync and
    the K-sync modes (staleness 0), momentum="corrected" (the total is kept below 1) and
    step="inverse-staleness" (Zhang et al. 2016: the lr / tau rule that their analysis
    shows converges under staleness; measured in docs/benchmarks.md).
    """
    mu = float(stats.get("momentum") or 0.0)
    hist = stats.get("staleness") or {}
    if (stats.get("momentum_rule", "as-given") != "as-given" or mu <= 0 or not hist
            or stats.get("step_rule", "constant") != "constant"):
        return None
    s = mean_staleness(hist)
    implicit = implicit_momentum(s)
    if mu + implicit < 1.0:
        return None
    return (f"momentum {mu:g} with mean staleness {s:.1f} under {stats.get('policy', '?')} "
            f"at full learning rate: asynchrony adds an implicit momentum of about s/(s+1) = "
            f"{implicit:.2f} (Mitliagkas et al. 2016), a total of {mu + implicit:.2f} >= 1, "
            f"where momentum SGD does not converge in that model; use step='inverse-staleness' "
            f"(the default of Async, KAsync, KBatchAsync and SSP), momentum='corrected', or "
            f"a momentum below {1.0 - implicit:.2f}")
