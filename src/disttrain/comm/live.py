"""Where a rank waits right now: its in-flight collectives in a small shared-memory file.

Who talks to whom: comm/flight.py's `FlightRecorder.start()` writes the collective it
issues into a free slot of `rank{R}.a{A}.live` in the report folder, `end()` frees the
slot; the launcher (launch/hang_report.py) reads every rank's file with `read_live()`
after the ranks ended. The file is `mmap`ed (MAP_SHARED): a write is a copy into the
page cache, visible to any reader at once and kept when the rank is stopped or killed,
even by SIGKILL, so the launcher's report never depends on a heartbeat having run.

Layout: SLOTS fixed slots of SLOT_BYTES; byte 0 of a slot is b"1" while it holds an
in-flight collective (b"0" when free); the rest is one tab-separated UTF-8 record
(seq, order, op, group, ranks, func, site) ended by a NUL; `order` increases with every
collective the rank issues (oldest in flight first).

Cost per collective: two ints formatted onto the call site's cached bytes, two slice
assignments into the mapping, one at the end (docs/benchmarks.md, "Flight recorder"). Standard library only.
"""

from __future__ import annotations

import mmap
import os

__all__ = ["LiveSlots", "read_live", "SLOTS", "SLOT_BYTES"]

SLOTS = 32
"""In-flight collectives one rank can show at once (more are still in its JSON state)."""
SLOT_BYTES = 512
FREE, USED = b"0", b"1"


class LiveSlots:
    """The writer side: one rank's mapped file; callers hold the recorder's lock."""

    def __init__(self, path: str):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, SLOTS * SLOT_BYTES)
            self._map = mmap.mmap(fd, SLOTS * SLOT_BYTES, mmap.MAP_SHARED, mmap.PROT_WRITE | mmap.PROT_READ)
        finally:
            os.close(fd)  # NOTE: the mapping keeps the file's pages; the fd is not needed
        self._free = list(range(SLOTS - 1, -1, -1))
        self._tails: dict[tuple[str, str, str, str], bytes] = {}
        self.path = path

    def put(self, seq: int, order: int, op: str, group: str, ranks: str, func: str,
            site: str) -> int:
        """Write one in-flight collective (`order`: increasing per issue, oldest first);
        its slot (pass it to `clear`), or -1 when every slot is taken."""
        if not self._free:
            return -1
        key = (op, group, site, func)
        tail = self._tails.get(key)
        if tail is None:  # NOTE: once per call site: the hot path only formats two ints
            if len(self._tails) > 4096:
                self._tails.clear()
            tail = f"\t{op}\t{group}\t{ranks}\t{func}\t{site[-300:]}\0".encode()
            # NOTE: a group too irregular to fit is left to the JSON heartbeat, never cut
            self._tails[key] = tail = tail if len(tail) <= SLOT_BYTES - 42 else b""
        if not tail:
            return -1
        body = b"%d\t%d" % (seq, order) + tail
        slot = self._free.pop()
        base = slot * SLOT_BYTES
        # NOTE: body first, then the flag: a reader never sees a flagged half-written slot
        # (a kill between the two leaves the slot free, which it was).
        self._map[base + 1: base + 1 + len(body)] = body
        self._map[base: base + 1] = USED
        return slot

    def clear(self, slot: int) -> None:
        """Mark `slot` free (the collective completed)."""
        if slot >= 0:
            self._map[slot * SLOT_BYTES: slot * SLOT_BYTES + 1] = FREE
            self._free.append(slot)

    def close(self) -> None:
        self._map.close()


def read_live(path: str) -> list[dict] | None:
    """The in-flight collectives in `path`, oldest first (entries as the JSON state has
    them: seq, op, group, ranks, site, func; `order` instead of `started`); None if it
    cannot be read."""
    try:
        with open(path, "rb") as fp:
            data = fp.read()
    except OSError:
        return None
    out = []
    for base in range(0, len(data) - SLOT_BYTES + 1, SLOT_BYTES):
        if data[base: base + 1] != USED:
            continue
        fields = data[base + 1: base + SLOT_BYTES].split(b"\0", 1)[0].decode(errors="replace").split("\t")
        if len(fields) != 7:
            continue
        try:  # a slot torn by a kill mid-write is skipped, never guessed at
            out.append({"seq": int(fields[0]), "order": int(fields[1]), "op": fields[2],
                        "group": fields[3], "ranks": parse_ranks(fields[4]), "func": fields[5],
                        "site": fields[6]})
        except ValueError:
            continue
    return sorted(out, key=lambda e: e["order"])


def parse_ranks(text: str) -> list[int]:
    """'0-2,5' -> [0, 1, 2, 5] (the inverse of flight.format_ranks)."""
    out: list[int] = []
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out
