"""The import-cycle check (tools/cycles.py) finds what it must, and the tree has none."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("cycles", ROOT / "tools" / "cycles.py")
cycles = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cycles)


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "pkg"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_a_cycle_hidden_in_a_function_is_found(tmp_path):
    root = _package(tmp_path, {
        "__init__.py": "",
        "low.py": "def f():\n    from . import high  # lazy: still a cycle\n    return high\n",
        "high.py": "from pkg.low import f\n",
    })
    found = cycles.problems(root)
    assert found[0].startswith("module cycle pkg.high -> pkg.low -> pkg.high (pkg.high line 1 "
                               "imports pkg.low, pkg.low line 2 imports pkg.high")
    assert len(found) == 2 and found[1].startswith("package cycle pkg.high -> pkg.low")


def test_a_name_from_a_face_counts_as_its_defining_module(tmp_path):
    # sub/a.py takes `g` from its own face: that is sub/b.py, not the face (no cycle);
    # b.py taking `h` from the top face is top/c.py, which imports sub.a: a cycle.
    root = _package(tmp_path, {
        "__init__.py": "from pkg.c import h\n",
        "c.py": "from pkg.sub.a import k\n\ndef h():\n    return k\n",
        "sub/__init__.py": "from pkg.sub.a import k\nfrom pkg.sub.b import g\n",
        "sub/a.py": "from pkg.sub import g\n\nk = g\n",
        "sub/b.py": "g = 1\n",
    })
    assert cycles.problems(root) == []
    (root / "sub" / "b.py").write_text("g = 1\n\ndef later():\n    from pkg import h\n    return h\n")
    found = cycles.problems(root)
    assert any(f.startswith("module cycle pkg.c -> pkg.sub.a -> pkg.sub.b -> pkg.c") for f in found)
    assert any(f.startswith("package cycle pkg.c -> pkg.sub -> pkg.c") for f in found), found


def test_a_package_cycle_without_a_module_cycle_is_found(tmp_path):
    root = _package(tmp_path, {
        "__init__.py": "", "a/__init__.py": "", "b/__init__.py": "",
        "a/one.py": "import pkg.b.two\n", "b/two.py": "x = 1\n",
        "b/three.py": "from pkg.a import four\n", "a/four.py": "y = 2\n",
    })
    found = cycles.problems(root)
    assert found == [found[0]] and found[0].startswith("package cycle pkg.a -> pkg.b -> pkg.a")
    assert "pkg.a.one imports pkg.b.two" in found[0] and "pkg.b.three imports pkg.a.four" in found[0]


def test_using_a_deprecated_alias_inside_the_package_is_reported(tmp_path):
    root = _package(tmp_path, {
        "__init__.py": "from pkg.deprecation import moved\n__getattr__ = moved('pkg', {})\n",
        "deprecation.py": "def moved(module, names):\n    return None\n",
        "new.py": "x = 1\n",
        "user.py": "from pkg.old import x\nfrom pkg import gone\n",
    })
    found = cycles.problems(root)
    assert len(found) == 2 and "pkg.user line 1 imports pkg.old.x" in found[0]
    assert "pkg.user line 2 imports pkg.gone" in found[1]


def test_the_package_has_no_cycle():
    assert cycles.problems() == []
