"""The import graph, drawn from the code: modules import down the layers, never up, and no two modules import each
other (directly or around a circle, counting imports inside functions). ``docs/architecture.md`` shows the
graph this file derives (``python tests/test_architecture.py`` prints it)."""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"qspec": ROOT / "qspec", "qspec_cli": ROOT / "cli"}
MAX_LINES = 450
# Bottom to top; a module imports its own layer or the ones below. The first prefix that matches places it.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "base",
        (
            "qspec",
            "qspec.errors",
            "qspec.common",
            "qspec.contract",
            "qspec.ccl",
            "qspec.onnx_files",
            "qspec.prompts",
            "qspec.specializations",
            "qspec.spec_file",
        ),
    ),  # fmt: skip
    ("records", ("qspec.backend_records", "qspec.package", "qspec.head_manifest")),
    ("export", ("qspec.export",)),
    ("backends", ("qspec.backends",)),  # each target's tools: graph rewrites, sessions, the vendor's files
    ("runtime", ("qspec.runtime",)),
    # The compile-side seam (a backend checks a head's graph with the runtime's proposer feeds).
    (
        "compile backends",
        ("qspec.backends.base", "qspec.backends.registry", "qspec.backends.ort_compile", "qspec.backends.qaic_compile"),
    ),  # fmt: skip
    ("heads", ("qspec.heads",)),
    ("compile", ("qspec.compile", "qspec.package_info", "qspec.quality")),
    ("apps", ("qspec.bench", "qspec.serve")),
    ("cli", ("qspec_cli", "qspec.__main__")),
]


def modules() -> dict[str, Path]:
    """Every module of the two packages by dotted name."""
    found = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = [package, *path.relative_to(folder).with_suffix("").parts]
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imported(node: ast.AST, known: dict[str, Path]) -> list[str]:
    """The project modules one import statement loads (``from a import b``: ``a.b`` when it is a module)."""

    def owner(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    if isinstance(node, ast.Import):
        names = [owner(alias.name) for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        names = [
            f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else owner(node.module) for a in node.names
        ]
    else:
        return []
    return [name for name in names if name is not None]


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports when it runs (at the top or inside a function; an
    ``if TYPE_CHECKING:`` block is for the type checker and left out)."""
    known = modules()
    graph: dict[str, set[str]] = defaultdict(set)

    def walk(module: str, node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            graph[module].update(name for name in _imported(child, known) if name != module)
            walk(module, child)

    for module, path in known.items():
        graph[module]  # noqa: B018  (every module is a node, importing or not)
        walk(module, ast.parse(path.read_text()))
    return dict(graph)


def layer_of(module: str) -> int:
    """The index in :data:`LAYERS` of the longest prefix naming ``module`` (a package covers its submodules)."""
    best, index = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, index = len(prefix), i
    assert index is not None, f"{module} is in no layer of tests/test_architecture.py: add it to LAYERS"
    return index


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected sets of two modules or more (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            step = next(edges, None)
            if step is not None:
                if step not in index:
                    index[step] = low[step] = len(index)
                    stack.append(step)
                    on_stack.add(step)
                    work.append((step, iter(sorted(graph.get(step, ())))))
                elif step in on_stack:
                    low[node] = min(low[node], index[step])
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
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def layer_graph() -> dict[str, set[str]]:
    """Layer -> the lower layers it imports: the drawing in ``docs/architecture.md``."""
    graph = import_graph()
    drawn: dict[str, set[str]] = {name: set() for name, _ in LAYERS}
    for module, targets in graph.items():
        for target in targets:
            if layer_of(target) != layer_of(module):
                drawn[LAYERS[layer_of(module)][0]].add(LAYERS[layer_of(target)][0])
    return drawn


def render() -> str:
    """The layer graph as the lines ``docs/architecture.md`` shows, top layer first."""
    order = [name for name, _ in LAYERS]
    drawn = layer_graph()
    lines = []
    for name, prefixes in reversed(LAYERS):
        below = sorted(drawn[name], key=order.index, reverse=True)
        modules_ = ", ".join(prefix.removeprefix("qspec.") for prefix in prefixes)
        lines.append(f"{name:<16} ({modules_}) -> {', '.join(below) or '-'}")
    return "\n".join(lines)


def test_no_import_circle():
    """No module imports itself around a circle, imports inside functions included (they are for heavy optional
    dependencies, never to hide a cycle)."""
    assert circles(import_graph()) == []


def test_imports_run_down_the_layers():
    """Every import goes to the importer's own layer or one below (the package layer never imports a backend,
    the runtime never the compile side)."""
    upward = [
        f"{module} -> {target}"
        for module, targets in sorted(import_graph().items())
        for target in sorted(targets)
        if layer_of(target) > layer_of(module)
    ]
    assert upward == []


def test_modules_stay_short():
    """Every module is under MAX_LINES lines (a longer one is several concerns)."""
    long = {
        str(p.relative_to(ROOT)): n for p in modules().values() if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}


def test_the_docs_draw_this_graph():
    """``docs/architecture.md`` holds the layer graph as this file derives it."""
    assert render() in (ROOT / "docs" / "architecture.md").read_text()


if __name__ == "__main__":
    sys.stdout.write(render() + "\n")
