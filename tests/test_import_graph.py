"""No import circles among our own modules (tools/import_graph.py): the graph counts every import statement,
function-level ones included, so a circle cannot hide inside a function."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
try:
    import import_graph
finally:
    sys.path.remove(str(ROOT / "tools"))


def test_no_import_circles():
    circles = import_graph.strongly_connected(import_graph.own_edges())
    assert not circles, "import circles (tools/import_graph.py): " + "; ".join(" <-> ".join(c) for c in circles)


def test_a_circle_through_a_function_level_import_is_found(tmp_path):
    """A plants ``import b`` at module top, b ``from a import x`` inside a function: one component {a, b}; the
    package edge of ``p/__init__`` is not one."""
    package = tmp_path / "p"
    package.mkdir()
    (package / "__init__.py").write_text("from p import a\n")
    (package / "a.py").write_text("from p import b\nx = 1\n")
    (package / "b.py").write_text("def f():\n    from .a import x\n    return x\n")
    (package / "c.py").write_text("import p.a\n")
    graph = import_graph.own_edges(tmp_path, ("p",))
    assert graph == {"p": {"p.a"}, "p.a": {"p.b"}, "p.b": {"p.a"}, "p.c": {"p.a"}}
    assert import_graph.strongly_connected(graph) == [["p.a", "p.b"]]
    deferred = [(i.source, i.target) for i in import_graph.imports(tmp_path, ("p",)) if i.deferred]
    assert deferred == [("p.b", "p.a")]


# Function-level imports of our own modules, at most: the CLI's commands (flows/cli: `rollflow --help` loads no
# pydantic, pyarrow, Prefect or Ray), the pipelines' flows (flows/pipelines.py: a config error before Prefect loads),
# the kept training workers (flows/runkit.py KeptWorkers) and the modules of
# stages/train that load torch, the model check that loads transformers, and the reward workers' ragged arrays
# (CONTRIBUTING.md, imports). Lower it when you move one to module top; a new one needs a reason of that kind.
MAX_DEFERRED_OWN = 100


def test_function_level_imports_of_our_own_modules_do_not_grow_back():
    files = import_graph.module_files()
    deferred = [i for i in import_graph.imports() if i.deferred and import_graph._own_module(i.target, files)]
    assert len(deferred) <= MAX_DEFERRED_OWN, (
        f"{len(deferred)} imports of our own modules sit inside functions (at most {MAX_DEFERRED_OWN}); move the new "
        "ones to module top (python tools/import_graph.py --deferred lists them): "
        + ", ".join(f"{i.source}:{i.line} {i.target}" for i in deferred[-5:]))
