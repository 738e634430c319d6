"""Real text with no download: the Python standard library's own source files.

Characters are their ASCII codes (vocabulary 128); anything else becomes "?".
"""

from __future__ import annotations

import os

import torch

__all__ = ["stdlib_text", "encode", "decode", "batches"]

MODULES = ("textwrap.py", "string.py", "heapq.py", "bisect.py", "functools.py",
           "contextlib.py", "dataclasses.py", "fractions.py")


def stdlib_text(max_chars: int = 200_000) -> str:
    """Concatenated source of a few stdlib modules (found next to os.py)."""
    root = os.path.dirname(os.__file__)
    parts, total = [], 0
    for name in MODULES:
        path = os.path.join(root, name)
        if not os.path.exists(path):
            continue
        with open(path, encoding="utf-8", errors="replace") as fh:
            parts.append(fh.read())
        total += len(parts[-1])
        if total >= max_chars:
            break
    if not parts:
        raise FileNotFoundError(f"no stdlib source found under {root}; is this a full Python install?")
    return "".join(parts)[:max_chars]


def encode(text: str) -> torch.Tensor:
    return torch.tensor([ord(c) if ord(c) < 128 else ord("?") for c in text], dtype=torch.long)


def decode(ids) -> str:
    return "".join(chr(int(i)) for i in ids)


def batches(data: torch.Tensor, batch_size: int, block_size: int, generator: torch.Generator):
    """Endless (x, y) pairs of shape (batch_size, block_size); y is x shifted by one."""
    while True:
        starts = torch.randint(len(data) - block_size - 1, (batch_size,), generator=generator)
        x = torch.stack([data[s:s + block_size] for s in starts])
        y = torch.stack([data[s + 1:s + 1 + block_size] for s in starts])
        yield x, y
