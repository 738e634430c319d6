"""The size budget (tools/budget.py) finds what is over, and the tree is within it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("budget", ROOT / "tools" / "budget.py")
budget = importlib.util.module_from_spec(spec)
spec.loader.exec_module(budget)


def test_a_long_module_and_a_long_function_are_reported(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(61))
    (tmp_path / "big.py").write_text(f'def f():\n    """Docs."""\n{body}\n' + "y = 1\n" * 300)
    (tmp_path / "small.py").write_text('def g():\n    """' + "doc\n" * 80 + '"""\n    return 1\n')
    found = {name: (n, limit) for name, n, limit in budget.over_budget(tmp_path)}
    assert found == {"big.py": (363, 350), "big.py:f": (62, 60)}


def test_the_package_is_within_its_budget():
    assert budget.over_budget() == []
