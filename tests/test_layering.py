"""The package layering holds: no import cycle between bigtrain's packages, no two files that import
each other, and no import inside a function that would hide a cycle (issue 30).

Read from the source with ``ast`` (nothing is imported). A package is ``bigtrain.X`` (a folder or a
top-level module). Every import counts, at the top of a file or inside a function, except those
under ``if TYPE_CHECKING:`` (annotations only). :data:`KNOWN` lists the cycles the tree still has:
the test fails when a new one appears and when a listed one is gone (then strike it from the list),
so the list only shrinks.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "bigtrain"

# (importer package, imported package) edges that close a cycle today, and file pairs that import
# each other. Empty is the goal.
KNOWN_PACKAGE_EDGES: set[tuple[str, str]] = set()
KNOWN_MUTUAL_FILES: set[tuple[str, str]] = set()


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    inside = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            inside.update(id(n) for n in ast.walk(node))
    return inside


def file_imports() -> dict[str, set[str]]:
    """{module: the bigtrain modules it imports} (a name imported from a package is resolved to the
    submodule when there is one)."""
    modules = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = defaultdict(set)
    for module, path in modules.items():
        tree = ast.parse(path.read_text())
        skip = _type_checking_nodes(tree)
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    base = ".".join(parent + ([base] if base else []))
                targets = [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for target in targets:
                found = resolve(target) if target.startswith("bigtrain") else None
                if found and found != module:
                    edges[module].add(found)
    return edges


def package_of(module: str) -> str:
    return ".".join(module.split(".")[:2])


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(component)

    for v in list(graph):
        if v not in index:
            visit(v)
    return out


def cycle_edges() -> set[tuple[str, str]]:
    """The package edges inside a cycle of packages."""
    packages: dict[str, set[str]] = defaultdict(set)
    for module, targets in file_imports().items():
        for target in targets:
            if package_of(module) != package_of(target):
                packages[package_of(module)].add(package_of(target))
    edges = set()
    for component in _cycles(packages):
        edges |= {(a, b) for a in component for b in packages[a] if b in component}
    return edges


def mutual_files() -> set[tuple[str, str]]:
    imports = file_imports()
    return {tuple(sorted((a, b))) for a, targets in imports.items() for b in targets if a in imports.get(b, ())}


def test_no_new_import_cycle_between_packages():
    found = cycle_edges()
    new, gone = found - KNOWN_PACKAGE_EDGES, KNOWN_PACKAGE_EDGES - found
    assert not new, f"package imports that close a cycle: {sorted(new)}"
    assert not gone, f"cycles mended: strike these from KNOWN_PACKAGE_EDGES: {sorted(gone)}"


def test_no_two_files_import_each_other():
    found = mutual_files()
    new, gone = found - KNOWN_MUTUAL_FILES, KNOWN_MUTUAL_FILES - found
    assert not new, f"files that import each other: {sorted(new)}"
    assert not gone, f"mended: strike these from KNOWN_MUTUAL_FILES: {sorted(gone)}"
