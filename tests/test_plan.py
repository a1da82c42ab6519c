"""`make plan`: the memory estimate against what a real 2-process run holds, the topology rules, bad input."""

import json
import subprocess
import sys

import pytest
import yaml

from conftest import REPO, launch
from fsdp_recipes.config import model_check, recipes
from fsdp_recipes.config.run_config import parse_args
from fsdp_recipes.planning import memory_budget, plan

RECIPES = recipes.available(REPO / "recipes")


def run_plan(*args):
    return subprocess.run([sys.executable, "-m", "fsdp_recipes.planning.plan", *args], cwd=REPO, capture_output=True, text=True)


@pytest.mark.slow
def test_estimate_matches_what_a_tiny_fsdp_run_holds(tmp_path, cache_dir):
    """The budget's components against memory_probe's measurement on each of 2 FSDP2 ranks."""
    out = tmp_path / "run"
    res = launch(["tiny-cpu-lora", "--max_steps", "2", "--measure_memory", "true", "--eval_strategy", "no",
                  "--save_merged_model", "false", "--output_dir", str(out)], cache_dir)
    assert res.returncode == 0, res.stderr[-3000:]
    measured = [json.loads((out / f"memory_probe.rank{r}.json").read_text()) for r in (0, 1)]

    cfg = parse_args(["--config", str(REPO / "recipes/tiny-cpu-lora/sft.yaml")])
    training, model_args = cfg.training, cfg.model
    config = model_check.load_config(cache_dir / "tiny-mistral" / "config.json")
    shape = memory_budget.shape_of(model_check.meta_model(config), model_args)
    acc = {"distributed_type": "FSDP", "mixed_precision": "no"}
    errors = {}
    for rank, probe in enumerate(measured):
        setup = plan.setups(acc, training, model_args, gpus=2, nodes=1, on_cpu=True)["FSDP"]
        setup.tokens = probe["tokens_per_micro_batch"]  # the estimate's worst case is max_length; use the real batch
        estimate = memory_budget.budget(shape, setup)
        for part in ("weights", "gradients", "optimizer_states", "activations"):
            errors[(rank, part)] = estimate[part] / probe[part] - 1
    (tmp_path / "errors.json").write_text(json.dumps({f"{r}:{p}": e for (r, p), e in errors.items()}))
    print({k: f"{v:+.1%}" for k, v in errors.items()})
    for (rank, part), err in errors.items():
        # Sharded states: exact up to FSDP's padding of uneven shards. Activations: the counted model.
        limit = 0.02 if part != "activations" else 0.10
        assert abs(err) <= limit, f"rank {rank} {part}: estimate off by {err:+.1%}"


@pytest.mark.parametrize("name", [r for r in RECIPES if r != "tiny-cpu-lora"])
def test_every_recipe_fits_its_own_hardware(name):
    """Each GPU recipe, on the hardware its README names, plans as fitting (exit 0) and reports a budget."""
    gpu = yaml.safe_load((REPO / "accelerate_configs" / "recipes.yaml").read_text())[name].get("gpu", "H100")
    report = plan.budget_markdown(name, REPO / "recipes", gpu)
    assert "fits:" in report and "| **total** |" in report and "global batch" in report


def test_plan_refuses_what_does_not_fit():
    res = run_plan("mistral-7b-full", "--gpus", "1", "--gpu", "H100")
    assert res.returncode == 1
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: recipe mistral-7b-full does not fit"), res.stderr
    assert "| optimizer states |" in res.stdout  # the budget that explains why


def test_sharding_divides_the_states():
    one, eight = (plan.plan("mistral-7b-full", g, 1, "H200")[2][1] for g in (1, 8))
    assert eight < one / 3


@pytest.mark.parametrize("args, message", [
    (["nope"], "unknown recipe 'nope'"),
    (["mistral-7b-full", "--gpu", "K80"], "unknown GPU 'K80'"),
    (["mistral-7b-full", "--gpu", "V100"], "does not support"),
    (["mistral-large-hsdp", "--gpus", "8", "--nodes", "1"], "NODES=1"),
    (["mistral-large-hsdp", "--gpus", "4", "--nodes", "4"], "does not fit inside a node of 4"),
    (["ddp-baseline", "--gpus", "0"], "must be at least 1"),
])
def test_bad_input_is_one_line(args, message):
    res = run_plan(*args)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "Traceback" not in res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], res.stderr


def test_make_plan_runs_the_planner():
    res = subprocess.run(["make", "--no-print-directory", "plan", "RECIPE=ddp-baseline", "GPUS=8", "GPU=H200"],
                         cwd=REPO, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "decision rule" in res.stdout and "DDP" in res.stdout
