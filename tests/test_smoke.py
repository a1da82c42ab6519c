"""`make smoke RECIPE=<any>`: every recipe's own accelerate YAML, SFT config and launch path on CPU, with a tiny
model of its architecture; and the mistakes it must catch before the cluster does."""

import json
import shutil
import subprocess

import pytest
import yaml

from conftest import REPO, RanksWouldStart, launch, launcher_checks, launcher_until_ranks, pack_env, qlora_site
from fsdp_recipes.config import recipes
from fsdp_recipes.config.model_check import load_config

RECIPES = recipes.available(REPO / "recipes")


# `make smoke` itself for the README's recipe (and an unknown one); the others through what it runs, the launcher
# with FSDP_RECIPES_SMOKE=1 (launch.sh's launcher, forked by conftest.launch: ~9 CPU-seconds of imports less each)
THROUGH_MAKE = {"mistral-small-lora", "nope"}


def smoke(recipe: str, cache, out, *args, timeout=600):
    if recipe not in THROUGH_MAKE:
        return launch([recipe, "--output_dir", str(out), *args], cache, timeout=timeout, FSDP_RECIPES_SMOKE="1")
    argv = " ".join(["--output_dir", str(out), *args])
    return subprocess.run(["make", "--no-print-directory", "smoke", f"RECIPE={recipe}", f"ARGS={argv}"], cwd=REPO,
                          env=pack_env(cache), capture_output=True, text=True, timeout=timeout)


def expected_layout(acc: dict) -> tuple[int, str]:
    """(world size, sharding strategy) the smoke run must report for this recipe's accelerate YAML."""
    if acc["distributed_type"] == "MULTI_GPU":
        return 2, "DDP"
    replicate = (acc.get("parallelism_config") or {}).get("parallelism_config_dp_replicate_size", 1)
    if (acc.get("parallelism_config") or {}).get("parallelism_config_tp_size", 1) > 1:  # kept as tp 2 on 2 processes
        return 2, "TENSOR_PARALLEL (tp 2 x dp_shard 1, by transformers"
    if replicate > 1:
        return 4, "HYBRID_SHARD (replicate 2 x shard 2)"
    if acc["fsdp_config"].get("fsdp_reshard_after_forward") is False:  # FSDP2 keeping layers gathered until backward
        return 2, "SHARD_GRAD_OP"
    return 2, "FULL_SHARD"


# tiny-cpu-lora's smoke run would be its own run, 3 steps long: it has no model_config.json (its model already is
# the tiny one) and already runs on 2 CPU processes, which the next test checks; tests/test_end_to_end.py launches it
# in full. Two more are not launched here because another launch takes the same path, which
# test_smoke_checks_of_the_recipes_another_launch_covers checks: smollm2-135m-lora (tests/test_default_recipe.py
# runs it for real, with its own model, on the same 2 CPU processes) and mistral-small-lora-2xh200 (generated from
# mistral-small-lora: its smoke run differs from that one's only in batch size and accumulation), and
# llama-3.1-8b-lora, whose smoke run tests/test_default_recipe.py runs from a folder copied into another project.
# Every other recipe's smoke run is its only launch in CI. llama-3.1-70b-full-tp's (tp 2 over its 2 processes, ~35 s
# of training) is the suite's one launch of a tensor-parallel mesh through the launcher, the Trainer's checkpoints and
# the tp final save (tests/test_tensor_parallel.py forks its ranks and drives the model itself).
# DPO: smollm2-135m-dpo runs for real in tests/test_default_recipe.py (after the default, with the real model);
# qwen3-8b-full-dpo's smoke run is tests/test_preemption.py's DPO run (straight, preempted and resumed), and
# llama-3.1-8b-lora-dpo's is tests/test_slurm.py's one-node sbatch job.
# GRPO: smollm2-135m-grpo runs for real in tests/test_default_recipe.py, and llama-3.1-8b-lora-grpo's smoke run is
# tests/test_preemption.py's sampling-kind run (straight, preempted and resumed).
# KTO, RLOO: llama-3.1-8b-lora-kto's and -rloo's smoke runs are tests/test_preemption.py's KTO and sampling-kind runs.
# smollm2-135m-kto and -rloo are checked below in process up to the ranks: their kinds run in those launches, their
# accelerate YAML and SFT-run chain in smollm2-135m-dpo's and -grpo's real runs (tests/test_default_recipe.py), and
# the demos themselves were measured in full (bench/README.md "KTO and RLOO on the default"); a real-model launch
# each would add about 150 s to the suite's longest file.
# QLoRA: each 4-bit recipe's smoke run would be that of a bf16 LoRA recipe launched elsewhere in 4 bits. Its accelerate
# YAML, scaled, is that recipe's (below: llama-3.1-8b-lora's, launched in tests/test_default_recipe.py;
# mistral-7b-full's and smollm2-135m-lora's), its tiny model is its twin's (the tiny model keeps the architecture
# only: Llama 3.1 70B's and 8B's are one model, Mistral Large's is mistral-large-hsdp's, launched here), and its
# trainer YAML differs from its twin's only in the fields named in TWINS. The 4-bit path itself launches in
# tests/test_qlora.py: 2 CPU processes, FSDP2, float32 storage, checkpoints, an exact resume and the merged model.
# Mixture of experts (qwen3-30b-a3b-lora, -full, mixtral-8x7b-lora): checked below in process up to the ranks (their
# tiny Qwen3-MoE and Mixtral models are built and every launcher check passes); what their ranks would do on that tiny
# model runs in process in tests/test_moe.py (the pack's SFT trainer with the load-balancing loss, the expert load, 2
# steps with checkpointing), and under FSDP2 on 2 processes in tests/test_moe_fsdp2.py's one launch (both families,
# LoRA on the experts and in full, a resume each, ~45 s). A launch each would add ~60 s of both cores to the suite.
# The bf16 storage these GPU recipes get is checked in process only (the storage rule, tests/test_qlora.py) and was
# smoke-run by hand (the recipes' READMEs); on CUDA, the GPU plan's launch step smokes every recipe.
COVERED_ELSEWHERE = {"smollm2-135m-lora": "smollm2-135m-lora", "mistral-small-lora-2xh200": "mistral-small-lora",
                     "llama-3.1-70b-qlora-2xh100": "llama-3.1-8b-lora", "llama-3.1-70b-qlora-4x24gb": "llama-3.1-8b-lora",
                     "mistral-large-qlora-4xh100": "mistral-7b-full", "smollm2-135m-qlora": "smollm2-135m-lora",
                     "llama-3.1-8b-lora": "llama-3.1-8b-lora",
                     "smollm2-135m-dpo": "smollm2-135m-dpo", "qwen3-8b-full-dpo": "qwen3-8b-full-dpo",
                     "llama-3.1-8b-lora-dpo": "llama-3.1-8b-lora-dpo",
                     "smollm2-135m-grpo": "smollm2-135m-grpo", "llama-3.1-8b-lora-grpo": "llama-3.1-8b-lora-grpo",
                     "smollm2-135m-rloo": "smollm2-135m-rloo", "llama-3.1-8b-lora-rloo": "llama-3.1-8b-lora-rloo",
                     "smollm2-135m-kto": "smollm2-135m-kto", "llama-3.1-8b-lora-kto": "llama-3.1-8b-lora-kto",
                     "qwen3-30b-a3b-lora": "qwen3-30b-a3b-lora", "qwen3-30b-a3b-full": "qwen3-30b-a3b-full",
                     "mixtral-8x7b-lora": "mixtral-8x7b-lora",
                     # issue 60's long rows: llama-3.1-8b-lora's launch at another max_length; the 128k recipe's
                     # smoke run adds cp 2 over its 2 processes, which no CI test launches: tests/
                     # test_context_parallel.py runs one hand-written training step with cp 2 on 2 gloo ranks (the
                     # Trainer's inputs, accelerate's mask hooks, the all-to-all form) against one process, and
                     # tiny-cpu-lora with cp 2 was launched by hand (docs/training.md, "Long sequences")
                     "llama-3.1-8b-lora-32k": "llama-3.1-8b-lora", "llama-3.1-8b-lora-128k": "llama-3.1-8b-lora"}
CP_SMOKE = {"llama-3.1-8b-lora-128k": {"parallelism_config_dp_shard_size": 1, "parallelism_config_cp_size": 2}}
SMOKED = [name for name in RECIPES if name != "tiny-cpu-lora" and name not in COVERED_ELSEWHERE]
# recipe -> (the recipe whose trainer YAML and tiny model it shares, the fields in which its trainer YAML differs),
# where that is not COVERED_ELSEWHERE's own launch
BATCH = {"recipe_name", "min_gpus", "output_dir", "per_device_train_batch_size", "per_device_eval_batch_size",
         "gradient_accumulation_steps"}
FOUR_BIT = {"load_in_4bit", "bnb_4bit_quant_type", "use_bnb_nested_quant"}
# issue 57: each recipe's micro-batch chosen for speed; the variants at the same 1 per GPU as their twins differ in
# accumulation only, the 4-bit Mistral Large takes 2 per GPU where its bf16 twin takes 1
SAME_MICRO_BATCH = BATCH - {"per_device_train_batch_size"}
TWINS = {"mistral-small-lora-2xh200": ("mistral-small-lora", SAME_MICRO_BATCH),
         "llama-3.1-70b-qlora-2xh100": ("llama-3.1-8b-lora",
                                        BATCH | FOUR_BIT | {"model_name_or_path", "save_merged_model", "learning_rate"}),
         "llama-3.1-70b-qlora-4x24gb": ("llama-3.1-8b-lora", SAME_MICRO_BATCH | FOUR_BIT | {
             "model_name_or_path", "save_merged_model", "learning_rate", "max_length"}),
         "mistral-large-qlora-4xh100": ("mistral-large-hsdp", {"recipe_name", "min_gpus", "output_dir",
                                                              "per_device_train_batch_size",
                                                              "gradient_accumulation_steps"} | FOUR_BIT),
         "llama-3.1-8b-lora-32k": ("llama-3.1-8b-lora", SAME_MICRO_BATCH - {"min_gpus"} | {"max_length"}),
         "llama-3.1-8b-lora-128k": ("llama-3.1-8b-lora", SAME_MICRO_BATCH - {"min_gpus"} | {"max_length",
                                                                                         "pad_to_multiple_of"}),
         "smollm2-135m-qlora": ("smollm2-135m-lora", {"recipe_name", "output_dir", "load_in_4bit",
                                                      "bnb_4bit_quant_type"})}


def test_the_tiny_recipes_smoke_run_would_be_its_own_run():
    from fsdp_recipes.launch import smoke as smoke_module

    folder = REPO / "recipes" / "tiny-cpu-lora"
    acc = yaml.safe_load((folder / "accelerate.yaml").read_text())
    assert not (folder / "model_config.json").exists()
    assert yaml.safe_load((folder / "sft.yaml").read_text())["tiny_assets"] is True
    scaled = smoke_module.scale_accelerate(acc)
    assert (acc["num_processes"], acc["distributed_type"]) == (2, "FSDP")
    assert {k: scaled[k] for k in acc} == acc  # scaling changes nothing it has


def test_the_smoke_runs_line_says_what_will_run(cache_dir, tmp_path, capsys):
    """`make smoke RECIPE=mistral-small-lora ARGS="--max_steps 2"` said "run: 3 steps with a checkpoint at step 2"
    and trained 2: the line says the overrides the run takes (the user's last, winning), and that the recipe's gates
    are not judged on a smoke run (it printed "gate MFU 0.0%, gate >= 40% (mfu_min): FAIL" at the end)."""
    from fsdp_recipes.launch import smoke as smoke_module

    recipe = recipes.load("mistral-small-lora", ["--max_steps", "2", "--output_dir", str(tmp_path / "run")])
    smoke_module.prepare(recipe)
    out = capsys.readouterr().out
    assert f"[smoke] run: 2 step(s) (yours), a checkpoint every 2 step(s), in {tmp_path / 'run'} (yours)\n" in out
    assert "[smoke] gates (mfu_min, peak_memory_max_fraction): not judged on a smoke run" in out
    assert recipe.field("max_steps") == "2"  # what the line says is what the ranks get
    recipe = recipes.load("tiny-cpu-lora", [])
    smoke_module.prepare(recipe)
    out = capsys.readouterr().out
    assert "[smoke] run: 3 step(s), a checkpoint every 2 step(s), in runs/smoke/tiny-cpu-lora\n" in out
    assert "gates" not in out  # the recipe sets none


@pytest.mark.slow
@pytest.mark.parametrize("name", SMOKED)
def test_smoke_every_recipe(name, cache_dir, tmp_path):
    out = tmp_path / "run"
    res = smoke(name, cache_dir, out)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    metrics = json.loads((out / "metrics.json").read_text())
    acc = yaml.safe_load((REPO / "recipes" / name / "accelerate.yaml").read_text())
    world, strategy = expected_layout(acc)
    assert metrics["status"] == "completed" and metrics["steps"] == 3
    assert metrics["world_size"] == world
    assert metrics["sharding_strategy"].startswith(strategy), metrics["sharding_strategy"]
    if strategy.startswith("TENSOR_PARALLEL"):  # tp 2 alone: transformers shards, no FSDP (train/tensor_parallel.py)
        assert metrics["mesh"]["tp"] == 2 and metrics["fsdp_version"] is None
        ran = json.loads((out / "run_args.json").read_text())["speed_options"]["activation_checkpointing"]
        assert ran["policy"] == "full"  # the Trainer's checkpointing beside tp (auto without GPUs)
    elif acc["distributed_type"] == "FSDP":
        assert metrics["fsdp_version"] == acc["fsdp_config"]["fsdp_version"]
    assert metrics["final_save_check"]["tensors"] > 0  # the final save was complete and checked
    assert (out / "checkpoint-2").is_dir()
    shipped = REPO / "recipes" / name / "model_config.json"
    if shipped.exists():  # the tiny model has the real model's architecture
        tiny = json.loads((cache_dir / "smoke" / name / "config.json").read_text())
        real = json.loads(shipped.read_text())
        assert tiny["architectures"] == real["architectures"] and tiny["model_type"] == real["model_type"]
        assert tiny["num_hidden_layers"] == 2 < real["num_hidden_layers"]


@pytest.mark.parametrize("name", sorted(COVERED_ELSEWHERE))
def test_smoke_checks_of_the_recipes_another_launch_covers(name, cache_dir, tmp_path, monkeypatch, capsys):
    """Their smoke runs in this process up to the start of the ranks: the tiny model of their architecture is built
    and every launcher check passes; the accelerate YAML the ranks would get is the one the covering launch runs,
    and the recipes differ in nothing else but the fields named (batch size and accumulation, for the variant)."""
    from fsdp_recipes.launch import smoke as smoke_module

    monkeypatch.setenv("FSDP_RECIPES_SMOKE", "1")
    if name in TWINS and FOUR_BIT & TWINS[name][1]:  # the launcher checks that bitsandbytes is there
        monkeypatch.syspath_prepend(qlora_site())
    with pytest.raises(RanksWouldStart) as started:
        launcher_until_ranks([name, "--output_dir", str(tmp_path / "run")], monkeypatch, capsys)
    cmd = started.value.cmd
    scaled = yaml.safe_load(open(cmd[cmd.index("--config_file") + 1]))
    # the ranks are handed the recipe's own YAML, but for the fields the smoke run or the test set
    written = yaml.safe_load(recipes.config_file(REPO / "recipes" / name).read_text())  # sft.yaml or dpo.yaml
    given = {a[2:].split("=")[0] for a in started.value.overrides if a.startswith("--")}
    assert {k: started.value.settings[k] for k in written if k not in given} == {
        k: v for k, v in written.items() if k not in given}
    tiny = json.loads((cache_dir / "smoke" / name / "config.json").read_text())
    assert tiny["num_hidden_layers"] == 2 and tiny["architectures"] == json.loads(
        (REPO / "recipes" / name / "model_config.json").read_text())["architectures"]

    other = COVERED_ELSEWHERE[name]
    other_acc = yaml.safe_load((REPO / "recipes" / other / "accelerate.yaml").read_text())
    if other == name:  # run elsewhere through this same launch path (for real, or as its smoke run): the checks above
        if other_acc["num_processes"] == 2:  # a CPU recipe: its own YAML already is what a smoke run gets
            assert {k: scaled[k] for k in other_acc} == other_acc
        return
    if name in CP_SMOKE:  # a context-parallel recipe: cp 2 over the same 2 processes
        assert scaled.pop("parallelism_config") == CP_SMOKE[name]
    assert scaled == smoke_module.scale_accelerate(other_acc)  # the same processes, FSDP settings and all
    twin, fields = TWINS[name]
    mine, theirs = (yaml.safe_load(recipes.config_file(REPO / "recipes" / n).read_text()) for n in (name, twin))
    assert mine.keys() - FOUR_BIT - {"pad_to_multiple_of"} == theirs.keys()
    # min_gpus and output_dir: the smoke run sets its own
    differ = {k for k in mine if mine[k] != theirs.get(k)}
    assert differ == fields, differ
    # the tiny model the smoke run builds is the twin's: shrinking leaves the architecture only
    from transformers import AutoTokenizer

    from fsdp_recipes.assets.tiny_assets import ensure_assets

    tokenizer = AutoTokenizer.from_pretrained(ensure_assets(quiet=True)["model"])
    mine_tiny, twin_tiny = (smoke_module.shrink(load_config(REPO / "recipes" / n / "model_config.json"),
                                                tokenizer).to_dict() for n in (name, twin))
    assert {k: v for k, v in mine_tiny.items() if k != "_name_or_path"} == {
        k: v for k, v in twin_tiny.items() if k != "_name_or_path"}


def copy_recipe(name: str, tmp_path):
    dst = tmp_path / name
    shutil.copytree(REPO / "recipes" / name, dst)
    return dst


def one_error_line(res) -> str:
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    assert "Traceback" not in res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), res.stderr
    return lines[0]


def smoke_folder(folder, cache, *args):
    return subprocess.run(["bash", str(folder / "launch.sh"), *args], cwd=REPO,
                          env=pack_env(cache, FSDP_RECIPES_SMOKE="1"), capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_smoke_catches_a_wrong_wrap_class(cache_dir, tmp_path):
    folder = copy_recipe("qwen3-8b-full", tmp_path)
    acc = yaml.safe_load((folder / "accelerate.yaml").read_text())
    acc["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"] = "MistralDecoderLayer"  # the copy-paste mistake
    (folder / "accelerate.yaml").write_text(yaml.safe_dump(acc))
    line = one_error_line(smoke_folder(folder, cache_dir))
    assert "MistralDecoderLayer" in line and "Qwen3DecoderLayer" in line


def smoke_checks(folder, monkeypatch, capsys, *args):
    """The launcher's checks of a smoke run in this process (launcher_checks): no rank may start. The wrong wrap
    class above goes through launch.sh as a process; these cases differ only in what the checks read."""
    monkeypatch.setenv("FSDP_RECIPES_SMOKE", "1")
    return launcher_checks([str(folder), *map(str, args)], monkeypatch, capsys)


def test_smoke_catches_a_lora_target_the_model_lacks(cache_dir, tmp_path, monkeypatch, capsys):
    res = smoke_checks(REPO / "recipes" / "llama-3.1-8b-lora", monkeypatch, capsys,
                       "--lora_target_modules", "q_proj", "qkv_proj", "--output_dir", tmp_path / "run")
    line = one_error_line(res)
    assert "qkv_proj" in line and "q_proj" in line


@pytest.mark.parametrize("key, value, message", [
    ("fsdp_config.fsdp_sharding_stategy", "FULL_SHARD", "did you mean `fsdp_sharding_strategy`"),
    ("fsdp_config.fsdp_reshard_after_forward", True, "only apply to"),  # an FSDP2 key is fine; see below
])
def test_smoke_catches_a_bad_fsdp_key(cache_dir, tmp_path, monkeypatch, capsys, key, value, message):
    folder = copy_recipe("mistral-small-lora", tmp_path)
    acc = yaml.safe_load((folder / "accelerate.yaml").read_text())
    section, name = key.split(".")
    acc[section][name] = value
    if name == "fsdp_reshard_after_forward":  # FSDP1 keys in an FSDP2 config
        acc[section]["fsdp_version"] = 2
    (folder / "accelerate.yaml").write_text(yaml.safe_dump(acc))
    assert message in one_error_line(smoke_checks(folder, monkeypatch, capsys))


@pytest.mark.slow
def test_smoke_of_an_unknown_recipe(cache_dir):
    res = smoke("nope", cache_dir, "/tmp/unused")
    assert res.returncode != 0 and "unknown recipe 'nope'" in res.stderr and "Traceback" not in res.stderr


class Tokenizer:
    """What shrink reads of the tiny tokenizer: its size and special ids."""

    bos_token_id, eos_token_id, pad_token_id = 1, 2, 0

    def __len__(self):
        return 512


# model_type -> its config's settings on top of transformers' defaults (full-size ones): families whose configs do
# not use Llama's names (no num_key_value_heads: GPT-NeoX, GPT-2, OPT; Falcon's num_kv_heads and its head_dim, a
# property; GPT-2's n_inner, OPT's ffn_dim, Falcon's ffn_hidden_size; GPT-J's rotary_dim; OPT-350M's projection)
SHRUNK_FAMILIES = {
    "gpt_neox": {}, "gpt2": {}, "phi": {}, "gptj": {}, "opt": {},
    "opt-350m": ("opt", dict(hidden_size=1024, num_attention_heads=16, word_embed_proj_dim=512, ffn_dim=4096)),
    "falcon": {},  # Falcon 7B: multi-query attention
    "falcon-40b": ("falcon", dict(new_decoder_architecture=True, hidden_size=8192, num_attention_heads=128,
                                  num_kv_heads=8)),
}


@pytest.mark.parametrize("family", SHRUNK_FAMILIES)
def test_smoke_shrinks_families_without_llamas_config_names(family):
    """A trial's smoke run of a GPT-NeoX recipe stopped at `'GPTNeoXConfig' object has no attribute
    'num_key_value_heads'`: shrink read Llama's names. Each family's full-size config becomes a tiny model of 2
    layers of 64 that trains a step (a width left full size -- Falcon 40B's 8 key/value heads over 4 query heads,
    GPT-J's rotary_dim 64 of a 16-wide head -- would not build, or not be tiny)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from fsdp_recipes.launch import smoke as smoke_module

    spec = SHRUNK_FAMILIES[family]
    model_type, settings = spec if isinstance(spec, tuple) else (family, spec)
    config = smoke_module.shrink(AutoConfig.for_model(model_type, **settings), Tokenizer())
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (2, 64, 512)
    assert sum(p.numel() for p in model.parameters()) < 300_000
    ids = torch.randint(0, 512, (2, 8))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)
