"""Tensor parallel over 2 real processes, each layer against its unsharded original."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import disttrain
from disttrain.mesh import Mesh
from disttrain.models import GPT
from disttrain.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    apply_tp,
    vocab_parallel_cross_entropy,
)
from disttrain.testing import spawn
from tests.dist import _gpt_ref as ref

close = torch.testing.assert_close


def _shard(t, dim, group):
    return t.chunk(dist.get_world_size(group), dim=dim)[dist.get_rank(group)]


def check_mlp(group):
    """fc colwise -> gelu -> proj rowwise == two nn.Linear: output, grads, params after steps."""
    torch.manual_seed(0)
    fc, proj = nn.Linear(8, 16), nn.Linear(16, 8)
    col, row = ColumnParallelLinear.from_linear(fc, group), RowParallelLinear.from_linear(proj, group)
    opt_ref = torch.optim.SGD([*fc.parameters(), *proj.parameters()], lr=0.1)
    opt_tp = torch.optim.SGD([*col.parameters(), *row.parameters()], lr=0.1)
    for step in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        x_ref, x_tp = x.clone().requires_grad_(), x.clone().requires_grad_()
        y_ref, y_tp = proj(F.gelu(fc(x_ref))), row(F.gelu(col(x_tp)))
        close(y_tp, y_ref)
        opt_ref.zero_grad(), opt_tp.zero_grad()
        (y_ref ** 2).sum().backward()
        (y_tp ** 2).sum().backward()
        close(x_tp.grad, x_ref.grad)  # f's allreduce in backward
        close(col.weight.grad, _shard(fc.weight.grad, 0, group))
        close(col.bias.grad, _shard(fc.bias.grad, 0, group))
        close(row.weight.grad, _shard(proj.weight.grad, 1, group))
        close(row.bias.grad, proj.bias.grad)
        opt_ref.step(), opt_tp.step()
    close(col.weight, _shard(fc.weight, 0, group))
    close(row.weight, _shard(proj.weight, 1, group))


def check_gathered_and_scattered(group):
    torch.manual_seed(1)
    lin = nn.Linear(6, 4)
    x = torch.randn(3, 6, requires_grad=True)
    xt = x.detach().clone().requires_grad_()
    col = ColumnParallelLinear.from_linear(lin, group, gather_output=True)
    close(col(xt), lin(x))
    row = RowParallelLinear.from_linear(lin, group, input_is_parallel=False)
    yr, yt = lin(x), row(xt)
    close(yt, yr)
    yr.sum().backward(), yt.sum().backward()
    close(xt.grad, x.grad)


def check_vocab_embedding_and_loss(group):
    torch.manual_seed(2)
    emb = nn.Embedding(10, 4)
    vemb = VocabParallelEmbedding.from_embedding(emb, group)
    ids = torch.tensor([[0, 9, 4, 5], [7, 1, 1, 3]])
    out_ref, out_tp = emb(ids), vemb(ids)
    close(out_tp, out_ref)
    out_ref.pow(2).sum().backward(), out_tp.pow(2).sum().backward()
    close(vemb.weight.grad, _shard(emb.weight.grad, 0, group))
    logits = torch.randn(2, 5, 10) * 3  # (B, T, V)
    target = torch.randint(10, (2, 5))
    full = logits.clone().requires_grad_()
    local = _shard(logits, -1, group).clone().requires_grad_()
    loss_ref = F.cross_entropy(full.reshape(-1, 10), target.reshape(-1))
    loss_tp = vocab_parallel_cross_entropy(local, target, group)
    close(loss_tp, loss_ref)
    loss_ref.backward(), loss_tp.backward()
    close(local.grad, _shard(full.grad, -1, group))


def check_gpt(mesh):
    expected = ref.reference()
    # the TP GPT block alone: heads split over ranks, output and input grad match
    block_ref = ref.make_model().blocks["0"]
    block_tp = apply_tp(ref.make_model(), mesh, GPT.tp_plan).blocks["0"]
    assert block_tp.attn.qkv.weight.shape[0] == 3 * 16 // 2
    h = torch.randn(2, 8, 16)
    h_ref, h_tp = h.clone().requires_grad_(), h.clone().requires_grad_()
    out_ref, out_tp = block_ref(h_ref), block_tp(h_tp)
    close(out_tp, out_ref)
    out_ref.sum().backward(), out_tp.sum().backward()
    close(h_tp.grad, h_ref.grad)
    # the whole GPT: loss, gradients, parameters after steps
    out = ref.run_parallel(mesh)
    if disttrain.rank() == 0:
        ref.assert_matches_reference(out, expected)


def check_plan_errors(group):
    model = ref.make_model()
    with pytest.raises(ValueError, match="plan key 'attn.qvk' matches no module"):
        apply_tp(model, None, {"attn.qvk": "colwise"})
    with pytest.raises(ValueError, match="styles are colwise, rowwise, vocab"):
        apply_tp(model, None, {"attn.qkv": "diagonal"})
    with pytest.raises(TypeError, match="'blocks.0.ln1' is colwise, but it is a LayerNorm"):
        apply_tp(model, None, {"blocks.0.ln1": "colwise"})
    with pytest.raises(ValueError, match=r"out_features \(3\) is not divisible.*\(2\)"):
        ColumnParallelLinear.from_linear(nn.Linear(4, 3), group)


def tp_checks():
    # one process pair for every check: starting ranks costs more than the checks
    mesh = Mesh(tp=2)
    group = mesh.group("tp")
    check_mlp(group)
    check_gathered_and_scattered(group)
    check_vocab_embedding_and_loss(group)
    check_gpt(mesh)
    check_plan_errors(group)
    return True


@pytest.mark.timeout(90)
def test_tp_layers_block_and_gpt_match_unsharded():
    """Column/row linear (MLP), gathered/scattered variants, vocab embedding and loss,
    the TP GPT block, the whole TP GPT over steps, and plan errors."""
    assert spawn(tp_checks, 2, timeout=80) == [True, True]
