"""Staleness-aware updates (ps/staleness.py), driven through a real Server in one process.

The main test pushes gradients that are every one exactly 8 versions old into a server
(no workers, no other process: `Server._push` with the messages a worker would send) on a
small quadratic: the old rule (full learning rate, momentum 0.9 as given) diverges, the
default (lr / staleness, Zhang et al. 2016) and the corrected momentum (Mitliagkas et al.
2016) solve it. The rest checks exactly what is done to the user's optimizer.
"""

import math

import pytest
import torch

from disttrain import ps
from disttrain.ps.connect import format_stats
from disttrain.ps.frame import Message
from disttrain.ps.placement import plan_keys
from disttrain.ps.policy import KAsync
from disttrain.ps.schema import check
from disttrain.ps.server import Server
from disttrain.ps.staleness import StaleStep, UpdateRule, divergence_warning
from disttrain.trace import analysis

SECRET = bytes(32)
STALENESS = 8
STEPS = 300
# f(w) = 1/2 sum_i h_i (w_i - 1)^2 with curvatures h in [0.2, 0.6] and lr 0.1: lr * h in
# [0.02, 0.06], where momentum-0.9 SGD converges without delay but not 8 versions late
CURVATURE = torch.linspace(0.2, 0.6, 16)


def _loss(w: torch.Tensor) -> float:
    return 0.5 * float((CURVATURE * (w - 1) ** 2).sum())


def _stale_server_run(policy, opt=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)):
    """Final loss and stats of a server fed STEPS gradients, each STALENESS versions old."""
    init = {"w": torch.zeros(16)}
    plan = plan_keys([("w", 16, 4)], 1)
    server = Server(0, plan[0], init, policy, opt, [0], SECRET)
    try:
        (chunk,) = server.chunks
        server.policy.version = STALENESS  # NOTE: so that the very first gradient is 8 old too
        history = [init["w"].clone()] * (STALENESS + 1)  # parameters at version v
        for clock in range(STEPS):
            version = server.policy.version - STALENESS
            grad = CURVATURE * (history[version] - 1)  # computed on version `version`
            push = Message("push", {"worker": 0, "clock": clock, "version": version}, [chunk.key], [grad])
            check(push, "server")  # NOTE: as the receive point does: fills the defaults
            assert server._push(0, push)
            history.append(server.params[chunk.key].detach().clone())
            assert len(history) == server.policy.version + 1
        return _loss(history[-1]), server.stats()
    finally:
        server.close()


def test_gradients_8_versions_old_diverge_with_the_old_rule_and_converge_by_default():
    start = _loss(torch.zeros(16))
    old, old_stats = _stale_server_run(ps.Async(step="constant", momentum="as-given"))
    assert old_stats["staleness"] == {STALENESS: STEPS}
    assert not math.isfinite(old) or old > 1e3 * start  # the old rule diverges
    assert "momentum 0.9 with mean staleness 8.0" in old_stats["warning"]
    assert "below 0.11" in old_stats["warning"]  # 1 - 8/9
    new, new_stats = _stale_server_run(ps.Async())  # the default: lr / staleness
    assert new_stats["staleness"] == {STALENESS: STEPS}
    assert new < 1e-4 * start, (new, start)
    assert "warning" not in new_stats
    corrected, stats = _stale_server_run(ps.Async(step="constant", momentum="corrected"))
    assert corrected < 1e-4 * start, (corrected, start)
    assert stats["applied_momentum"] == pytest.approx(0.9 - 8 / 9) and "warning" not in stats
    assert "momentum 0.9 stepped as 0.011 (corrected" in format_stats(stats)
    assert format_stats(old_stats).splitlines()[1].startswith("[ps server0] WARNING: momentum 0.9")
    assert ps.Async(step="constant").rule == UpdateRule("constant", "as-given")


def test_sgd_gets_each_gradient_scaled_and_its_settings_back():
    """SGD: the gradient is divided by its staleness (so is its share of the momentum
    buffer), the buffer's earlier gradients are not; lr and momentum are restored."""
    torch.manual_seed(0)
    p, ref = torch.nn.Parameter(torch.randn(5)), torch.nn.Parameter(torch.zeros(5))
    ref.data.copy_(p.data)
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9, weight_decay=0.01)
    ref_opt = torch.optim.SGD([ref], lr=0.1, momentum=0.9, weight_decay=0.01)
    step = StaleStep(opt, UpdateRule("inverse-staleness", "as-given"))
    grads = [(torch.randn(5), 0), (torch.randn(5), 4), (torch.randn(5), 2)]
    for g, s in grads:
        p.grad = step.combine([g], [s], p.dtype)
        step.step([s], measured=lambda: 3.0)
        ref.grad = g / max(1, s)
        ref_opt.step()
    torch.testing.assert_close(p, ref)
    assert opt.param_groups[0]["lr"] == 0.1 and opt.param_groups[0]["momentum"] == 0.9
    # two gradients of one update: each scaled by its own staleness, then averaged
    g1, g2 = torch.ones(5), torch.full((5,), 3.0)
    torch.testing.assert_close(step.combine([g1, g2], [2, 3], torch.float32), (g1 / 2 + g2 / 3) / 2)


def test_adam_gets_the_steps_lr_scaled_and_restored():
    """Adam ignores a gradient's scale, so the step's lr is divided instead."""
    torch.manual_seed(0)
    p, ref = torch.nn.Parameter(torch.randn(5)), torch.nn.Parameter(torch.zeros(5))
    ref.data.copy_(p.data)
    opt, ref_opt = torch.optim.Adam([p], lr=0.1), torch.optim.Adam([ref], lr=0.1)
    step = StaleStep(opt, UpdateRule("inverse-staleness", "as-given"))
    for s in (0, 4, 2):
        g = torch.randn(5)
        p.grad = step.combine([g], [s], p.dtype)
        step.step([s], measured=lambda: 2.0)
        ref.grad = g
        ref_opt.param_groups[0]["lr"] = 0.1 / max(1, s)
        ref_opt.step()
    torch.testing.assert_close(p, ref)
    assert opt.param_groups[0]["lr"] == 0.1


def test_corrected_momentum_is_refused_where_there_is_no_sgd_momentum():
    with pytest.raises(ValueError, match="Adam does not have.*momentum='as-given'"):
        StaleStep(torch.optim.Adam([torch.nn.Parameter(torch.ones(2))]), UpdateRule(momentum="corrected"))
    plan = plan_keys([("w", 2, 4)], 1)
    with pytest.raises(ValueError, match="momentum='corrected'"):  # refused when the server starts
        Server(0, plan[0], {"w": torch.ones(2)}, ps.Async(momentum="corrected"),
               lambda p: torch.optim.Adam(p), [0], SECRET)
    with pytest.raises(ValueError, match="step='fast'.*'inverse-staleness'"):
        ps.Async(step="fast")
    with pytest.raises(ValueError, match="momentum='none'.*'corrected'"):
        ps.SSP(2, momentum="none")


def test_policies_report_the_staleness_of_what_they_apply():
    p = KAsync(2)
    p.start([0, 1, 2])
    assert p.push(0, 0, 0).apply == []
    d = p.push(1, 1, 0)
    assert d.apply == [0, 1] and d.staleness == [0, 0] and p.version == 1
    p.push(2, 2, 0)
    d = p.push(3, 0, 1)
    assert d.apply == [3, 2] and d.staleness == [0, 1]  # worker order: 0's push, then 2's
    assert repr(ps.Async()) == "Async()" and repr(ps.KAsync(2)) == "KAsync(k=2)"
    assert repr(ps.SSP(2, step="constant")) == "SSP(s=2, step='constant')"


@pytest.mark.parametrize("mu,hist,rules,warns", [
    (0.9, {0: 5, 1: 5}, ("constant", "as-given"), True),  # s = 0.5: 0.9 + 1/3 >= 1
    (0.6, {0: 5, 1: 5}, ("constant", "as-given"), False),  # 0.6 + 1/3 < 1
    (0.9, {0: 10}, ("constant", "as-given"), False),  # not stale: Sync, KSync
    (0.9, {8: 10}, ("inverse-staleness", "as-given"), False),
    (0.9, {8: 10}, ("constant", "corrected"), False),
    (0.0, {8: 10}, ("constant", "as-given"), False),
])
def test_divergence_warning_threshold(mu, hist, rules, warns):
    stats = {"policy": "Async()", "momentum": mu, "staleness": hist,
             "step_rule": rules[0], "momentum_rule": rules[1]}
    assert (divergence_warning(stats) is not None) == warns


def test_disttrain_report_repeats_a_servers_warning():
    """`disttrain report` reads the servers' final stats from the trace and repeats the
    warning a server put in them (analysis.py does not recompute it)."""
    warned = {"staleness": {"8": 3}, "policy": "Async(step='constant')", "warning": "momentum 0.9 ..."}
    quiet = {"staleness": {"0": 3}, "policy": "Async()"}
    events = [{"name": "ps server stats", "pid": pid, "ph": "i", "args": args}
              for pid, args in ((2, quiet), (3, warned))]
    line = analysis._staleness(events)
    assert line.endswith("; WARNING (1 of 2 servers; the first): momentum 0.9 ..."), line
    assert "WARNING" not in analysis._staleness(events[:1])
