"""The size budget `make lint` checks: no module over 350 lines, no function over 60.

As tinygrad keeps its line count in CI: growth past the budget is a decision, written
in EXCEPTIONS below with its reason, not an accident. Counts physical lines of every
module under src/disttrain and of every function (its code: decorators and docstring
excluded, since a public function's argument docs are not complexity). Exits 1 listing what is over, 0 otherwise.

    python tools/budget.py [--report]
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

MODULE_LINES = 350
FUNCTION_LINES = 60
ROOT = Path(__file__).resolve().parents[1] / "src" / "disttrain"

# "path relative to src/disttrain[:function qualname]" -> why it may be larger.
EXCEPTIONS: dict[str, str] = {
    "ps/replica.py": "one chain's links, forwarding and commits, which a takeover (`drop`, "
    "the pushes' clocks) and a new tail's admission (`open_link`, `admit`) both hook into, "
    "about 35 lines together; what they do is ps/takeover.py and ps/transfer.py",
}


def functions(tree: ast.AST, prefix: str = ""):
    """(qualname, lines) of every function and method, nested ones included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            name = f"{prefix}{node.name}"
            yield name, node.end_lineno - node.lineno + 1 - _docstring_lines(node)
            yield from functions(node, f"{name}.")
        elif isinstance(node, ast.ClassDef):
            yield from functions(node, f"{prefix}{node.name}.")


def _docstring_lines(node: ast.AST) -> int:
    first = node.body[0] if node.body else None
    if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
            and isinstance(first.value.value, str)):
        return first.end_lineno - first.lineno + 1
    return 0


def over_budget(root: Path = ROOT) -> list[tuple[str, int, int]]:
    """(name, lines, limit) of every module and function past its budget, unexcused."""
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        text = path.read_text()
        lines = len(text.splitlines())
        if lines > MODULE_LINES and rel not in EXCEPTIONS:
            out.append((rel, lines, MODULE_LINES))
        for name, n in functions(ast.parse(text)):
            if n > FUNCTION_LINES and f"{rel}:{name}" not in EXCEPTIONS:
                out.append((f"{rel}:{name}", n, FUNCTION_LINES))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", action="store_true", help="also list the largest modules")
    args = parser.parse_args(argv)
    if args.report:
        sizes = sorted(((len(p.read_text().splitlines()), p.relative_to(ROOT).as_posix())
                        for p in ROOT.rglob("*.py")), reverse=True)
        for n, rel in sizes[:15]:
            print(f"{n:5d}  {rel}")
    stale = [k for k in EXCEPTIONS if not (ROOT / k.split(":")[0]).exists()]
    bad = over_budget()
    for name, n, limit in bad:
        print(f"budget: {name} has {n} lines (limit {limit}): split it, or add it to "
              "EXCEPTIONS in tools/budget.py with the reason", file=sys.stderr)
    for k in stale:
        print(f"budget: exception {k!r} names a file that no longer exists: remove it",
              file=sys.stderr)
    return 1 if bad or stale else 0


if __name__ == "__main__":
    sys.exit(main())
