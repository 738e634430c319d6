"""The parameter-server wire's key and switches, from `disttrain.settings` (read once).

`job_secret()` checks DISTTRAIN_SECRET where the wire needs it (a data-parallel job never
does, so a bad secret does not stop it); the switches say which frames may leave their
tensors out of the MAC or the socket (docs/design/parameter-server.md, "Threat model").
transport.py, the server and the worker call these at start.
"""

from __future__ import annotations

from disttrain import settings

__all__ = ["job_secret", "encrypt_setting", "mac_setting", "shm_setting"]


def job_secret() -> bytes:
    """The per-job key from DISTTRAIN_SECRET (hex), which `disttrain run` generates."""
    raw = settings.current().secret
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
    return settings.current().ps_encrypt


def mac_setting() -> bool:
    """True when DISTTRAIN_PS_MAC=always: authenticate every byte even between processes of
    one user on a Unix socket (default `auto`: tensor buffers go without a MAC there, and
    through shared memory unless DISTTRAIN_PS_SHM=0)."""
    return settings.current().ps_mac_always


def shm_setting() -> bool:
    """DISTTRAIN_PS_SHM (default 1): 0 keeps the tensors on the socket where they could go
    through shared memory (a same-user ipc:// connection without DISTTRAIN_PS_MAC=always)."""
    return settings.current().ps_shm
