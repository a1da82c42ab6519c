"""Issue 56's house rules, held against the source: modules stay small, the two central files smaller, the
configuration is read in config/ only, and the pack's own imports sit at the top of their modules (a lazy import
is for a heavy library, or for a place that must follow the log diversion)."""

import ast
import re
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "src" / "fsdp_recipes"
MODULES = sorted(PKG.rglob("*.py"))
MAX_LINES = 450
CENTRAL = {"launch/launcher.py": 300, "train/entry.py": 300}
# the pack's imports inside functions, by module, each for a reason its line gives (entry.py: after the log diversion;
# a tool's own heavy path): a new one is a decision, made here
INNER_IMPORTS = {"checkpoint/export.py": 2, "checkpoint/resume_choice.py": 3, "evaluation/scoring.py": 1,
                 "launch/ending.py": 2, "launch/output_dir.py": 4, "launch/summary.py": 1, "train/entry.py": 11,
                 "train/final_save.py": 1, "train/kinds/sft.py": 1}
# the recipe read outside config/: raw YAML (`raw.get(`), single flags (config/argv.py's override and given, and
# config/recipes.py's Recipe.field)
RAW_READ = re.compile(r"\braw\.get\(|\boverride\(|\bgiven\(|(?<!dataclasses)\.field\(")


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
                   "    return raw.get('x'), argv.override([], 'k', 1), recipe.field('min_gpus')\n" + "x = 1\n" * MAX_LINES)
    assert inner_own_imports(bad) == [4, 5]
    assert len(RAW_READ.findall(bad.read_text())) == 3
    assert lines(bad) > MAX_LINES
    good = tmp_path / "good.py"
    good.write_text("from fsdp_recipes.config import argv\n\ndef f(cfg):\n    import torch\n    return cfg.raw_given, "
                    "dataclasses.field(default=1)\n")
    assert inner_own_imports(good) == [] and not RAW_READ.findall(good.read_text())


def test_no_module_is_over_450_lines_and_the_central_two_under_300():
    over = [f"{rel(p)}: {lines(p)} lines" for p in MODULES if lines(p) > CENTRAL.get(rel(p), MAX_LINES)]
    assert not over, over


def test_the_recipe_is_read_in_config_only():
    reads = [f"{rel(p)}:{n}: {line.strip()}" for p in MODULES if not rel(p).startswith("config/")
             for n, line in enumerate(p.read_text().splitlines(), 1) if RAW_READ.search(line)]
    assert not reads, "read the setting in config/ (config/recipes.py Recipe.early, or the parsed RunConfig):\n" + \
        "\n".join(reads)


def settings_read(path: Path) -> list[tuple[int, str]]:
    """A speed option's reads of the recipe through the reader the registry hands it (`field("name", default)`):
    (line, the setting's name, a constant of the module resolved)."""
    tree = ast.parse(path.read_text())
    constants = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
                 for t in n.targets if isinstance(t, ast.Name) and isinstance(n.value, ast.Constant)}
    return [(node.lineno, node.args[0].value if isinstance(node.args[0], ast.Constant)
             else constants.get(getattr(node.args[0], "id", None), "?"))
            for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id == "field" and node.args]


def foreign_reads(path: Path, fields: tuple) -> list[tuple[int, str]]:
    return [(n, name) for n, name in settings_read(path) if name not in fields]


def test_a_speed_option_reads_its_own_settings_only(tmp_path):
    """Outside config/, the speed options read single settings (before the full parse: `make smoke`, the launcher's
    `auto`), each only of its own FIELDS; the check is shown to see a read of another's, by name or by constant."""
    import importlib

    seen, foreign = set(), {}
    for path in sorted((PKG / "speed").glob("*.py")):
        if path.stem != "__init__" and settings_read(path):
            seen.add(path.stem)
            foreign[path.stem] = foreign_reads(path, importlib.import_module(f"fsdp_recipes.speed.{path.stem}").FIELDS)
    assert seen >= {"liger", "float8", "activation_checkpointing"}, seen  # the reads are found at all
    assert not any(foreign.values()), foreign
    made_up = tmp_path / "made_up.py"
    made_up.write_text('OTHER = "float8"\n\ndef smoke(field, gpus):\n    return field("use_liger_kernel", False), '
                       'field(OTHER, False), field("float8", False)\n')
    assert foreign_reads(made_up, ("use_liger_kernel",)) == [(4, "float8"), (4, "float8")]


def test_the_packs_own_imports_are_at_the_top():
    """Issue 56: fewer than 30 in all; and none added without a line in INNER_IMPORTS."""
    inner = {rel(p): len(inner_own_imports(p)) for p in MODULES if inner_own_imports(p)}
    assert inner == INNER_IMPORTS and sum(inner.values()) < 30, inner
