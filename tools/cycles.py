"""No import cycle between modules or between packages of src/disttrain (`make lint`).

Every `import` and `from ... import` counts, wherever it is written: at module level,
inside a function (a lazy import hides a cycle, it does not remove it) and under
`if TYPE_CHECKING:` (a type-only cycle is still two concepts that know each other).
Relative imports are resolved against the importing module. `from pkg import name`
resolves to the submodule `pkg.name` when there is one, else, when the package face
(`pkg/__init__.py`) re-exports `name` from a module, to that defining module (followed
through faces), else to the face itself: a submodule that takes a name from its own
package's face depends on the module that defines it, not on the whole face.

Two graphs are checked. Modules: one node per module, a package's `__init__` named as
the package. Packages: one node per package, holding the modules directly in it; the
loose modules of the top `disttrain` package (runtime.py, mesh.py, ...) are each a node
of their own, since the top face re-exports every package by design.

Deprecated aliases are out of both graphs by construction: disttrain/deprecation.py
makes them at run time (a face's `__getattr__`, a module registered at its old path),
with no import statement. Nothing under src/disttrain may use one: an import of a
disttrain module that has no file, or of a name that a face neither defines nor
re-exports, is reported too. KNOWN_PACKAGE_CYCLES may name a package import left out
of the package graph for a while (none is now); the check fails once no module makes it.

    python tools/cycles.py [ROOT]     # exits 1 listing every cycle, 0 when there is none
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict, deque
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "src" / "disttrain"

# Package imports left out of the package graph, each with its reason: the one known
# package cycle, being removed. Nothing else belongs here.
KNOWN_PACKAGE_CYCLES: dict[tuple[str, str], str] = {}


ADVICE = "give each concept one home (move it down, or tell the lower module what it needs)"


def module_names(root: Path) -> dict[str, Path]:
    """Dotted name -> file of every module under `root` (a package's __init__ as the package)."""
    top = root.name
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = [top, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(tree: ast.AST, name: str, is_package: bool):
    """(target module, imported names or None) of every import in `tree`, absolute."""
    package = name if is_package else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            yield base, [a.name for a in node.names]


def _defined_by_face(face: ast.AST, package: str) -> dict[str, str]:
    """Name -> module it comes from, for each name a face defines (itself) or re-exports."""
    out = {}
    for node in face.body:
        if isinstance(node, ast.ImportFrom):
            for target, names in _imports(ast.Module([node], []), package, True):
                out.update((n, target) for n in names)
        elif isinstance(node, ast.Import):
            out.update((a.asname or a.name.partition(".")[0], package) for a in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[node.name] = package
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                out.update((n.id, package) for n in ast.walk(target) if isinstance(n, ast.Name))
    return out


def import_graph(root: Path = ROOT, unknown: list[str] | None = None) -> dict[str, dict[str, int]]:
    """Module -> {module it imports: line}, within `root`'s package. Imports of a module
    or face name that does not exist (a deprecated alias) are appended to `unknown`."""
    modules = module_names(root)
    trees = {m: ast.parse(p.read_text(), str(p)) for m, p in modules.items()}
    faces = {m: _defined_by_face(t, m) for m, t in trees.items() if modules[m].name == "__init__.py"}
    top = root.name

    def resolve(target: str, name: str | None) -> str | None:
        seen = set()
        while name is not None and f"{target}.{name}" not in modules and name in faces.get(target, {}) \
                and target not in seen:
            seen.add(target)
            target = faces[target][name]
        if name is not None and f"{target}.{name}" in modules:
            return f"{target}.{name}"
        while target and target not in modules:  # `import a.b.c` of a non-module attribute
            target = target.rpartition(".")[0]
        return target or None

    def exists(target: str, name: str | None) -> bool:
        if not (target == top or target.startswith(top + ".")):
            return True
        if name is None or target not in faces:
            return target in modules
        return f"{target}.{name}" in modules or name in faces[target] or name == "*"

    graph: dict[str, dict[str, int]] = {}
    for m, tree in trees.items():
        edges = graph.setdefault(m, {})
        is_package = modules[m].name == "__init__.py"
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target, names in _imports(ast.Module([node], []), m, is_package):
                for name in names or [None]:
                    if unknown is not None and not exists(target, name):
                        unknown.append(f"{m} line {node.lineno} imports "
                                       f"{target}{'.' + name if name else ''}")
                    dep = resolve(target, name)
                    if dep is not None and dep != m:
                        edges.setdefault(dep, node.lineno)
    return graph


def package_of(module: str, packages: set[str]) -> str:
    """The package node a module belongs to (the top package's loose modules and every
    `__main__`, a program that nothing imports: themselves)."""
    if module in packages or module.count(".") == 1 or module.endswith(".__main__"):
        return module
    return module.rpartition(".")[0]


def package_graph(graph: dict[str, dict[str, int]], root: Path = ROOT):
    """Package -> {package it imports: (module, module) witness}, known pairs left out."""
    packages = {m for m, p in module_names(root).items() if p.name == "__init__.py"}
    out: dict[str, dict[str, tuple[str, str]]] = defaultdict(dict)
    for m, deps in graph.items():
        pm = package_of(m, packages)
        out[pm]
        for d in deps:
            pd = package_of(d, packages)
            if pd != pm and (pm, pd) not in KNOWN_PACKAGE_CYCLES:
                out[pm].setdefault(pd, (m, d))
    return dict(out)


def cycles(graph: dict[str, dict]) -> list[tuple[list[str], list[str]]]:
    """(its nodes, one shortest cycle) of each group of nodes that reach each other."""
    found, done = [], set()
    for start in sorted(graph):
        if start in done:
            continue
        path = _shortest_cycle(graph, start)
        if path:
            group = sorted(n for n in graph if _reaches(graph, start, n) and _reaches(graph, n, start))
            found.append((group, path))
            done.update(group)
    return found


def _reaches(graph: dict[str, dict], a: str, b: str) -> bool:
    seen, todo = {a}, [a]
    while todo:
        for n in graph.get(todo.pop(), ()):
            if n == b:
                return True
            if n not in seen:
                seen.add(n)
                todo.append(n)
    return False


def _shortest_cycle(graph: dict[str, dict], start: str) -> list[str] | None:
    parent, todo = {start: None}, deque([start])
    while todo:
        n = todo.popleft()
        for d in sorted(graph.get(n, ())):
            if d == start:
                path = [n]
                while parent[path[-1]] is not None:
                    path.append(parent[path[-1]])
                return [start, *reversed(path[:-1]), start] if len(path) > 1 else [start, n, start]
            if d not in parent:
                parent[d] = n
                todo.append(d)
    return None


def problems(root: Path = ROOT) -> list[str]:
    """Every module cycle, package cycle and import of a shim, as lines to print."""
    unknown: list[str] = []
    graph = import_graph(root, unknown)
    out = [f"{u}, which no module defines (a deprecated alias, or a typo): import it from "
           "its home" for u in unknown]
    for group, c in cycles(graph):
        steps = ", ".join(f"{a} line {graph[a][b]} imports {b}" for a, b in zip(c, c[1:]))
        out.append(f"module cycle {' -> '.join(c)} ({steps}; in a cycle: {', '.join(group)}): "
                   f"{ADVICE}")
    packages = package_graph(graph, root)
    names = {m for m, p in module_names(root).items() if p.name == "__init__.py"}
    used = {(package_of(m, names), package_of(d, names)) for m in graph for d in graph[m]}
    out += [f"KNOWN_PACKAGE_CYCLES in tools/cycles.py names {a} -> {b}, which no module imports "
            "any more: delete the entry" for a, b in KNOWN_PACKAGE_CYCLES
            if root == ROOT and (a, b) not in used]
    for group, c in cycles(packages):
        steps = ", ".join(f"{packages[a][b][0]} imports {packages[a][b][1]}" for a, b in zip(c, c[1:]))
        out.append(f"package cycle {' -> '.join(c)} ({steps}; in a cycle: {', '.join(group)}): "
                   f"{ADVICE}")
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    found = problems(Path(args[0]) if args else ROOT)
    for line in found:
        print(f"cycles: {line}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
