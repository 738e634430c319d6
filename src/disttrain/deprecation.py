"""Deprecated aliases: names and modules that moved keep their old path for one release.

A package face sets `__getattr__ = moved(__name__, {old: "new.module:name"})`; a module
that moved is registered at its old path by its old package's face with
`moved_module(old, new)`. Using an old name then warns (DeprecationWarning) with the
new one and returns the object from its new home. The aliases are made here at run
time, not by import statements, so they add no edge to the import graph that
tools/cycles.py checks; that tool also fails when a module of disttrain uses one.
"""

from __future__ import annotations

import importlib
import sys
import types
import warnings
from collections.abc import Callable

__all__ = ["moved", "moved_module"]


def moved(module: str, names: dict[str, str] | None = None, *,
          to: str | None = None) -> Callable[[str], object]:
    """A module `__getattr__` for `module` serving each old name from its new home:
    `names` maps old name -> "new.module:name"; `to` serves every name from module `to`."""

    def __getattr__(name: str):
        target = (names or {}).get(name) or (f"{to}:{name}" if to and not name.startswith("__")
                                              else None)
        if target is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        new_module, _, attr = target.partition(":")
        value = importlib.import_module(new_module)
        for part in attr.split("."):  # "module:Class.method"
            value = getattr(value, part)
        warnings.warn(f"{module}.{name} is deprecated and will be removed in the next release; "
                      f"use {new_module}.{attr}", DeprecationWarning, stacklevel=2)
        return value

    return __getattr__


def moved_module(old: str, new: str) -> None:
    """Make `import old` work for one release: a module whose every name warns and is
    `new`'s. Call it from the face of `old`'s package (importing `old` runs that first)."""
    alias = types.ModuleType(old, f"Deprecated alias of {new} (moved): import {new}.")
    alias.__getattr__ = moved(old, to=new)
    sys.modules.setdefault(old, alias)
    setattr(sys.modules[old.rpartition(".")[0]], old.rpartition(".")[2], sys.modules[old])
