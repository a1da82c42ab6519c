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
