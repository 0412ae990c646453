"""The house's rules, checked from the source alone (nothing is imported or run):

- the algorithm (specdec.sampling) imports no engine (specdec.engines);
- the drafters (specdec.drafters) import neither an engine nor the sampler: they reach the engine's fast paths through
  the DraftContext the sampler hands them;
- no import circle between modules, and none between packages (an arrow back up).

    python -m specdec.layout_check      # exit 1 and one line per broken rule, else one line saying all hold

Every import counts, those inside functions too: a circle that only a late import breaks is still a circle."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
FORBIDDEN = {  # package -> the packages its modules may not import
    "specdec.sampling": ("specdec.engines",),
    "specdec.drafters": ("specdec.engines", "specdec.sampling"),
}


def modules(root: Path = ROOT) -> dict[str, Path]:
    """specdec's modules by dotted name (a package by its own name, for its __init__)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = ["specdec", *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The specdec modules that module `name` imports (`from pkg import mod` counts as importing pkg.mod)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package up
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            for a in node.names:
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base)
    return {m for m in found if m in known and m != name}


def package_of(module: str, known: dict[str, Path]) -> str:
    """The package a module belongs to: itself for a package, else its parent."""
    return module if known[module].name == "__init__.py" else module.rpartition(".")[0]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                out.append(sorted(scc))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def problems(root: Path = ROOT) -> list[str]:
    known = modules(root)
    graph = {name: imports(name, path, known) for name, path in known.items()}
    out = []
    for name, deps in sorted(graph.items()):
        for package, banned in FORBIDDEN.items():
            if name == package or name.startswith(package + "."):
                for dep in sorted(deps):
                    if any(dep == b or dep.startswith(b + ".") for b in banned):
                        out.append(f"{name} imports {dep}: {package} may not import {', '.join(banned)}")
    out += [f"import circle: {' -> '.join(c)}" for c in cycles(graph)]
    # packages: an edge where a module of one imports a module of another (a package's __init__ is its own; a
    # module importing its own subpackage is no arrow back up)
    pkg_graph: dict[str, set[str]] = {}
    for name, deps in graph.items():
        src = package_of(name, known)
        for dep in deps:
            dst = package_of(dep, known)
            if dst != src and not dst.startswith(src + ".") and not src.startswith(dst + "."):
                pkg_graph.setdefault(src, set()).add(dst)
    out += [f"package circle: {' <-> '.join(c)}" for c in cycles(pkg_graph)]
    return out


def main() -> int:
    found = problems()
    for line in found:
        print(line)
    if not found:
        print(f"layout: {len(modules())} modules; the algorithm and the drafters import no engine, no import circles")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
