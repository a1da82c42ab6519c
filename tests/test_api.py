"""fsdp_recipes.api, the pack's interface for programs outside it (docs/api.md): every row resolves, importing it
costs nothing, and bench/ and scripts/ reach the pack through it only."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_recipes import api

REPO = Path(__file__).resolve().parent.parent
OUTSIDE = ("bench", "scripts")  # programs that use the pack as a user's program would


def pack_imports(source: str) -> list[tuple[int, str]]:
    """(line, module) of every import of the pack other than fsdp_recipes.api, nested ones included."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "fsdp_recipes":
            names = [f"{node.module}.{a.name}" for a in node.names] if node.module == "fsdp_recipes" else [node.module]
            found += [(node.lineno, n) for n in names if n != "fsdp_recipes.api"]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names
                      if a.name.split(".")[0] == "fsdp_recipes" and a.name != "fsdp_recipes.api"]
    return found


def test_every_row_resolves_to_what_it_names():
    for name, target in api.EXPORTS.items():
        value = getattr(api, name)
        module, _, attribute = target.partition(":")
        assert value is sys.modules[module] if not attribute else value is getattr(sys.modules[module], attribute), name
    assert sorted(dir(api)) == sorted(api.EXPORTS)
    with pytest.raises(AttributeError, match="no 'trainer'"):
        api.trainer  # noqa: B018


def test_it_names_things_not_modules():
    """A module row would hand out everything inside it, and the interface would be the package again; the one
    exception is data.loading, whose load_for bench/data.py wraps to time it."""
    assert [name for name, target in api.EXPORTS.items() if ":" not in target] == ["data_loading"]


def test_importing_it_imports_neither_torch_nor_the_rest_of_the_pack():
    code = ("import sys, fsdp_recipes.api; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('fsdp_recipes.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['fsdp_recipes.api']"


def test_bench_and_scripts_import_the_pack_through_the_api_only():
    assert pack_imports("from fsdp_recipes.train.build import trainer_for\nfrom fsdp_recipes import speed\n"
                        "def f():\n    import fsdp_recipes.config.recipes\n") == [
        (1, "fsdp_recipes.train.build"), (2, "fsdp_recipes.speed"), (4, "fsdp_recipes.config.recipes")]
    inside = [f"{path.relative_to(REPO)}:{line} imports {module}"
              for folder in OUTSIDE for path in sorted((REPO / folder).rglob("*.py"))
              for line, module in pack_imports(path.read_text())]
    assert not inside, "use fsdp_recipes.api (add a row there if a program needs more):\n" + "\n".join(inside)
