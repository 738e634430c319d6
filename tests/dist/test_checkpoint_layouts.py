"""Checkpoints across model-parallel layouts: tp 2 -> 1, pp 2 -> 1, tp 2 -> pp 2, pp 2 -> dp 2,
tp 1 -> 2.

Two gloo ranks train the tiny GPT at tp=2 (SGD with momentum and weight decay) and at
pp=2 (AdamW), save with `Checkpointer`, then take one more step and write the full
parameters (`ParallelModel.full_state_dict`). The tp=2 checkpoint also loads into a
GPT sharded by `apply_tp` alone (bitwise the saver's shards and momenta), into a pp=2
mesh, the pp=2 one into a dp=2 mesh, and a single-process checkpoint (optimizer saved
by position with its parameter names) into tp=2; a step there gives the next params. This process then loads each checkpoint into a
plain, differently initialised GPT and optimizer (world 1): parameters and optimizer
state must equal the single-process reference trained the same steps, and one more step
must give the parallel run's parameters. `disttrain checkpoint convert` consolidates the
tp=2 checkpoint offline into one file that loads to the same bits.
"""

import json
import os
import warnings

import pytest
import safetensors.torch
import torch
import torch.nn.functional as F

import disttrain
from disttrain.checkpoint import Checkpointer, CheckpointMismatchError, CheckpointWarning, cli
from disttrain.mesh import Mesh
from disttrain.models import GPT
from disttrain.parallel.parallelize import parallelize
from disttrain.parallel.tensor import apply_tp
from disttrain.testing import spawn
from tests.dist import _gpt_ref as ref

STEPS = 2
OPTS = {
    "tp": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, weight_decay=0.01)),
    "pp": (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1)),
}
# (checkpoint folder, optimizer, layout loading it); "plain" is saved by this process
CROSS = (("tp", "tp", "pp"), ("pp", "pp", "dp"), ("plain", "tp", "tp"))
LAYOUTS = {"tp": (dict(tp=2), {}), "pp": (dict(pp=2), dict(microbatches=1)), "dp": (dict(dp=2), {})}


def _model(seed=None):
    """The tiny GPT with one frozen parameter (it gets no optimizer state)."""
    model = ref.make_model()
    if seed is not None:
        torch.manual_seed(seed)  # not the training seed: the load must supply every value
        model = GPT(model.cfg)
    model.head.ln_f.bias.requires_grad_(False)
    return model


def _build(tag, mesh_tag=None):
    shape, kw = LAYOUTS[mesh_tag or tag]
    pm = parallelize(_model(), Mesh(**shape),
                     plan=GPT.tp_plan if "tp" in shape else None, **kw)
    cls, hp = OPTS[tag]
    return pm, cls(pm.parameters(), **hp)


def _step(pm, opt, x, y):
    opt.zero_grad()
    pm.train_step(x, y)
    opt.step()


def train_save_step(root):
    """Each layout: STEPS steps, save, one more step; rank 0 writes the full params."""
    warnings.simplefilter("error", CheckpointWarning)  # e.g. TP slices saved as replicated
    x, y = ref.make_batch()
    for tag in ("tp", "pp"):
        pm, opt = _build(tag)
        for _ in range(STEPS):
            _step(pm, opt, x, y)
        Checkpointer(os.path.join(root, tag)).save(STEPS, model=pm, optimizer=opt)
        if tag == "tp":
            _same_layout_into_apply_tp(root, pm, opt)
        _step(pm, opt, x, y)
        full = pm.full_state_dict()
        if disttrain.rank() == 0:
            safetensors.torch.save_file(full, os.path.join(root, f"{tag}_next.safetensors"))
    # tp=2's checkpoint at pp=2, pp=2's at dp=2: one more step gives the saver's next params
    for folder, tag, mesh_tag in CROSS:
        pm, opt = _build(tag, mesh_tag=mesh_tag)
        ckpt = Checkpointer(os.path.join(root, folder))
        assert ckpt.load(model=pm, optimizer=opt, rng=False) == STEPS
        _step(pm, opt, *(t.chunk(2)[disttrain.rank()] for t in (x, y)) if mesh_tag == "dp"
              else (x, y))
        full = pm.full_state_dict()
        if disttrain.rank() == 0:
            safetensors.torch.save_file(full, os.path.join(root, f"{folder}_via_{mesh_tag}.safetensors"))
    return True


def _same_layout_into_apply_tp(root, pm, opt):
    """The tp=2 checkpoint into a plain GPT sharded by apply_tp (no ParallelModel)."""
    model = apply_tp(_model(), pm.mesh, GPT.tp_plan)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    fresh = torch.optim.SGD(model.parameters(), **OPTS["tp"][1])
    Checkpointer(os.path.join(root, "tp")).load(model=model, optimizer=fresh, rng=False)
    mine = dict(pm.local_modules()[0].named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p, mine[name]), name
        assert fresh.state[p].keys() == opt.state[mine[name]].keys(), name
        if fresh.state[p]:
            assert torch.equal(fresh.state[p]["momentum_buffer"],
                               opt.state[mine[name]]["momentum_buffer"]), name


def _reference(tag):
    """Single-process GPT trained STEPS steps: (model, optimizer)."""
    model = _model()
    cls, hp = OPTS[tag]
    opt = cls(model.parameters(), **hp)
    x, y = ref.make_batch()
    for _ in range(STEPS):
        _plain_step(model, opt, x, y)
    return model, opt


def _plain_step(model, opt, x, y):
    opt.zero_grad()
    logits = model(x)
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
    opt.step()


def _fresh(tag):
    model = _model(seed=1234)
    cls, hp = OPTS[tag]
    return model, cls(model.parameters(), **{**hp, "lr": 0.5})


def _close(a, b, what, atol, rtol=1e-4):
    torch.testing.assert_close(a, b, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


def _check_loaded(tag, folder, atol):
    """Load into world 1; compare with the reference; return the loaded pair."""
    model, opt = _fresh(tag)
    assert Checkpointer(folder).load(model=model, optimizer=opt, rng=False) == STEPS
    ref_model, ref_opt = _reference(tag)
    assert opt.param_groups[0]["lr"] == OPTS[tag][1]["lr"]
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        _close(p, q, f"{tag} param {name}", atol)
        st, ref_st = opt.state[p], ref_opt.state[q]
        assert st.keys() == ref_st.keys() and bool(st) == (name != "head.ln_f.bias"), name
        for key in st:
            _close(st[key], ref_st[key], f"{tag} optimizer {name}.{key}", atol)
    return model, opt


@pytest.mark.timeout(90)
def test_tp_and_pp_checkpoints_load_into_one_process_and_other_layouts(tmp_path):
    x, y = ref.make_batch()
    plain, plain_opt = _reference("tp")  # tp 1 -> 2: saved here, loaded at tp=2 by the ranks
    Checkpointer(str(tmp_path / "plain")).save(STEPS, model=plain, optimizer=plain_opt)
    assert spawn(train_save_step, 2, str(tmp_path), timeout=80) == [True, True]
    for tag, atol in (("tp", 2e-5), ("pp", 1e-6)):
        model, opt = _check_loaded(tag, str(tmp_path / tag), atol)
        _plain_step(model, opt, x, y)
        nxt = safetensors.torch.load_file(str(tmp_path / f"{tag}_next.safetensors"))
        assert nxt.keys() == dict(model.named_parameters()).keys()
        for name, p in model.named_parameters():
            _close(p.detach(), nxt[name], f"{tag} after one more step: {name}", atol)
    for folder, tag, mesh_tag in CROSS:
        via = safetensors.torch.load_file(str(tmp_path / f"{folder}_via_{mesh_tag}.safetensors"))
        nxt = safetensors.torch.load_file(str(tmp_path / f"{tag}_next.safetensors"))
        assert via.keys() == nxt.keys()
        for name, t in nxt.items():
            _close(via[name], t, f"{tag} checkpoint stepped at {mesh_tag}=2: {name}", 2e-5)

    # offline: consolidate the tp=2 checkpoint into one file (world-1 layout)
    out = tmp_path / "consolidated"
    assert cli.main(["convert", str(tmp_path / "tp"), "--to", str(out)]) == 0
    folder = out / f"step_{STEPS:08d}"
    manifest = json.loads((folder / "manifest.json").read_text())
    assert sorted(os.listdir(folder)) == ["manifest.json", "rank00000.safetensors"]
    qkv = manifest["tensors"]["model/blocks.0.attn.qkv.weight"]
    assert qkv["global_shape"] == [48, 16] and len(qkv["pieces"]) == 1
    a, a_opt = _fresh("tp")
    b, b_opt = _fresh("tp")
    Checkpointer(str(tmp_path / "tp")).load(model=a, optimizer=a_opt, rng=False)
    Checkpointer(str(out)).load(model=b, optimizer=b_opt, rng=False)
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name
        for key, v in a_opt.state[p].items():
            assert torch.equal(v, b_opt.state[q][key]), name
    # an optimizer saved by parameter name cannot be placed without the model
    with pytest.raises(CheckpointMismatchError, match="pass model= too"):
        Checkpointer(str(tmp_path / "tp")).load(optimizer=a_opt, rng=False)
