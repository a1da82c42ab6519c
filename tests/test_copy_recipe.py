"""A recipe folder copied into an empty directory runs from there with the pack installed as a package."""

import json
import shutil
import subprocess
from importlib.metadata import version

import pytest

from conftest import REPO, pack_env

pytestmark = pytest.mark.slow


def test_copied_recipe_folder_runs(tmp_path, cache_dir):
    project = tmp_path / "elsewhere"
    project.mkdir()
    shutil.copytree(REPO / "recipes" / "tiny-cpu-lora", project / "my-recipe")
    res = subprocess.run(
        ["bash", "my-recipe/launch.sh", "--max_steps", "4", "--eval_strategy", "no", "--save_merged_model", "false"],
        cwd=project, env=pack_env(cache_dir), capture_output=True, text=True, timeout=600,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    run = project / "runs" / "tiny-cpu-lora"  # output_dir is relative to where it was launched
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["status"] == "completed" and metrics["steps"] == 4 and metrics["world_size"] == 2
    assert (run / "adapter_model.safetensors").is_file()
    # nothing of the repository is in the project: the code came from the installed distribution
    assert sorted(p.name for p in project.iterdir()) == ["my-recipe", "runs"]
    assert json.loads((run / "run_args.json").read_text())["versions"]["fsdp-recipes"] == version("fsdp-recipes")
