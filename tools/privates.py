"""No module reads or writes another object's private attributes (`make lint`).

A private attribute is one that a class of src/disttrain sets on `self` with a leading
underscore (`self._voted = ...`). Using it through anything but `self` or `cls`
(`other._voted`, `o._to_masters()`) is reported: give the class a method or a property
that says what the caller needs. torch's own module and optimizer internals
(`module._modules`, `_parameters`, `_buffers`, ...) are torch's documented extension
points, not another disttrain class's state, and are left alone.

    python tools/privates.py [ROOT]   # exits 1 listing each use, 0 when there is none
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "src" / "disttrain"
# torch.nn.Module's and torch.optim.Optimizer's own private attributes.
TORCH = frozenset({"_modules", "_parameters", "_buffers", "_non_persistent_buffers_set",
                   "_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
                   "_state_dict_hooks", "_load_state_dict_pre_hooks", "_version"})


def private_uses(root: Path = ROOT) -> list[str]:
    """'file:line: expr' for each private attribute of a disttrain class used from outside."""
    trees = {p: ast.parse(p.read_text(), str(p)) for p in sorted(root.rglob("*.py"))}
    owned = set()
    for tree in trees.values():
        for n in ast.walk(tree):
            if (isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
                    and isinstance(n.value, ast.Name) and n.value.id == "self"):
                owned.add(n.attr)
            elif isinstance(n, ast.ClassDef):
                owned.update(f.name for f in n.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)))
    owned = {a for a in owned if a.startswith("_") and not a.startswith("__")} - TORCH
    out = []
    for path, tree in trees.items():
        where = path.relative_to(root.parent).as_posix()
        for n in ast.walk(tree):
            if (isinstance(n, ast.Attribute) and n.attr in owned
                    and not (isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"))):
                out.append(f"{where}:{n.lineno}: {ast.unparse(n)}")
            elif (isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                  and n.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(n.args) > 1
                  and isinstance(n.args[1], ast.Constant) and n.args[1].value in owned):
                out.append(f"{where}:{n.lineno}: {ast.unparse(n)}")
    return sorted(out, key=lambda line: (line.split(":")[0], int(line.split(":")[1])))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    found = private_uses(Path(args[0]) if args else ROOT)
    for line in found:
        print(f"privates: {line} is another object's private attribute: give its class a "
              "method or property for what this needs", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
