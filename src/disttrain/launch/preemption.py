"""`disttrain run` under a scheduler's SIGTERM: tell the ranks, give them a grace period, stop them.

Who talks to whom: job.py installs `Preemption` around the elastic agent (and keeps the
agent's own SIGTERM handler out: AGENT_SIGNALS). On the first
SIGTERM it sends disttrain.preempt.PREEMPT_SIGNAL (SIGUSR2) to every rank that
registered a `rank{R}.a{A}.preempt` file (a script that calls `disttrain.preempted()`)
and is a process of this launcher, then arms a timer of `grace` seconds. The ranks agree
on a step (disttrain/preempt.py), save and exit 0; the job then ends with EXIT_PREEMPTED.
When the timer fires, a second SIGTERM comes, or no rank registered, it raises torch
elastic's SignalException(SIGTERM) as the agent's own handler would: the agent sends the
ranks SIGTERM, then SIGKILL after its shutdown timeout. Why: docs/design/launcher.md,
"Preemption".
"""

from __future__ import annotations

import glob
import os
import re
import signal
import socket
import sys
import time

from torch.distributed.elastic.multiprocessing import SignalException

from disttrain import settings
from disttrain.preempt import PREEMPT_SIGNAL

__all__ = ["EXIT_PREEMPTED", "Preemption", "DEFAULT_GRACE", "AGENT_SIGNALS"]

EXIT_PREEMPTED = 128 + int(signal.SIGTERM)
"""143: `disttrain run` stopped because it got SIGTERM (what a process ended by SIGTERM
returns: schedulers read it as "terminated", e.g. a Kubernetes podFailurePolicy on 143)."""
DEFAULT_GRACE = 30.0
_MARKER = re.compile(r"rank(\d+)\.a(\d+)\.preempt$")


AGENT_SIGNALS = "SIGINT,SIGHUP,SIGQUIT"
"""The signals the elastic agent handles itself (LaunchConfig.signals_to_handle): its
default list without SIGTERM, which `Preemption` handles."""


class Preemption:
    """The launcher's SIGTERM and SIGALRM handlers for one `run()` (main thread only)."""

    def __init__(self, report_dir: str, grace: float):
        self.report_dir, self.grace = report_dir, grace
        self.noticed: float | None = None  # time.monotonic() of the first SIGTERM
        self.told = 0  # ranks sent the notice
        self.expired = False
        self._saved: dict = {}

    def __enter__(self) -> Preemption:
        for sig, fn in ((signal.SIGTERM, self._on_term), (signal.SIGALRM, self._on_alarm)):
            self._saved[sig] = signal.signal(sig, fn)
        return self

    def __exit__(self, *exc) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        for sig, fn in self._saved.items():
            signal.signal(sig, fn)

    def rank_env(self) -> dict[str, str]:
        return {settings.PREEMPT_SIGNAL: PREEMPT_SIGNAL.name}

    def finished(self) -> int:
        """Exit code of a job whose ranks all exited 0: 0, or EXIT_PREEMPTED after SIGTERM."""
        if self.noticed is None:
            return 0
        print(f"disttrain run: preempted: the ranks exited {time.monotonic() - self.noticed:.1f} s "
              f"after the notice; exit code {EXIT_PREEMPTED}", file=sys.stderr, flush=True)
        return EXIT_PREEMPTED

    def stopped(self, sig: signal.Signals) -> int:
        """Say that the agent stopped every rank because of `sig`; its exit code (128 + sig)."""
        late = f" (they did not exit within --grace-seconds {self.grace:g})" if self.expired else ""
        print(f"disttrain run: got {sig.name}, stopped every rank{late}", file=sys.stderr, flush=True)
        return 128 + int(sig)

    def _on_term(self, signum, frame) -> None:
        if self.noticed is not None or self.grace <= 0:
            raise SignalException("disttrain run: SIGTERM: stopping the ranks now", signal.SIGTERM)
        self.noticed = time.monotonic()
        pids = registered(self.report_dir)
        if not pids:  # no rank handles the notice: stop at once, as before
            raise SignalException("disttrain run: SIGTERM: no rank handles preemption", signal.SIGTERM)
        for pid in pids:
            try:
                os.kill(pid, PREEMPT_SIGNAL)
                self.told += 1
            except ProcessLookupError:
                continue
        print(f"disttrain run: got SIGTERM: told {self.told} rank(s) to save and stop "
              f"(disttrain.preempted()); stopping them in {self.grace:g} s", file=sys.stderr, flush=True)
        signal.setitimer(signal.ITIMER_REAL, self.grace)

    def _on_alarm(self, signum, frame) -> None:
        self.expired = True
        raise SignalException(f"disttrain run: grace period of {self.grace:g} s over", signal.SIGTERM)


def registered(report_dir: str) -> list[int]:
    """Pids of the ranks of the newest attempt that handle the notice and are this
    launcher's processes (a pid of another node, or reused, is never signalled)."""
    found = []
    for path in glob.glob(os.path.join(report_dir, "rank*.a*.preempt")):
        m = _MARKER.search(path)
        try:
            with open(path) as fp:
                pid, host = fp.read().split()
            found.append((int(m[2]), int(pid), host))
        except (OSError, ValueError, TypeError):
            continue
    if not found:
        return []
    newest = max(a for a, _, _ in found)
    here = socket.gethostname()
    return [pid for a, pid, host in found if a == newest and host == here and _descends(pid)]


def _descends(pid: int, levels: int = 3) -> bool:
    """True if `pid` is a child of this process, or a grandchild (a supervised worker)."""
    me = os.getpid()
    for _ in range(levels):
        try:
            with open(f"/proc/{pid}/stat") as fp:
                pid = int(fp.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return not os.path.isdir("/proc/self")  # NOTE: no /proc: trust the marker
        if pid == me:
            return True
    return False
