"""Sequence parallelism (Megatron-LM, Korthikanti et al. 2022) against the single-process GPT.

`parallelize(..., sequence_parallel=True)` splits the activations outside the tp layers
(LayerNorms, residual adds) along the sequence over the tp group. Checked: tp=2 with SP
equals the unsharded reference (losses, first-step gradients, parameters after steps)
and tp=2 without SP; with recompute too; pp=2 x tp=2 and dp=2 x tp=2 with SP on 4
ranks, and dp=2 x tp=2 under ZeRO stage 2; the bytes the LayerNorms (and the column-parallel layers' inputs) save for
backward drop by exactly tp; per layer the forward issues 2 all-gathers and 2
reduce-scatters instead of 2 allreduces (counted with torch.profiler); a sequence that
does not divide by tp and a plan without a scatter point are refused with a fix.
"""

import collections

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

import disttrain
from disttrain.mesh import Mesh
from disttrain.models import GPT, GPTConfig
from disttrain.parallel.parallelize import parallelize
from disttrain.parallel.tensor import apply_tp, vocab_parallel_cross_entropy
from disttrain.testing import spawn
from tests.dist import _gpt_ref as ref

_NAMES = {"c10d::allreduce_": "allreduce", "c10d::_allgather_base_": "allgather",
          "c10d::_reduce_scatter_base_": "reduce_scatter"}


def _counts(fn):
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = fn()
    c = collections.Counter(_NAMES[e.name] for e in prof.events() if e.name in _NAMES)
    return c, out


def per_layer_collectives(mesh, sp: bool) -> tuple[dict, dict]:
    """Collectives of one transformer layer (depth 2 minus depth 1), forward and backward."""
    got = {}
    for depth in (1, 2):
        torch.manual_seed(0)
        model = apply_tp(GPT(GPTConfig(**{**ref.CFG, "n_layer": depth})), mesh, GPT.tp_plan,
                         sequence_parallel=sp)
        x, y = ref.make_batch(2)
        fwd, loss = _counts(lambda m=model, x=x, y=y: vocab_parallel_cross_entropy(
            m(x), y, mesh.group("tp")))
        bwd, _ = _counts(loss.backward)
        got[depth] = (fwd, bwd)
    return tuple(dict(got[2][i] - got[1][i]) for i in (0, 1))


def saved_bytes(mesh, sp: bool) -> dict[str, int]:
    """Bytes one block saves for backward: in its LayerNorms, its column-parallel
    layers (their inputs) and in all, weights excluded."""
    torch.manual_seed(0)
    block = apply_tp(ref.make_model(), mesh, GPT.tp_plan, sequence_parallel=sp).blocks["0"]
    b, t, c = 8, ref.CFG["block_size"], ref.CFG["n_embd"]
    x = torch.randn(b, t // 2 if sp else t, c, requires_grad=True)  # tp=2: a sequence shard
    where, out = [None], collections.Counter()
    for name in ("ln1", "ln2", "attn.qkv", "mlp.fc"):
        mod = block.get_submodule(name)
        kind = "layernorm" if name.startswith("ln") else "colwise"
        mod.register_forward_pre_hook(lambda *_, k=kind: where.__setitem__(0, k))
        mod.register_forward_hook(lambda *_: where.__setitem__(0, None))

    def pack(t):
        if not (isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)):
            n = t.numel() * t.element_size()
            out["layer"] += n
            if where[0]:
                out[where[0]] += n
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x)
    return dict(out)


def tp2():
    expected = ref.reference() if disttrain.rank() == 0 else None
    mesh = Mesh(tp=2)
    runs = {}
    for sp, recompute in ((True, False), (False, False), (True, True)):
        out = ref.run_parallel(mesh, sequence_parallel=sp, recompute=recompute)
        if disttrain.rank() == 0:
            ref.assert_matches_reference(out, expected)
            runs[(sp, recompute)] = out
    if disttrain.rank() == 0:  # with and without SP: the same training, up to rounding
        with_sp, without = runs[(True, False)], runs[(False, False)]
        assert with_sp[0] == pytest.approx(without[0], rel=1e-5)
        for name, p in without[2].items():
            torch.testing.assert_close(with_sp[2][name], p, atol=1e-5, rtol=1e-5)
        ln = with_sp[3].local_modules()[0].blocks["0"].ln1.weight
        assert getattr(ln, "sequence_parallel", False)
    counts = {sp: per_layer_collectives(mesh, sp) for sp in (False, True)}
    memory = {sp: saved_bytes(mesh, sp) for sp in (False, True)}
    model = apply_tp(ref.make_model(), mesh, GPT.tp_plan, sequence_parallel=True)
    with pytest.raises(ValueError, match="not a multiple of 2.*multiple of 2"):
        model(torch.zeros(2, 7, dtype=torch.long))  # every rank raises at the same point
    plan = {k: v for k, v in GPT.tp_plan.items() if v != "sequence_scatter"}
    with pytest.raises(ValueError, match="sequence_scatter"):
        apply_tp(ref.make_model(), mesh, plan, sequence_parallel=True)
    with pytest.raises(ValueError, match="zero=1 or 2"):
        parallelize(ref.make_model(), mesh, GPT.tp_plan, zero=3, sequence_parallel=True,
                    optimizer_factory=lambda ps: torch.optim.SGD(ps, lr=ref.LR))
    return counts, memory


def zero2_dp2_tp2():
    """dp=2 x tp=2 with ZeRO stage 2: its reduce-scatter reads the tp-summed LN grads."""
    mesh = Mesh(dp=2, tp=2)
    x, y = (t.chunk(2)[mesh.local_rank("dp")] for t in ref.make_batch(8))
    pm = parallelize(ref.make_model(), mesh, GPT.tp_plan, zero=2, sequence_parallel=True,
                     microbatches=2, optimizer_factory=lambda ps: torch.optim.SGD(ps, lr=ref.LR))
    losses, grads0 = [], None
    for s in range(ref.STEPS):
        pm.optimizer.zero_grad()
        losses.append(pm.train_step(x, y).item())
        grads0 = pm.full_state_dict(grads=True) if s == 0 else grads0
        losses.append(pm.clip_grad_norm_(ref.MAX_NORM).item())
        pm.optimizer.step()
    params = pm.full_state_dict()
    return (losses, grads0, params) if disttrain.rank() == 0 else None


def hybrid():
    expected = ref.reference() if disttrain.rank() == 0 else None
    for shape, kw in ((dict(pp=2, tp=2), dict(schedule="1f1b", microbatches=4)),
                      (dict(dp=2, tp=2), dict(schedule="1f1b", microbatches=2))):
        out = ref.run_parallel(Mesh(**shape), sequence_parallel=True, **kw)
        if disttrain.rank() == 0:
            ref.assert_matches_reference(out, expected)
    out = zero2_dp2_tp2()
    if disttrain.rank() == 0:
        ref.assert_matches_reference(out, expected)
    return True


@pytest.mark.timeout(90)
def test_sequence_parallel_tp2_matches_reference_saves_memory_and_counts_collectives():
    counts, memory = spawn(tp2, 2, timeout=80)[0]
    fwd, bwd = counts[False]
    assert fwd == {"allreduce": 2} and bwd == {"allreduce": 2}  # Megatron's f and g
    fwd, bwd = counts[True]
    assert fwd == {"allgather": 2, "reduce_scatter": 2}
    # backward: qkv and fc gather their shard again (2) and reduce-scatter their input
    # gradient (2), the row layers' gradients are all-gathered (2); 6 small allreduces sum
    # the sequence-parallel parameters' gradients (ln1, ln2 weight and bias, 2 row biases)
    assert bwd == {"allgather": 4, "reduce_scatter": 2, "allreduce": 6}
    plain, sp = memory[False], memory[True]
    assert plain["layernorm"] / sp["layernorm"] == pytest.approx(2.0)  # exactly tp
    assert plain["colwise"] / sp["colwise"] == pytest.approx(2.0)
    assert plain["layer"] / sp["layer"] > 1.15, memory  # attention and MLP interiors unchanged


@pytest.mark.timeout(90)
def test_sequence_parallel_pp2_x_tp2_and_dp2_x_tp2_and_zero2_match_reference():
    assert spawn(hybrid, 4, timeout=80) == [True] * 4
