"""Issue 56's house rules, held against the source: modules stay small, the two central files smaller, the
configuration is read in config/ only, and the pack's own imports sit at the top of their modules (a lazy import
is for a heavy library, or for the one place that must follow the log diversion)."""

import ast
import re
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "src" / "fsdp_recipes"
MODULES = sorted(PKG.rglob("*.py"))
MAX_LINES = 450
CENTRAL = {"launch/launcher.py": 300, "train/entry.py": 300}
MAX_INNER_IMPORTS = 30
# the recipe read outside config/: raw YAML (`raw.get(`), single flags (config/argv.py's override and given)
RAW_READ = re.compile(r"\braw\.get\(|\boverride\(|\bgiven\(")


def rel(path: Path) -> str:
    return path.relative_to(PKG).as_posix()


def lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def inner_own_imports(path: Path) -> list[int]:
    """The lines of `import fsdp_recipes...` / `from fsdp_recipes... import` inside a function."""
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if in_function and isinstance(child, ast.ImportFrom) and (child.module or "").split(".")[0] == "fsdp_recipes":
                found.append(child.lineno)
            elif in_function and isinstance(child, ast.Import) and any(
                    a.name.split(".")[0] == "fsdp_recipes" for a in child.names):
                found.append(child.lineno)
            visit(child, inside)

    visit(ast.parse(path.read_text()), False)
    return found


def test_the_rules_catch_what_they_name(tmp_path):
    """Each check below on a made-up module that breaks it."""
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n\ndef f(raw):\n    from fsdp_recipes.config import argv\n    import fsdp_recipes.paths\n"
                   "    return raw.get('x'), argv.override([], 'k', 1)\n" + "x = 1\n" * MAX_LINES)
    assert inner_own_imports(bad) == [4, 5]
    assert len(RAW_READ.findall(bad.read_text())) == 2
    assert lines(bad) > MAX_LINES
    good = tmp_path / "good.py"
    good.write_text("from fsdp_recipes.config import argv\n\ndef f(cfg):\n    import torch\n    return cfg.raw_given\n")
    assert inner_own_imports(good) == [] and not RAW_READ.findall(good.read_text())


def test_no_module_is_over_450_lines_and_the_central_two_under_300():
    over = [f"{rel(p)}: {lines(p)} lines" for p in MODULES if lines(p) > CENTRAL.get(rel(p), MAX_LINES)]
    assert not over, over


def test_the_recipe_is_read_in_config_only():
    reads = [f"{rel(p)}:{n}: {line.strip()}" for p in MODULES if not rel(p).startswith("config/")
             for n, line in enumerate(p.read_text().splitlines(), 1) if RAW_READ.search(line)]
    assert not reads, "read the setting in config/ (config/recipes.py Recipe.early, or the parsed RunConfig):\n" + \
        "\n".join(reads)


def test_the_packs_own_imports_are_at_the_top():
    inner = [f"{rel(p)}:{n}" for p in MODULES for n in inner_own_imports(p)]
    assert len(inner) < MAX_INNER_IMPORTS, f"{len(inner)} imports of the pack inside functions: {inner}"
