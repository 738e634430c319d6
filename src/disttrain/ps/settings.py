"""The parameter-server wire's environment settings, read and checked in one place.

DISTTRAIN_SECRET (the job key), DISTTRAIN_PS_ENCRYPT, DISTTRAIN_PS_MAC and
DISTTRAIN_PS_SHM; each reader raises a ValueError/RuntimeError naming the variable and
the values it takes. transport.py and the server and worker read them at start.
"""

from __future__ import annotations

import os

__all__ = ["job_secret", "encrypt_setting", "mac_setting", "shm_setting"]


def job_secret() -> bytes:
    """The per-job key from DISTTRAIN_SECRET (hex), which `disttrain run` generates."""
    raw = os.environ.get("DISTTRAIN_SECRET")
    if not raw:
        raise RuntimeError(
            "DISTTRAIN_SECRET is not set; launch with `disttrain run --workers W --servers S`, "
            "or export the same random hex key on every rank: "
            "DISTTRAIN_SECRET=$(python -c 'import secrets; print(secrets.token_hex(32))')")
    try:
        key = bytes.fromhex(raw)
    except ValueError:
        raise RuntimeError("DISTTRAIN_SECRET must be hex (e.g. secrets.token_hex(32))") from None
    if len(key) < 16:
        raise RuntimeError(f"DISTTRAIN_SECRET has {len(key)} bytes; use at least 16 (32 hex digits)")
    return key


def encrypt_setting() -> bool:
    """DISTTRAIN_PS_ENCRYPT=1: AES-GCM over the buffers too (authentication is always on)."""
    raw = os.environ.get("DISTTRAIN_PS_ENCRYPT", "0")
    if raw not in ("0", "1"):
        raise ValueError(f"DISTTRAIN_PS_ENCRYPT={raw!r} must be 0 or 1")
    return raw == "1"


def mac_setting() -> bool:
    """True when DISTTRAIN_PS_MAC=always: authenticate every byte even between processes of
    one user on a Unix socket (default `auto`: tensor buffers go without a MAC there, and
    through shared memory unless DISTTRAIN_PS_SHM=0)."""
    raw = os.environ.get("DISTTRAIN_PS_MAC", "auto")
    if raw not in ("auto", "always"):
        raise ValueError(f"DISTTRAIN_PS_MAC={raw!r} must be 'auto' or 'always'")
    return raw == "always"


def shm_setting() -> bool:
    """DISTTRAIN_PS_SHM (default 1): 0 keeps the tensors on the socket where they could go
    through shared memory (a same-user ipc:// connection without DISTTRAIN_PS_MAC=always)."""
    raw = os.environ.get("DISTTRAIN_PS_SHM", "1")
    if raw not in ("0", "1"):
        raise ValueError(f"DISTTRAIN_PS_SHM={raw!r} must be 0 or 1")
    return raw == "1"
