"""`disttrain plan ps`: the simulator against Dutta et al. 2018's closed forms, links,
apply time, staleness, the recommendation and the command's bad input."""

import pytest

from disttrain.cli import main
from disttrain.comm.cost import Links
from disttrain.plan.ps import Mode, closed_form, parse_mode, recommend
from disttrain.plan.simulate import Compute, Network, simulate
from disttrain.ps.straggler import parse_straggler

EXP = Compute(parse_straggler("exp:mean=1"))  # mu = 1


def _run(mode: Mode, workers: int, compute: Compute = EXP, **kw):
    return simulate(lambda: mode.build(workers), workers, compute, **kw)


# (mode, P, updates): updates chosen so the standard error is about 0.5 %, 2 % is 4 of them
@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode, workers, updates", [
    ("sync", 2, 16_000), ("sync", 8, 6_000),
    ("ksync:2", 4, 12_000), ("ksync:3", 8, 12_000),
    ("kbatch-sync:3", 2, 9_000), ("kbatch-sync:3", 4, 9_000),
    ("async", 2, 25_000), ("async", 8, 25_000),
    ("backup:2", 8, 5_000), ("kbatch-async:2", 4, 12_000),
])
def test_time_per_update_matches_dutta_closed_forms(mode, workers, updates):
    m = parse_mode(mode)
    expected, formula = closed_form(m, workers, EXP, None, 0.0)
    r = _run(m, workers, updates=updates, seed=1)
    assert r.stderr < 0.007, (mode, r.stderr)  # NOTE: 2 % is then >= 3 standard errors
    assert r.time_per_update == pytest.approx(expected, rel=0.02), (formula, r.time_per_update)


@pytest.mark.timeout(60)
def test_synchronous_modes_apply_fresh_gradients_and_async_staleness_is_p_minus_1():
    for mode in ("sync", "ksync:2", "kbatch-sync:3", "backup:1"):
        assert set(_run(parse_mode(mode), 4, updates=2_000).staleness) == {0}, mode
    # Mitliagkas et al. 2016's queueing model: P exponential workers, mean staleness P - 1
    r = _run(parse_mode("async"), 6, updates=20_000)
    assert r.mean_staleness == pytest.approx(5, rel=0.03)


@pytest.mark.timeout(60)
def test_kasync_as_the_servers_run_it_lies_between_the_bounds():
    # a worker whose pushed gradient was already stale is answered at once (policy.py), so
    # K-async(2) of 4 is faster than the paper's learner-waits form (H_4 - H_2), slower
    # than every worker always busy (2/4)
    r = _run(parse_mode("kasync:2"), 4, updates=12_000)
    assert 0.5 * 1.03 < r.time_per_update < (1 / 4 + 1 / 3) * 0.97


@pytest.mark.timeout(60)
def test_ssp_bound_sits_between_lockstep_and_async():
    ssp0 = _run(parse_mode("ssp:0"), 4, updates=4_000)
    assert max(ssp0.staleness) <= 3  # one clock of drift: at most the other P - 1 pushes
    loose = _run(parse_mode("ssp:1000"), 4, updates=20_000)
    free = _run(parse_mode("async"), 4, updates=20_000)
    assert loose.time_per_update == pytest.approx(free.time_per_update, rel=0.02)
    assert free.time_per_update < ssp0.time_per_update


@pytest.mark.timeout(30)
def test_links_serialise_messages_at_the_server():
    # fixed 1 s steps, 1 MB per push and pull over 1 Gbit/s (8 ms), no alpha: the server's
    # downlink takes the P pushes one after the other, its uplink the P pulls: a Sync round
    # is 1 s + (P + 1) x 8 ms
    net = Network(Links(alpha=0.0, link_Bps=1e9 / 8), 1e6)
    steps = Compute(parse_straggler("none"), base=1.0)
    r = _run(parse_mode("sync"), 4, steps, network=net, updates=50)
    assert r.time_per_update == pytest.approx(1 + 5 * 0.008, rel=1e-9)
    # two servers halve each server's bytes; each worker's own link still carries a whole
    # push and a whole pull per round
    r = _run(parse_mode("sync"), 4, steps, servers=2, network=net, updates=50)
    assert 1 + 2 * 0.008 <= r.time_per_update < 1 + 5 * 0.008
    # Async on a link slower than the compute: one push per update, the link's pace
    fast = Compute(parse_straggler("none"), base=0.01)
    r = _run(parse_mode("async"), 4, fast, network=Network(Links(alpha=0.0, link_Bps=1e8), 4e6),
             updates=200)
    assert r.time_per_update == pytest.approx(0.04, rel=1e-6)


@pytest.mark.timeout(30)
def test_apply_time_holds_the_server():
    steps = Compute(parse_straggler("none"), base=1.0)
    r = _run(parse_mode("sync"), 4, steps, apply_s=0.25, updates=50)
    assert r.time_per_update == pytest.approx(1.25, rel=1e-9)
    # Async: one message at a time, so a pull waits behind the pushes queued before it;
    # with equal steps the workers move as a convoy: P updates per 1 s + P x 0.5 s
    for workers in (4, 8):
        r = _run(parse_mode("async"), workers, steps, apply_s=0.5, updates=96)  # 12+ periods
        assert r.time_per_update == pytest.approx((1 + workers * 0.5) / workers, rel=1e-6)


@pytest.mark.timeout(60)
def test_recommendation_follows_stragglers_and_link():
    needs = {parse_mode("sync"): 300, parse_mode("kbatch-sync:3"): 420}
    steady = Compute(parse_straggler("none"), base=0.05)
    ranked, words = recommend(needs, 4, steady, updates=1_000)
    assert ranked[0].mode.name == "sync" and words.startswith("with no stragglers")
    heavy = Compute(parse_straggler("exp:mean=0.05"), base=0.0)
    ranked, words = recommend(needs, 4, heavy, updates=4_000)
    assert ranked[0].mode.name == "kbatch-sync"
    assert "exp stragglers of mean 50 ms, K-batch-sync(K=3) reaches the target" in words
    assert "sooner than Sync" in words
    # Async needs 6x Sync's updates: with stragglers and free communication it still wins
    # (P H_P = 8.3x fewer seconds per update); on a slow link the server's link paces both
    # and Sync's round costs only (P + 1) pushes' time, so Sync wins
    needs = {parse_mode("sync"): 100, parse_mode("async"): 600}
    ranked, _ = recommend(needs, 4, heavy, updates=4_000)
    assert ranked[0].mode.name == "async"
    slow = Network(Links(alpha=100e-6, link_Bps=100e6 / 8), 4e6)
    ranked, words = recommend(needs, 4, heavy, network=slow, updates=2_000)
    assert ranked[0].mode.name == "sync" and "0.1 Gbit/s links" in words


@pytest.mark.timeout(60)
def test_cli_prints_time_staleness_and_the_closed_form(capsys):
    rc = main(["plan", "ps", "--workers", "4", "--mode", "ksync", "--k", "2",
               "--compute", "exp:mean=1", "--updates", "4000", "--explain"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "mean time per update: 0.5" in out and "updates/s: 1." in out
    assert "staleness" in out and "100.0%" in out
    assert "(H_P - H_(P-K))/mu = (H_4 - H_2) x 1 s = 0.583333 s" in out
    rc = main(["plan", "ps", "--workers", "4", "--compute", "exp:mean=0.05", "--updates",
               "1000", "--updates-to-target", "sync=96,kbatch:2=80"])
    out = capsys.readouterr().out
    assert rc == 0 and "K-batch-sync(K=2) reaches the target" in out


@pytest.mark.timeout(30)
@pytest.mark.parametrize("argv, match", [
    (["--mode", "foo"], "unknown mode 'foo'"),
    (["--mode", "ksync"], "needs --k K"),
    (["--mode", "ksync", "--k", "5"], "use k <= 4"),
    (["--mode", "sync", "--k", "2"], "takes no --k"),
    (["--mode", "ssp", "--s", "-1"], "integer >= 0"),
    (["--mode", "sync", "--compute", "gauss:mean=1"], "unknown model 'gauss'"),
    (["--mode", "sync", "--compute", "none"], "every step takes 0 s"),
    (["--mode", "sync", "--bytes", "1e6"], "need --link RATE"),
    (["--mode", "sync", "--link", "fast"], "is not a rate"),
    (["--updates-to-target", "sync=many"], "is not MODE=N"),
])
def test_bad_input_exits_2_with_a_message(argv, match, capsys):
    base = ["plan", "ps", "--workers", "4", "--compute", "exp:mean=1", "--updates", "100"]
    assert main(base + argv) == 2
    assert match in capsys.readouterr().err


def test_the_simulator_modules_import_no_torch_and_no_sockets():
    import ast
    from pathlib import Path

    import disttrain.plan

    folder = Path(disttrain.plan.__file__).parent
    for name in ("simulate.py", "ps.py", "ps_cli.py", "cpu.py"):
        tree = ast.parse((folder / name).read_text())
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert not {m for m in imported if m.split(".")[0] in ("torch", "zmq")}, (name, imported)


def test_straggler_sampler_is_seeded_per_worker_with_the_delay_distribution():
    s = parse_straggler("shifted-exp:shift=0.02,mean=0.05", seed=3)
    a, b = s.sampler(0), s.sampler(0)
    draws = [a() for _ in range(20_000)]
    assert draws[:50] == [b() for _ in range(50)]  # same seed and rank, same stream
    other = s.sampler(1)
    assert draws[:50] != [other() for _ in range(50)]
    assert min(draws) >= 0.02 and sum(draws) / len(draws) == pytest.approx(0.07, rel=0.02)


@pytest.mark.timeout(30)
def test_shared_cores_slow_compute_that_overlaps():
    # 3 workers' 1 s steps at once on 2 cores (processor sharing): each runs at 2/3, a
    # Sync round is 1.5 s; beside 2 other runnable processes at 2/5 where the 1 s was
    # measured at 2/3 (one process beside them): 1 s x (2/3) / (2/5) = 5/3 s
    def sync_round(**cores):
        steps = Compute(parse_straggler("none"), base=1.0, **cores)
        return _run(parse_mode("sync"), 3, steps, updates=50).time_per_update

    assert sync_round() == pytest.approx(1.0, rel=1e-9)
    assert sync_round(cores=2) == pytest.approx(1.5, rel=1e-9)
    assert sync_round(cores=2, background=2) == pytest.approx(5 / 3, rel=1e-9)
    # the delay is a sleep and holds no core: Async of 4 workers with 1 s of CPU each on
    # one core is paced by the core (1 s per update), not by the delays (mean 0.1 s)
    steps = Compute(parse_straggler("exp:mean=0.1"), base=1.0, cores=1)
    r = _run(parse_mode("async"), 4, steps, updates=400)
    assert r.time_per_update == pytest.approx(1.0, rel=0.02)
    with pytest.raises(ValueError, match="cores must be a finite number > 0"):
        Compute(base=1.0, cores=0)


def test_a_cancelled_computation_gives_its_core_back():
    from disttrain.plan.cpu import SharedCores

    cpu = SharedCores(1)
    cpu.add(0.0, 0, 1.0)
    cpu.add(0.0, 1, 1.0)
    assert cpu.next_done() == pytest.approx(2.0)  # two tasks, half a core each
    cpu.remove(0.5, 1)  # task 0 did 0.25 s of work, 0.75 s left at the full core
    assert cpu.next_done() == pytest.approx(1.25)
    assert cpu.finish(1.25) == [0] and cpu.next_done() is None
    # K-batch-sync(2) of 2 on one core, 1 s of CPU, worker 1 sleeps 0.5 s more: both share
    # the core (done at 2 s); worker 0 pushes and computes again alone; worker 1's push at
    # 2.5 s closes the round and cancels worker 0 inside its CPU part: a round is 2.5 s
    steps = Compute(parse_straggler("fixed:rank=1,delay=0.5"), base=1.0, cores=1)
    r = _run(parse_mode("kbatch-sync:2"), 2, steps, updates=50)
    assert r.time_per_update == pytest.approx(2.5, rel=1e-9) and r.cancelled == 50


def test_cli_cores_flags(capsys):
    rc = main(["plan", "ps", "--workers", "3", "--mode", "sync", "--compute", "none",
               "--base", "1", "--cores", "2", "--updates", "50", "--explain"])
    out = capsys.readouterr().out
    assert rc == 0 and "mean time per update: 1.5 s" in out
    assert "shared on 2 cores with 0 other runnable processes" in out
    rc = main(["plan", "ps", "--workers", "3", "--mode", "sync", "--compute",
               "fixed:rank=2,delay=0.5", "--base", "1", "--wake", "0.1", "--updates", "50",
               "--explain"])
    out = capsys.readouterr().out
    assert rc == 0 and "mean time per update: 1.6 s" in out and "every sleep 0.1 s longer" in out
    rc = main(["plan", "ps", "--workers", "3", "--mode", "sync", "--compute", "none",
               "--base", "1", "--background", "2", "--updates", "50"])
    assert rc == 2 and "--background needs --cores" in capsys.readouterr().err


@pytest.mark.timeout(30)
def test_a_sleep_overrun_lengthens_every_delay_but_not_a_step_without_one():
    # a Sync round of 3 workers, 1 s of compute, worker 2 sleeps 0.5 s that overrun by
    # 0.1 s: 1.6 s; the workers that do not sleep do not overrun (delay 0 is no sleep)
    slow = parse_straggler("fixed:rank=2,delay=0.5")
    r = _run(parse_mode("sync"), 3, Compute(slow, base=1.0, wake=0.1), updates=50)
    assert r.time_per_update == pytest.approx(1.6, rel=1e-9)
    # Async: workers 0 and 1 push every 1 s (no sleep, no overrun), worker 2 every 1.6 s:
    # 21 updates per 8 s (without the overrun 1.5 s: 8 per 3 s)
    r = _run(parse_mode("async"), 3, Compute(slow, base=1.0, wake=0.1), updates=210)
    assert r.time_per_update == pytest.approx(8 / 21, rel=1e-9)
    with pytest.raises(ValueError, match="wake-up overrun must be"):
        Compute(base=1.0, wake=-1)
