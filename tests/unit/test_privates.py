"""The private-attribute check (tools/privates.py) finds a planted use, and the tree has none."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("privates", ROOT / "tools" / "privates.py")
privates = importlib.util.module_from_spec(spec)
spec.loader.exec_module(privates)


def test_another_objects_private_attribute_or_method_is_reported(tmp_path):
    root = tmp_path / "pkg"
    root.mkdir()
    (root / "a.py").write_text(
        "class A:\n"
        "    def __init__(self):\n        self._voted = False\n        self.public = 1\n"
        "    def _step(self):\n        return self._voted\n")
    (root / "b.py").write_text(
        "def vote(items, module):\n"
        "    for o in items:\n        o._voted = True\n        o._step()\n        o.public += 1\n"
        "    return getattr(items[0], '_voted'), module._modules\n")
    assert privates.private_uses(root) == [
        "pkg/b.py:3: o._voted", "pkg/b.py:4: o._step",
        "pkg/b.py:6: getattr(items[0], '_voted')"]


def test_the_package_uses_no_other_objects_private_attribute():
    assert privates.private_uses() == []
