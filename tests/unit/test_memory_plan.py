"""The ZeRO memory formulas, the `disttrain plan memory` CLI and byte measurement."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import disttrain
from disttrain import cli, memory, plan


@pytest.mark.timeout(10)
def test_paper_figure_1_example():
    # Rajbhandari et al. 2019, Figure 1: Psi = 7.5B, N_d = 64, Adam, mixed precision (K = 12)
    totals = [plan.model_state_bytes(7.5e9, 64, s, "adam", "mixed").total / 1e9 for s in range(4)]
    assert totals == pytest.approx([120, 31.4, 16.6, 1.9], abs=0.05)
    s2 = plan.model_state_bytes(7.5e9, 64, 2, "adam", "mixed")
    assert (s2.params, s2.grads, s2.optimizer) == pytest.approx((15e9, 2 * 7.5e9 / 64, 12 * 7.5e9 / 64))


@pytest.mark.timeout(10)
def test_fp32_variant_and_other_optimizers():
    psi, n = 1000.0, 4
    adam = [plan.model_state_bytes(psi, n, s, "adamw", "fp32") for s in range(4)]
    assert [m.total for m in adam] == [16 * psi, 8 * psi + 8 * psi / n, 4 * psi + 12 * psi / n,
                                       16 * psi / n]
    assert plan.bytes_per_param("momentum", "fp32") == (4, 4, 4)
    assert plan.bytes_per_param("sgd", "fp32") == (4, 4, 0)
    assert plan.bytes_per_param("momentum", "mixed") == (2, 2, 8)  # fp32 master + momentum
    # with N = 1 sharding changes nothing
    assert {plan.model_state_bytes(psi, 1, s).total for s in range(4)} == {16 * psi}


@pytest.mark.timeout(10)
@pytest.mark.parametrize("kwargs, message", [
    ({"dp": 0}, "dp must be a positive integer"),
    ({"params": -1}, "params must be > 0"),
    ({"stage": 4}, "stage must be 0, 1, 2 or 3"),
    ({"optimizer": "lamb"}, "optimizer must be one of"),
    ({"precision": "fp8"}, "precision must be one of"),
])
def test_bad_inputs_say_what_is_wrong(kwargs, message):
    args = {"params": 1e6, "dp": 8, "stage": 1, **kwargs}
    with pytest.raises(ValueError, match=message):
        plan.model_state_bytes(**args)


@pytest.mark.timeout(10)
def test_cli_prints_the_figure_1_table(capsys):
    argv = ["plan", "memory", "--params", "7.5e9", "--dp", "64", "--optimizer", "adam",
            "--precision", "mixed"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0] + (line.split()[1] if line.startswith("stage") else ""): line
            for line in out.splitlines()[2:]}
    assert rows["baseline"].rstrip().endswith("120 GB")
    assert rows["stage1"].rstrip().endswith("31.4 GB")
    assert rows["stage2"].rstrip().endswith("16.6 GB")
    assert rows["stage3"].rstrip().endswith("1.88 GB")
    assert cli.main(["plan", "memory", "--params", "1e9", "--dp", "0"]) == 2
    assert "dp must be a positive integer" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["plan", "memory", "--params", "lots", "--dp", "8"])
    assert "is not a number" in capsys.readouterr().err


@pytest.mark.timeout(10)
def test_measurement_counts_each_storage_once():
    flat = torch.zeros(100)
    views = [flat[:10], flat[10:60], flat[60:]]
    assert memory.storage_bytes(views + [flat, None]) == 400
    assert memory.storage_bytes([torch.zeros(3), torch.zeros(3)]) == 24
    freed = torch.zeros(5)
    freed.untyped_storage().resize_(0)
    assert memory.storage_bytes([freed]) == 0


@pytest.mark.timeout(10)
def test_plain_module_with_adam_holds_16_psi_fp32():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 8))
    opt = torch.optim.Adam(model.parameters())
    psi = sum(p.numel() for p in model.parameters())
    assert memory.model_state(model, opt) == memory.ModelState(4 * psi, 0, 0, None)
    model(torch.randn(2, 32)).sum().backward()
    opt.step()
    ms = memory.model_state(model, opt)
    assert (ms.params, ms.grads) == (4 * psi, 4 * psi)
    assert ms.optimizer == 8 * psi + 4 * 4  # exp_avg, exp_avg_sq + a 4-byte step per tensor
    assert ms.total == pytest.approx(plan.model_state_bytes(psi, 1, 0, "adam", "fp32").total,
                                     rel=0.01)
    assert str(ms).startswith(f"params {4 * psi / 1024:.2f} KiB, grads")


@pytest.mark.timeout(10)
def test_zero_rejects_bad_arguments_before_communicating():
    net = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="stage must be 0, 1, 2 or 3"):
        disttrain.Zero(net, lambda ps: torch.optim.SGD(ps, lr=0.1), stage=4)
    with pytest.raises(TypeError, match="function params -> optimizer"):
        disttrain.Zero(net, torch.optim.SGD(net.parameters(), lr=0.1), stage=1)
    with pytest.raises(TypeError, match="wraps an nn.Module"):
        disttrain.Zero("net", lambda ps: torch.optim.SGD(ps, lr=0.1), stage=1)
