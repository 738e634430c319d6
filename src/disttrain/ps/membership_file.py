"""The server manager's state on disk: `Membership` as JSON, written atomically.

`save` writes it (a temporary file in the same folder, fsync, rename), so a reader sees
the old file or the new one, never a part; `from_json` reads it back. Heartbeat times are
not saved (monotonic clocks are per process): every alive server gets a full timeout
again after a restart of the manager (manager.py). Pure but for the file write; no torch.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict

from disttrain.ps.membership import FORMAT, Member, Membership

__all__ = ["to_json", "from_json", "save"]


def to_json(m: Membership) -> str:
    """The state as JSON text (the last 200 events). Never blocks."""
    members = [dict(asdict(x), beat=None) for _, x in sorted(m.members.items())]
    return json.dumps({"format": FORMAT, "expected": m.expected, "version": m.version,
                       "fingerprint": m.fingerprint, "members": members,
                       "takeovers": m.takeovers, "copies": m.copies,
                       "events": m.events[-200:]}, indent=1)


def from_json(text: str, now: float) -> Membership:
    """The state `to_json` wrote; every alive member's heartbeat timer starts at `now`."""
    d = json.loads(text)
    if d.get("format") != FORMAT:
        raise ValueError(f"manager state of format {d.get('format')!r}, this is {FORMAT}: "
                         "written by another disttrain version; move the file away")
    members = {x["server"]: Member(**dict(x, beat=now)) for x in d["members"]}
    return Membership(d["expected"], d["version"], d["fingerprint"], members, d["events"],
                      d.get("takeovers", []), d.get("copies", []))


def save(m: Membership, path: str, extra: dict | None = None) -> None:
    """Write the state to `path` atomically (blocks for an fsync): a reader sees the old
    file or the new one, never a part. `extra` (e.g. the manager's address) is kept too."""
    d = json.loads(to_json(m))
    d.update(extra or {})
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(d, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
