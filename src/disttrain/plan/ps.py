"""`disttrain plan ps`: time per update and staleness of a parameter-server mode, simulated.

Each mode is the policy the servers run (ps/policy.py), driven by plan/simulate.py. For
exponential compute and no communication Dutta et al. 2018 ("Slow and stale gradients can
win the race", AISTATS) give the expected time per update with P workers of rate mu:
Sync H_P/mu, K-sync (H_P - H_(P-K))/mu, K-batch-sync K/(P mu), Async 1/(P mu); `closed_form`
returns them (and K-batch-async's K/(P mu), backup workers' (H_P - H_b)/mu) so `--explain`
prints them beside the simulated value. `recommend` turns times per update and the
updates each mode needs to reach a target into a sentence. CLI: plan/ps_cli.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from disttrain.plan.simulate import Compute, Network, Result, simulate
from disttrain.ps import policy as pol

__all__ = ["MODES", "Mode", "mode_name", "parse_mode", "closed_form", "Candidate", "recommend", "describe"]

MODES = {
    # name: (parameter it needs or None, label, policy builder(param))
    "sync": (None, "Sync", lambda _: pol.Sync()),
    "ksync": ("k", "K-sync(K={})", pol.KSync),
    "kbatch-sync": ("k", "K-batch-sync(K={})", pol.KBatchSync),
    "async": (None, "Async", lambda _: pol.Async()),
    "kasync": ("k", "K-async(K={})", pol.KAsync),
    "kbatch-async": ("k", "K-batch-async(K={})", pol.KBatchAsync),
    "ssp": ("s", "SSP(s={})", pol.SSP),
    "backup": ("backups", "Sync with {} backup workers", None),
}
"""Mode names of `--mode` (and of examples/digits_ps.py, plus `backup`)."""
_ALIASES = {"kbatch": "kbatch-sync", "kbatchsync": "kbatch-sync",
            "k-sync": "ksync", "k-batch-sync": "kbatch-sync", "bsp": "sync"}


@dataclass(frozen=True)
class Mode:
    """A consistency mode and its one parameter (k, s or the number of backup workers)."""

    name: str
    param: int | None = None

    def __post_init__(self) -> None:
        if self.name not in MODES:
            raise ValueError(f"unknown mode {self.name!r}; use one of {', '.join(MODES)}")
        need = MODES[self.name][0]
        if need and self.param is None:
            flag = {"k": "--k K", "s": "--s S", "backups": "--backups B"}[need]
            raise ValueError(f"mode {self.name} needs {flag} (written {self.name}:N in "
                             "--updates-to-target)")
        if not need and self.param is not None:
            raise ValueError(f"mode {self.name} takes no parameter, got {self.param}")

    @property
    def label(self) -> str:
        return MODES[self.name][1].format(self.param)

    def build(self, workers: int) -> pol.Policy:
        """A fresh policy for a job of `workers` workers, not started (the simulator starts
        one per server)."""
        if self.name == "backup":
            return pol.backup_workers(workers, self.param)
        return MODES[self.name][2](self.param)

    def check(self, workers: int) -> None:
        """Raise ValueError, saying how to fix it, if a job of `workers` workers cannot run
        this mode (e.g. k > workers): the policy's own checks."""
        self.build(workers).start(list(range(workers)))


def mode_name(text: str) -> str:
    """The mode a name or alias means ('kbatch' -> 'kbatch-sync'); ValueError if none."""
    name = text.strip().lower()
    name = _ALIASES.get(name, name)
    if name not in MODES:
        raise ValueError(f"unknown mode {text!r}; use one of {', '.join(MODES)}")
    return name


def parse_mode(text: str) -> Mode:
    """'sync', 'ksync:2', 'kbatch-sync:3', 'ssp:2', 'backup:1' -> Mode; ValueError if bad."""
    name, _, param = text.partition(":")
    name = mode_name(name)
    if param and not param.strip().isdigit():
        raise ValueError(f"mode {text!r}: the parameter after ':' must be an integer")
    return Mode(name, int(param) if param else None)


def _harmonic(n: int) -> float:
    return sum(1.0 / i for i in range(1, n + 1))


def closed_form(mode: Mode, workers: int, compute: Compute, network: Network | None,
                apply_s: float) -> tuple[float, str] | None:
    """Dutta et al. 2018's expected time per update and its formula, for exponential
    compute (no base, no shift) without communication or apply time; None otherwise or
    for a mode without one (K-async as the servers run it, SSP)."""
    s = compute.straggler
    if s.kind != "exp" or compute.base or network is not None or apply_s or s.mean <= 0:
        return None
    P, m, k = workers, s.mean, mode.param
    forms = {
        "sync": (_harmonic(P) * m, f"H_P/mu = H_{P} x {m:g} s"),
        "ksync": ((_harmonic(P) - _harmonic(P - (k or 0))) * m,
                  f"(H_P - H_(P-K))/mu = (H_{P} - H_{P - (k or 0)}) x {m:g} s"),
        "backup": ((_harmonic(P) - _harmonic(k or 0)) * m,
                   f"K-sync with K = P - b: (H_P - H_b)/mu = (H_{P} - H_{k}) x {m:g} s"),
        "kbatch-sync": ((k or 0) * m / P, f"K/(P mu) = {k} x {m:g} s / {P}"),
        "kbatch-async": ((k or 0) * m / P, f"K/(P mu) = {k} x {m:g} s / {P} (every worker "
                         "always busy: pushes arrive at rate P mu)"),
        "async": (m / P, f"1/(P mu) = {m:g} s / {P}"),
    }
    return forms.get(mode.name)


KASYNC_NOTE = ("no closed form for K-async as the servers run it: a worker whose pushed "
               "gradient was already stale is answered at once (ps/policy.py), the paper's "
               "learner waits for the next update; it lies between K/(P mu) and "
               "(H_P - H_(P-K))/mu")


@dataclass
class Candidate:
    """One mode's simulated time per update and the updates it needs to reach the target."""

    mode: Mode
    updates_to_target: int
    result: Result

    @property
    def seconds(self) -> float:
        """Predicted time to the target: time per update x updates needed."""
        return self.result.time_per_update * self.updates_to_target


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"


def describe(compute: Compute, network: Network | None, servers: int = 1) -> str:
    """The inputs in words: 'exp stragglers of mean 50 ms', '... over 1 Gbit/s links'."""
    s = compute.straggler
    words = {"none": "no stragglers",
             "exp": f"exp stragglers of mean {_ms(s.mean)}",
             "shifted-exp": f"shifted-exp stragglers (shift {_ms(s.shift)}, mean {_ms(s.mean)})",
             "fixed": f"worker {s.rank} slower by {_ms(s.fixed)} a step"}[s.kind]
    if compute.base:
        words += f" on steps of {_ms(compute.base)}"
    if network is not None:
        rate = network.links.link_Bps * 8 / 1e9
        words += (f", {network.grad_bytes / 1e6:.3g} MB gradients over {rate:.3g} Gbit/s "
                  f"links to {servers} server{'s' * (servers > 1)}")
    return words


def recommend(needs: dict[Mode, int], workers: int, compute: Compute, *,
              servers: int = 1, network: Network | None = None, apply_s: float = 0.0,
              updates: int | None = None, seed: int = 0) -> tuple[list[Candidate], str]:
    """Simulate each mode of `needs` (mode -> updates it needs to reach the target, as
    benchmarks/ps_convergence.py measures) and say which reaches the target soonest.

    Returns the candidates, soonest first, and one sentence, e.g. 'with exp stragglers of
    mean 50 ms, K-batch-sync(K=3) reaches the target 2.8x sooner than Sync'. Blocks
    (pure CPU, about 0.4 s per mode by default: simulate.BUDGET).
    """
    if not needs:
        raise ValueError("give the updates each mode needs, e.g. sync=300,kbatch-sync:3=420")
    out = []
    for mode, n in needs.items():
        if n < 1:
            raise ValueError(f"{mode.label}: updates to target must be >= 1, got {n}")
        mode.check(workers)
        r = simulate(lambda m=mode: m.build(workers), workers, compute, servers=servers,
                     network=network, apply_s=apply_s, updates=updates, seed=seed)
        out.append(Candidate(mode, n, r))
    out.sort(key=lambda c: c.seconds)
    best, where = out[0], describe(compute, network, servers)
    if len(out) == 1:
        return out, f"with {where}, {best.mode.label} reaches the target in {_ms(best.seconds)}"
    sync = [c for c in out[1:] if c.mode.name == "sync"]
    ref = sync[0] if sync else out[1]
    tail = "" if sync else ", the runner-up"
    return out, (f"with {where}, {best.mode.label} reaches the target "
                 f"{ref.seconds / best.seconds:.1f}x sooner than {ref.mode.label}{tail} "
                 f"({_ms(best.seconds)} vs {_ms(ref.seconds)})")
