"""Pipeline schedules as pure action lists: formulas checked by a timing simulation."""

from fractions import Fraction

import pytest
import torch

from disttrain.parallel.pipeline.schedules import (
    Action,
    check_schedule,
    gpipe,
    interleaved_1f1b,
    make_schedule,
    one_f_one_b,
    peak_in_flight,
    simulate,
)


def test_gpipe_idle_is_3_of_11_for_p4_m8():
    sim = simulate(gpipe(4, 8), 4)
    assert sim.makespan == 22  # (m + p - 1) * (t_f + t_b)
    assert Fraction(sim.bubble_fraction).limit_denominator(100) == Fraction(3, 11)


@pytest.mark.parametrize("p,m", [(4, 8), (2, 5), (3, 3), (4, 2)])
def test_one_f_one_b_peak_activations_per_stage(p, m):
    sched = one_f_one_b(p, m)
    for i, acts in enumerate(sched):
        assert peak_in_flight(acts) <= p - i
        assert peak_in_flight(acts) == min(p - i, m)
    assert peak_in_flight(gpipe(p, m)[0]) == m  # GPipe holds all of them


def test_one_f_one_b_has_gpipe_bubble():
    sim = simulate(one_f_one_b(4, 8), 4)
    assert sim.bubble_fraction == pytest.approx(3 / 11)


def test_one_f_one_b_stage_lists_by_hand():
    sched = one_f_one_b(3, 4)
    assert [str(a) for a in sched[0]] == ["F0", "F1", "F2", "B0", "F3", "B1", "B2", "B3"]
    assert [str(a) for a in sched[2]] == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]


@pytest.mark.parametrize("p,m,v", [(4, 8, 2), (2, 4, 2), (4, 4, 2), (2, 6, 3)])
def test_interleaved_bubble_is_p_minus_1_over_vm_of_ideal(p, m, v):
    sched = interleaved_1f1b(p, m, v)
    check_schedule(sched, p, m, v)
    sim = simulate(sched, p, num_virtual=v)
    ideal = m * 2.0  # m micro-batches of (t_f + t_b) on each stage
    assert (sim.makespan - ideal) / ideal == pytest.approx((p - 1) / (v * m))
    gpipe_bubble = simulate(gpipe(p, m), p).makespan - ideal
    assert sim.makespan - ideal == pytest.approx(gpipe_bubble / v)


def test_interleaved_chunks_visit_every_virtual_stage():
    sched = interleaved_1f1b(2, 4, 2)
    assert [str(a) for a in sched[0][:4]] == ["F0", "F1", "F0.1", "F1.1"]


def test_too_few_microbatches_for_interleaved_is_rejected():
    with pytest.raises(ValueError, match=r"num_microbatches \(6\) must be a multiple of num_stages \(4\)"):
        interleaved_1f1b(4, 6, 2)


def test_unmatched_send_recv_is_rejected_before_running():
    sched = gpipe(2, 2)
    sched[1] = [Action("F", 1), Action("F", 0), Action("B", 0), Action("B", 1)]
    check_schedule(sched, 2, 2)  # a different order is fine
    sched[0] = [Action("F", 0), Action("B", 1), Action("F", 1), Action("B", 0)]
    with pytest.raises(ValueError, match="stage 0 runs B1 of chunk 0 before its F"):
        check_schedule(sched, 2, 2)
    # stage 0 waits for B0 (needs stage 1's B0) before sending F1; stage 1 wants F1 first
    sched[0] = [Action("F", 0), Action("B", 0), Action("F", 1), Action("B", 1)]
    with pytest.raises(ValueError, match="deadlocks.*stage 0 at B0.*stage 1 at F1"):
        check_schedule(sched, 2, 2)


def test_missing_action_and_bad_names():
    sched = gpipe(2, 2)
    sched[1] = sched[1][:-1]
    with pytest.raises(ValueError, match=r"stage 1 must run F and B.*missing \[\('B', 1, 0\)\]"):
        check_schedule(sched, 2, 2)
    with pytest.raises(ValueError, match="unknown schedule 'zb'"):
        make_schedule("zb", 2, 2)
    with pytest.raises(ValueError, match="num_microbatches must be an integer >= 1"):
        gpipe(2, 0)
    with pytest.raises(ValueError, match="needs num_virtual >= 2"):
        make_schedule("interleaved", 2, 4)


def test_split_balances_by_cost_and_keeps_names():

    from disttrain.models import GPT, GPTConfig
    from disttrain.parallel.pipeline.split import partition, split_model, time_layers

    assert partition([1, 1, 1, 1, 4], 2) == [(0, 4), (4, 5)]
    costs = [2, 3, 1, 1, 2, 2, 1]
    parts = partition(costs, 3)
    assert [a for a, _ in parts] == [0, parts[0][1], parts[1][1]] and parts[-1][1] == 7
    assert max(sum(costs[a:b]) for a, b in parts) == 5  # optimum: (2+3 | 1+1+2 | 2+1)
    with pytest.raises(ValueError, match="cannot cut 2 layers into 3"):
        partition([1, 1], 3)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=16, block_size=4, n_layer=2, n_head=2, n_embd=8))
    x = torch.randint(16, (2, 4))
    costs = time_layers(model, x)
    assert len(costs) == 4 and all(c > 0 for c in costs)
    first, second = split_model(model, 2, 0)[0], split_model(model, 2, 1)[0]
    names = [n for n, _ in first.named_parameters()] + [n for n, _ in second.named_parameters()]
    assert names == [n for n, _ in model.named_parameters()]  # whole-model names, no copies
    torch.testing.assert_close(second(first(x)), model(x))


# ZB-H1 (schedules.py, split_backward.py): backward split into B (input grad) and W (weight grads).

@pytest.mark.parametrize("p,m", [(4, 8), (2, 4), (3, 5), (4, 2), (1, 3)])
def test_zb_h1_runs_each_f_b_w_once_in_dependency_order(p, m):
    from disttrain.parallel.pipeline.schedules import zero_bubble_h1

    sched = make_schedule("zb-h1", p, m)
    assert sched == zero_bubble_h1(p, m)
    for acts in sched:
        seen = [(a.kind, a.microbatch) for a in acts]
        assert sorted(seen) == sorted((k, i) for k in "FBW" for i in range(m))
        for i in range(m):
            assert seen.index(("F", i)) < seen.index(("B", i)) < seen.index(("W", i))
        # F/B order is 1F1B's: only W is added
        assert [a for a in acts if a.kind != "W"] == one_f_one_b(p, m)[sched.index(acts)]


@pytest.mark.parametrize("p,m", [(4, 8), (2, 5), (3, 3), (4, 16)])
def test_zb_h1_keeps_1f1b_memory_bound(p, m):
    from disttrain.parallel.pipeline.schedules import peak_pending_w, peak_until_w

    for i, acts in enumerate(make_schedule("zb-h1", p, m)):
        assert peak_in_flight(acts) == min(p - i, m)  # F..B: as 1F1B
        assert peak_pending_w(acts) <= i + 1  # B..W: stage i defers i W
        assert peak_until_w(acts) <= p  # F..W: 1F1B's peak (stage 0 holds p)


@pytest.mark.parametrize("p,m", [(4, 8), (2, 4), (3, 5), (4, 16)])
def test_zb_h1_bubble_is_a_third_of_1f1b_with_equal_f_b_w(p, m):
    zb = simulate(make_schedule("zb-h1", p, m), p, t_f=1, t_b=1, t_w=1)
    ofob = simulate(one_f_one_b(p, m), p, t_f=1, t_b=2)  # B there is B + W
    idle = [p * s.makespan - s.busy for s in (zb, ofob)]
    assert idle[0] == pytest.approx(p * (p - 1) * 1.0)  # (p-1)(F+B-W) per stage
    assert idle[1] == pytest.approx(p * (p - 1) * 3.0)  # (p-1)(F+B+W) per stage
    assert zb.makespan == m * 3 + (p - 1)


def test_zb_h1_static_check_rejects_w_before_b_and_missing_w():
    sched = make_schedule("zb-h1", 2, 2)
    bad = [list(s) for s in sched]
    bad[1] = [Action(k, i) for k, i in (("F", 0), ("W", 0), ("B", 0), ("F", 1), ("B", 1),
                                         ("W", 1))]
    with pytest.raises(ValueError, match="stage 1 runs W0 of chunk 0 before its B"):
        check_schedule(bad, 2, 2)
    bad[1] = [a for a in sched[1] if str(a) != "W1"]
    with pytest.raises(ValueError, match=r"stage 1 must run F, B and W.*missing \[\('W', 1, 0\)\]"):
        check_schedule(bad, 2, 2)
    with pytest.raises(ValueError, match="num_virtual must be 1"):
        make_schedule("zb-h1", 2, 4, num_virtual=2)


def test_zb_h1_runtime_refuses_recompute():
    from torch import nn

    from disttrain.parallel.pipeline.runtime import Pipeline
    from disttrain.parallel.recompute import Recompute

    chunk = nn.Sequential(Recompute(nn.Linear(2, 2)))
    with pytest.raises(ValueError, match="recompute=False or schedule='1f1b'"):
        Pipeline([chunk], make_schedule("zb-h1", 1, 2)[0], 0, 1, 2, lambda o, y: o.sum())


class _Shared(torch.nn.Module):
    """A weight used twice (two nodes of x's path feed it), a bias-only branch, a
    parameter off x's path (added to the output), and one unused."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        self.c = torch.nn.Parameter(torch.randn(4))
        self.unused = torch.nn.Linear(4, 4)

    def forward(self, x):  # (B, 4)
        h = torch.tanh(self.a(x))
        return self.b(self.a(h) * h) + self.c


@pytest.mark.parametrize("make", [_Shared, lambda: torch.nn.Sequential(
    torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.LayerNorm(8), torch.nn.Linear(8, 4))])
def test_split_backward_b_then_w_equals_one_backward(make):
    from disttrain.parallel.pipeline.split_backward import backward_input, backward_weight

    torch.manual_seed(0)
    model, x0, g = make(), torch.randn(3, 4), torch.randn(3, 4)
    params = list(model.parameters())
    x = x0.clone().requires_grad_()
    model(x).backward(g)
    want = [p.grad.clone() if p.grad is not None else None for p in params] + [x.grad]
    model.zero_grad(set_to_none=True)
    x = x0.clone().requires_grad_()
    out = model(x)
    gx, plan = backward_input(out, x, g, params)
    assert plan is not None and all(p.grad is None for p in params)  # B touches no weight
    backward_weight(out, g, params, plan)
    got = [p.grad for p in params] + [gx]
    for w, h in zip(want, got):
        assert (w is None) == (h is None)
        if w is not None:
            torch.testing.assert_close(h, w)
