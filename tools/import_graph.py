"""The import graph of rollflow's own packages (flows, stages, schemas), read from the source with ``ast``.

Every ``import`` / ``from ... import`` statement counts, wherever it is: at module top, inside a function, under
``if TYPE_CHECKING`` (a circle through type hints is still a circle for the reader). An edge goes from the importing
module to the module it names; ``from pkg import name`` goes to ``pkg.name`` where that is a module, else to ``pkg``.
Importing ``a.b.c`` also runs ``a`` and ``a.b``, but those package edges are left out: an ``__init__`` that only
marks a package would otherwise put every sub-module in one circle with it.

    python tools/import_graph.py                  # the strongly connected components (circles), one per line
    python tools/import_graph.py --deferred       # the function-level imports of our own modules and the rest
    python tools/import_graph.py --count          # how many imports of our own modules sit inside functions

Standard library only.
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("flows", "stages", "schemas")


@dataclass(frozen=True)
class Import:
    """One import statement's target: ``source`` (the importing module) imports ``target`` at ``line``;
    ``deferred`` when the statement sits inside a function body."""

    source: str
    target: str
    line: int
    deferred: bool


def module_files(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    """Dotted module name -> its file, for every ``.py`` file under ``packages`` (``__init__`` is the package)."""
    files = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            files[".".join(parts)] = path
    return files


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module a ``from`` statement names (relative levels resolved against ``module``)."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _statements(tree: ast.AST):
    """Each import statement of ``tree`` with whether it sits inside a function (or lambda)."""
    def walk(node: ast.AST, in_function: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, in_function
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            yield from walk(child, inner)
    yield from walk(tree, False)


def imports(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> list[Import]:
    """Every import statement's targets in ``packages``, own modules and third-party ones alike."""
    files = module_files(root, packages)
    found = []
    for module, path in files.items():
        is_package = path.name == "__init__.py"
        for node, deferred in _statements(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = _absolute(module, is_package, node)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            found += [Import(module, t, node.lineno, deferred) for t in dict.fromkeys(targets)]
    return found


def own_edges(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    """The graph of our own modules: module -> the own modules it imports (the longest known prefix of a target)."""
    files = module_files(root, packages)
    graph: dict[str, set[str]] = {m: set() for m in files}
    for imp in imports(root, packages):
        target = _own_module(imp.target, files)
        if target and target != imp.source:
            graph[imp.source].add(target)
    return graph


def _own_module(name: str, files: dict[str, Path]) -> str | None:
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in files:
            return ".".join(parts[:end])
    return None


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative: the components of more than one module (and modules importing themselves),
    each sorted, the list sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph.get(node, ()):
                    found.append(sorted(component))
    return sorted(found)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deferred", action="store_true", help="list the function-level imports")
    parser.add_argument("--count", action="store_true", help="count the imports of our own modules")
    args = parser.parse_args(argv)
    files = module_files()
    if args.deferred:
        for imp in imports():
            if imp.deferred:
                print(f"{imp.source}:{imp.line}: {imp.target}")
        return 0
    if args.count:
        own = [imp for imp in imports() if _own_module(imp.target, files)]
        print(f"{sum(imp.deferred for imp in own)} of {len(own)} imports of our own modules sit inside functions; "
              f"{sum(imp.deferred for imp in imports())} function-level imports in all")
        return 0
    components = strongly_connected(own_edges())
    for component in components:
        print(" <-> ".join(component))
    print(f"{len(components)} import circle(s)", file=sys.stderr)
    return 1 if components else 0


if __name__ == "__main__":
    sys.exit(main())
