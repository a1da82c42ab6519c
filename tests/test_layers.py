"""The package's folders are layers, and imports only point down (docs/architecture.md).

api.py on top (the interface for programs outside the pack), then cli/; launch/, which asks the planner; the tools
beside it (planning/, cluster/, serving/); then train/; then the rooms by concern that train/ and the tools use (evaluation/), then speed/ and data/; then checkpoint/, metrics/, config/ and
assets/; then patches/; then dist, records and paths; errors at the very bottom. A module may import its own folder
and anything below it.
"""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "src" / "fsdp_recipes"
LAYER = {
    "api": 10,  # the interface for programs outside the pack (bench/, scripts/): names from every layer
    "cli": 9,
    "launch": 8,  # above planning: it resolves what the planner decides (activation checkpointing's auto)
    "planning": 7, "cluster": 7, "serving": 7,
    "train": 6,
    "evaluation": 5,
    "speed": 4, "data": 4,
    "checkpoint": 3, "metrics": 3, "config": 3, "assets": 3,
    "patches": 2,
    "dist": 1, "records": 1, "paths": 1, "rewards": 1, "library_logs": 1, "registry": 1, "model_folders": 1,
    "decoder": 1,
    "errors": 0,
}


def part(dotted: str) -> str:
    """fsdp_recipes.<part>[.module] -> <part>"""
    return dotted.split(".")[1]


def imports(path: Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):  # lazy imports inside functions count as much as top-level ones
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fsdp_recipes."):
            yield node.lineno, node.module
        elif isinstance(node, ast.ImportFrom) and node.module == "fsdp_recipes":
            for alias in node.names:
                yield node.lineno, f"fsdp_recipes.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("fsdp_recipes."):
                    yield node.lineno, alias.name


def test_every_module_has_a_layer():
    tops = {p.stem if p.is_file() else p.name for p in PKG.iterdir()
            if (p.suffix == ".py" and p.stem != "__init__") or (p.is_dir() and (p / "__init__.py").exists())}
    assert tops == set(LAYER), "new top-level module or folder: give it a layer here and in docs/architecture.md"


def test_imports_only_point_down():
    upward = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG)
        here = rel.parts[0] if len(rel.parts) > 1 else rel.stem
        if here == "__init__":
            continue
        for lineno, module in imports(path):
            there = part(module)
            if there != here and LAYER[there] >= LAYER[here]:
                upward.append(f"{rel}:{lineno} imports {module} ({there}, layer {LAYER[there]} >= {LAYER[here]})")
    assert not upward, "\n".join(upward)


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm): each is an import circle."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while (w := stack.pop()) != v:
                on_stack.discard(w)
                group.append(w)
            on_stack.discard(v)
            if group:
                found.append(sorted([v, *group]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def imported_modules(path: Path, names: dict):
    """The pack's modules that `path` imports: `from fsdp_recipes.x import y` is the module x.y where there is one
    (a submodule), else x."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "fsdp_recipes":
            for alias in node.names:
                yield f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in names else node.module
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.split(".")[0] == "fsdp_recipes")


def test_circles_are_found():
    """The check below, on a made-up graph: a circle through a lazy import is one."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle():
    """No two modules import each other, directly or through others, counting imports inside functions (which hide a
    circle from Python, not from the reader). A folder's __init__ is the folder's face: importing a module of a
    folder does not count as importing its __init__."""
    names = {module_name(p): p for p in PKG.rglob("*.py")}
    graph = {name: set(imported_modules(path, names)) - {name} for name, path in names.items()}
    assert not circles(graph), circles(graph)
