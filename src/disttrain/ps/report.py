"""A parameter server's report line: `format_stats(stats)` of what `serve` returns.

One line for a server (its keys and bytes against the mean of the job's servers, the
policy's counters, the wire's, the replicas' roles and any key ranges it took over from
a dead server), and a second when its momentum and staleness are where training
diverges. Pure: plain dicts in, text out.
"""

from __future__ import annotations

__all__ = ["format_stats"]


def format_stats(stats: dict) -> str:
    """One line for a server's (or a job's) report (its keys and bytes, and how its bytes
    compare with the mean of the job's servers when `serve` added it), and a second one
    when its momentum and staleness are in the range where training diverges
    (staleness.divergence_warning)."""
    warning = stats.get("warning")
    return _stats_line(stats) + (f"\n[ps server{stats.get('server', '?')}] WARNING: {warning}"
                                 if warning else "")


def _stats_line(stats: dict) -> str:
    return (f"[ps server{stats.get('server', '?')}] {stats['policy']}: "
            f"{stats.get('keys', '?')} keys, {stats.get('bytes', 0) / 1e6:.2f} MB"
            + (f" ({stats['bytes'] / stats['mean_bytes']:.2f}x the mean of {stats['servers']} "
               "servers)" if stats.get("mean_bytes") else "") + ", "
            f"version {stats['version']}, "
            f"applied {stats['applied']}, dropped late {stats['dropped']}, abandoned partial "
            f"{stats.get('partial_dropped', 0)}, lost workers {stats['lost_workers']}, "
            f"rejected frames {stats.get('rejected_frames', 0)}{_reasons(stats)}, "
            f"staleness {stats['staleness']}"
            + (f", pushes received {stats['push_bytes'] / 1e6:.3f} MB in "
               f"{stats['push_frames']} frames ({stats.get('sparse_pushes', 0)} sparse)"
               if "push_bytes" in stats else "")
            + (f", momentum {stats['momentum']:g} stepped as {stats['applied_momentum']:.3f} "
               "(corrected for asynchrony)" if stats.get("momentum_rule") == "corrected" else "")
            + (f", restored version {stats['restored_version']} (lost updates "
               f"{_or_unknown(stats['lost_updates'])})" if "restored_version" in stats else "")
            + _replicas(stats) + _takeovers(stats))


def _replicas(stats: dict) -> str:
    """", replicas 2: head of 3 keys (0.01 MB), tail of 2 keys (...), sent ..."; "" if r = 1."""
    if stats.get("replicas", 1) == 1:
        return ""
    roles: dict[str, list[int]] = {role: [0, 0] for role in ("head", "middle", "tail")}
    for r in stats["ranges"]:
        roles[r["role"]][0] += r["keys"]
        roles[r["role"]][1] += r["bytes"]
    held = ", ".join(f"{role} of {n} keys ({b / 1e6:.2f} MB)" for role, (n, b) in roles.items()
                     if n)
    return (f", replicas {stats['replicas']}: {held} in {len(stats['ranges'])} chains, "
            f"replication sent {stats['replicate_bytes'] / 1e6:.3f} MB in "
            f"{stats['replicate_frames']} frames")


def _takeovers(stats: dict) -> str:
    """", took over 4 keys (0.01 MB) of server 1 at version 7 (served to version 20, ...)"."""
    return "".join(
        f", took over {t['keys']} keys ({t['bytes'] / 1e6:.2f} MB) of server {t['server']} "
        f"at version {t['version']} (served to version {t['stats']['version']}, applied "
        f"{t['stats']['applied']}, dropped late {t['stats']['dropped']})"
        for t in stats.get("takeovers", []) if "stats" in t)


def _reasons(stats: dict) -> str:
    """Why frames were rejected, e.g. " (schema:push.clock 2, protocol 1)"; "" if none."""
    counts = stats.get("rejected") or {}
    return f" ({', '.join(f'{k} {n}' for k, n in counts.items())})" if counts else ""


def _or_unknown(n) -> str:
    return "unknown" if n is None else str(n)
