"""User mistakes end in one line naming the problem and the fix, exit code 2, and no traceback.

Each case runs the launcher's `main` on a copy of the tiny recipe with one thing broken, and must stop before any
rank is started or any weight is loaded: in this process (`launcher_checks`), where a launcher process would
spend ~5 s importing the libraries. Two cases run the real thing, through make and as launch.sh runs the
launcher, for the process's own exit code and streams.
"""

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

import conftest
from conftest import REPO, launch, pack_env


def assert_one_line_error(res, fragment):
    out = res.stdout + res.stderr
    assert res.returncode == 2, out
    assert "Traceback" not in out, out
    errors = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("error: "), res.stderr
    assert fragment in errors[0], errors[0]
    assert "Fix:" in errors[0] or "Available:" in errors[0], errors[0]


@pytest.fixture(autouse=True)
def checks_before_ranks(monkeypatch):
    """The launcher checks first and starts no rank for a mistake: these tests are about the one line, and the
    overlapped start (ranks importing while the launcher checks, then aborted) is tests/test_start_gate.py's."""
    monkeypatch.setenv("FSDP_RECIPES_OVERLAP_CHECKS", "0")


@pytest.fixture
def recipe(tmp_path, cache_dir):
    """A private copy of the default recipe to break."""
    dst = tmp_path / "my-recipe"
    shutil.copytree(REPO / "recipes" / "tiny-cpu-lora", dst)
    return dst


def edit_yaml(path, **changes):
    data = yaml.safe_load(path.read_text())
    data.update(changes)
    path.write_text(yaml.safe_dump(data))


@pytest.mark.slow
def test_unknown_recipe_through_make(cache_dir):
    res = subprocess.run(["make", "--no-print-directory", "finetune", "RECIPE=no-such-recipe"], cwd=REPO,
                         env=pack_env(cache_dir), capture_output=True, text=True, timeout=300)
    out = res.stdout + res.stderr
    assert res.returncode != 0 and "Traceback" not in out
    assert "error: unknown recipe 'no-such-recipe'. Available: " in res.stderr
    assert "tiny-cpu-lora" in res.stderr


@pytest.mark.slow
def test_unknown_recipe(cache_dir):
    assert_one_line_error(launch(["no-such-recipe"], cache_dir), "unknown recipe 'no-such-recipe'")


def test_missing_dataset_file(recipe, cache_dir, checks):
    res = checks([str(recipe), "--dataset_name", "/nonexistent/train.jsonl"])
    assert_one_line_error(res, "dataset not found: /nonexistent/train.jsonl")


def test_malformed_yaml(recipe, cache_dir, checks):
    sft = recipe / "sft.yaml"
    sft.write_text(sft.read_text() + "\nlearning_rate: [1e-3\n")
    assert_one_line_error(checks([str(recipe)]), "malformed YAML in")


def test_malformed_accelerate_yaml(recipe, cache_dir, checks):
    (recipe / "accelerate.yaml").write_text("distributed_type: FSDP\nfsdp_config: {fsdp_version: 2\n")
    assert_one_line_error(checks([str(recipe)]), "malformed YAML in")


def test_unknown_config_key_suggests_the_right_one(recipe, cache_dir, checks):
    edit_yaml(recipe / "sft.yaml", lerning_rate=1e-3)
    res = checks([str(recipe)])
    assert_one_line_error(res, "unknown config key `lerning_rate`")
    assert "did you mean `learning_rate`?" in res.stderr


def test_unknown_command_line_flag(recipe, cache_dir, checks):
    assert_one_line_error(checks([str(recipe), "--max_stepz", "3"]), "--max_stepz")


def test_dataset_without_expected_columns(recipe, cache_dir, tmp_path, checks):
    bad = tmp_path / "qa.jsonl"
    bad.write_text("".join(json.dumps({"question": f"q{i}", "answer": "a"}) + "\n" for i in range(4)))
    res = checks([str(recipe), "--dataset_name", str(bad), "--eval_strategy", "no"])
    assert_one_line_error(res, "has columns ['answer', 'question']")


def test_missing_eval_split(recipe, cache_dir, tmp_path, checks):
    only_train = tmp_path / "train.jsonl"
    shutil.copy(cache_dir / "tiny-arith" / "train.jsonl", only_train)
    assert_one_line_error(checks([str(recipe), "--dataset_name", str(only_train)]), "no `test` split")


def test_gpu_recipe_on_cpu_names_the_cpu_alternative(cache_dir, checks):
    res = checks(["mistral-small-lora"])
    assert_one_line_error(res, "needs 8 GPU(s) and this machine has 0")
    assert "make smoke RECIPE=mistral-small-lora" in res.stderr


def test_a_gpu_recipe_copied_elsewhere_names_the_smoke_command_that_runs_there(tmp_path, monkeypatch):
    """A recipe folder copied out of the repository and launched by its path: `make smoke RECIPE=<its name>` finds no
    such recipe there (nor a Makefile); its own launch.sh runs the smoke test."""
    from fsdp_recipes.config import hardware
    from fsdp_recipes.errors import UserError

    monkeypatch.setattr(hardware, "gpu_count", lambda: 0)
    with pytest.raises(UserError, match=rf"Fix: run it on a GPU node, or test it on CPU with `FSDP_RECIPES_SMOKE=1 "
                                        rf"{tmp_path}/m7/launch.sh`"):
        hardware.check_gpus(8, "m7", folder=tmp_path / "m7")
    monkeypatch.chdir(REPO)
    with pytest.raises(UserError, match=r"test it on CPU with `make smoke RECIPE=mistral-7b-full`"):
        hardware.check_gpus(8, "mistral-7b-full", folder=Path("recipes/mistral-7b-full"))


def test_fsdp1_keys_in_fsdp2_config(recipe, cache_dir, checks):
    acc = recipe / "accelerate.yaml"
    data = yaml.safe_load(acc.read_text())
    data["fsdp_config"]["fsdp_use_orig_params"] = True
    acc.write_text(yaml.safe_dump(data))
    assert_one_line_error(checks([str(recipe)]), "fsdp_use_orig_params only apply to FSDP1")


def test_missing_model_directory(recipe, cache_dir, tmp_path, checks):
    res = checks([str(recipe), "--model_name_or_path", str(tmp_path / "no-model")])
    assert_one_line_error(res, "model not found")


def test_flash_attention_requested_but_not_installed(recipe, cache_dir, checks):
    res = checks([str(recipe), "--attn_implementation", "flash_attention_2"])
    assert_one_line_error(res, "needs the flash-attn package")


def fake_checkpoint(output_dir, cache_dir, **changes):
    """A complete checkpoint folder whose recorded identity differs from the default recipe's."""
    from peft import LoraConfig

    from fsdp_recipes.checkpoint import markers as checkpoints

    ident = checkpoints.identity(str(cache_dir / "tiny-mistral"), LoraConfig(  # tiny-cpu-lora's adapter
        r=32, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                             "down_proj"], modules_to_save=["lm_head"]))
    for key, value in changes.items():
        section, field = key.split("__")
        if field:
            ident[section][field] = value
        else:
            ident[section] = value
    ckpt = output_dir / "checkpoint-10"
    ckpt.mkdir(parents=True)
    (ckpt / checkpoints.IDENTITY).write_text(json.dumps(ident))
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 10}))
    (ckpt / checkpoints.MARKER).write_text("10")
    return ckpt


@pytest.mark.parametrize("changes, fragment", [
    ({"peft__r": 8}, "its LoRA r is 8 and this run's is 32"),
    ({"peft__lora_alpha": 16}, "its LoRA lora_alpha is 16 and this run's is 32"),
    ({"peft__": None}, "it is a full fine-tuning checkpoint and this run is LoRA"),
    ({"architecture__hidden_size": 512}, "it was trained on another model (hidden_size 512 vs 256)"),
    # a Falcon run's checkpoint, whose LoRA targets Falcon's layers: the model is what differs, not the targets
    ({"architecture__model_type": "falcon", "peft__target_modules": ["dense", "query_key_value"]},
     "it was trained on another model (model_type falcon vs mistral)"),
])
def test_resuming_from_an_incompatible_checkpoint(recipe, cache_dir, tmp_path, changes, fragment, checks):
    out = tmp_path / "run"
    fake_checkpoint(out, cache_dir, **changes)
    assert_one_line_error(checks([str(recipe), "--output_dir", str(out)]), fragment)


def test_a_resume_folder_without_the_trainers_state_is_one_line(recipe, cache_dir, tmp_path, checks):
    """This run's model and adapter (fake_checkpoint's identity), but no trainer_state.json: a traceback before.
    auto_resume skips such a checkpoint as unreadable (tests/test_mistakes.py); one named explicitly is refused."""
    ckpt = fake_checkpoint(tmp_path / "other", cache_dir)
    (ckpt / "trainer_state.json").unlink()
    res = checks([str(recipe), "--output_dir", str(tmp_path / "run"), "--resume_from_checkpoint", str(ckpt)])
    assert_one_line_error(res, f"resume_from_checkpoint {ckpt} cannot be read (trainer_state.json: missing, so the "
                               "Trainer cannot resume from it")


def test_a_refused_resume_moves_no_unreadable_checkpoint_aside(recipe, cache_dir, tmp_path, checks):
    """An unfinished run whose newest checkpoint cannot be read and whose older one belongs to another adapter: the
    command is refused, and the folder is as it was (the unreadable checkpoint was moved aside, and "resuming from
    checkpoint-10" said, before the refusal of that very checkpoint)."""
    out = tmp_path / "run"
    fake_checkpoint(out, cache_dir, peft__r=8)  # checkpoint-10
    cut = out / "checkpoint-20"
    cut.mkdir()
    (cut / "checkpoint_complete").write_text("20")
    (cut / "trainer_state.json").write_text(json.dumps({"global_step": 20}))
    (cut / "optimizer.bin").write_bytes(b"cut short")  # not a zip: markers.unreadable
    from fsdp_recipes.checkpoint.output_lock import LOCK_FILE

    res = checks([str(recipe), "--output_dir", str(out)])
    assert_one_line_error(res, "its LoRA r is 8 and this run's is 32")
    assert "moved to" not in res.stdout, res.stdout
    assert sorted(p.name for p in out.iterdir() if p.name != LOCK_FILE) == ["checkpoint-10", "checkpoint-20"]


def test_lora_under_fsdp1_needs_use_orig_params(tmp_path):
    from fsdp_recipes.config.accelerate_yaml import check_fsdp_with_peft
    from fsdp_recipes.errors import UserError

    acc = yaml.safe_load((REPO / "accelerate_configs" / "fsdp1_1node.yaml").read_text())
    check_fsdp_with_peft(acc, True, "fsdp1.yaml")  # the shipped FSDP1 config is right
    acc["fsdp_config"]["fsdp_use_orig_params"] = False
    with pytest.raises(UserError, match="LoRA under FSDP1 needs fsdp_use_orig_params: true"):
        check_fsdp_with_peft(acc, True, "fsdp1.yaml")
    check_fsdp_with_peft(acc, False, "fsdp1.yaml")  # full fine-tuning does not need it


@pytest.mark.parametrize("state_dict_type", ["SHARDED_STATE_DICT", "FULL_STATE_DICT"])
def test_fsdp1_lora_on_one_process_stops_before_launch(tmp_path, cache_dir, checks, state_dict_type):
    """One FSDP1 process is NO_SHARD, whose LoRA state dict crashes the first checkpoint save (seen: AssertionError in
    torch's state-dict post-hook at the first save, sharded on CPU, full on CPU and on an H100). Refused up front."""
    from conftest import fsdp1_recipe

    recipe = fsdp1_recipe(tmp_path, fsdp_state_dict_type=state_dict_type)
    acc = yaml.safe_load((recipe / "accelerate.yaml").read_text())
    acc["num_processes"] = 1
    (recipe / "accelerate.yaml").write_text(yaml.safe_dump(acc))
    assert_one_line_error(checks([str(recipe)]), "LoRA under FSDP1 with one process cannot save checkpoints")


def test_min_gpus_is_shared_among_the_nodes(monkeypatch):
    """min_gpus counts the whole job: a 16-GPU recipe on 2 nodes needs 8 per node, in the launcher and in every
    rank (the ranks read the node count from torchrun's WORLD_SIZE / LOCAL_WORLD_SIZE)."""
    from fsdp_recipes.config import hardware
    from fsdp_recipes.errors import UserError

    monkeypatch.setattr(hardware, "gpu_count", lambda: 8)
    hardware.check_gpus(16, "big", nodes=2)
    hardware.check_gpus(16, "big", nodes=4)
    with pytest.raises(UserError, match=r"needs 16 GPU\(s\) and this machine has 8"):
        hardware.check_gpus(16, "big", nodes=1)
    with pytest.raises(UserError, match=r"needs 10 GPU\(s\) per node \(min_gpus 30 over 3 nodes\)"):
        hardware.check_gpus(30, "big", nodes=3)
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert hardware.job_nodes() == 2
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert hardware.job_nodes() == 1


def test_gpu_count_hint_reads_cuda_visible_devices(monkeypatch):
    """The launcher's torch-free count, used to decide whether to start the ranks before torch counts."""
    from fsdp_recipes.config import hardware

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    assert hardware.gpu_count_hint() == 3
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert hardware.gpu_count_hint() == 0
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setenv("PATH", "/nonexistent")  # no nvidia-smi: no GPU
    assert hardware.gpu_count_hint() == 0


@pytest.mark.parametrize("name, fragment", [("fsdp.txt", "does not end in .prom"),
                                            ("missing/fsdp.prom", "does not exist or is not writable")])
def test_prometheus_textfile_that_node_exporter_would_never_read(recipe, cache_dir, tmp_path, name, fragment, checks):
    res = checks([str(recipe), "--prometheus_textfile", str(tmp_path / name)])
    assert_one_line_error(res, fragment)


def test_unset_variable_in_a_path_is_refused_not_written_literally(recipe, cache_dir, tmp_path, checks):
    # os.path.expandvars would leave "$NO_SUCH_VAR_FOR_TEST" in the name and the run would write a file called that
    res = checks([str(recipe), "--output_dir", str(tmp_path / "$NO_SUCH_VAR_FOR_TEST" / "run")])
    assert_one_line_error(res, "output_dir")
    assert "$NO_SUCH_VAR_FOR_TEST, which is not set here" in res.stderr
    assert not (tmp_path / "$NO_SUCH_VAR_FOR_TEST").exists()


@pytest.mark.parametrize("name, value", [("mfu_min", 40), ("peak_memory_max_fraction", 95),
                                         ("divergence_factor", 0.5)])
def test_a_gate_written_as_a_percentage_is_one_line(recipe, name, value, checks):
    """The gates are shares (metrics/gates.py): 40 would be an MFU floor no run meets."""
    assert_one_line_error(checks([str(recipe), f"--{name}", str(value)]), f"{name} is {value}")


@pytest.mark.parametrize("args, fragment", [
    (["--load_in_4bit", "true", "--bnb_4bit_quant_storage", "uint8"], "bnb_4bit_quant_storage uint8 differs"),
    (["--load_in_4bit", "true", "--use_peft", "false"], "4-bit weights cannot be trained"),
    (["--load_in_8bit", "true"], "load_in_8bit cannot be sharded by FSDP"),
])
def test_a_4bit_setting_fsdp_cannot_shard_is_one_line(recipe, args, fragment, checks, monkeypatch):
    """uint8 storage (accelerate issue 3983: a crash or a loss of 0 or NaN; accelerate 1.15 leaves it unsharded) and
    its kin (speed/four_bit.py), before any rank starts."""
    monkeypatch.syspath_prepend(conftest.qlora_site())  # bitsandbytes lives outside the venv (the Makefile says why)
    assert_one_line_error(checks([str(recipe), *args]), fragment)

# ---- issue 44 items 4 and 5: the model folder

def tied_copy_of_the_tiny_model(tmp_path, cache_dir, store_head: bool = False):
    """tiny_assets' model and tokenizer with tie_word_embeddings set: a tied model, saved as one (the LM head not
    stored; `store_head`: the tiny model's own, different head left in the weights)."""
    from safetensors.torch import load_file, save_file

    model = tmp_path / "tiny-tied"
    shutil.copytree(cache_dir / "tiny-mistral", model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    if not store_head:
        weights = load_file(model / "model.safetensors")
        del weights["lm_head.weight"]
        save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    return model


@pytest.mark.parametrize("modules", [["embed_tokens"], ["lm_head", "embed_tokens"]])
def test_training_a_tied_input_embedding_is_one_line_before_any_rank(tmp_path, cache_dir, checks, modules):
    res = checks(["tiny-cpu-lora", "--model_name_or_path", tied_copy_of_the_tiny_model(tmp_path, cache_dir),
                  "--output_dir", tmp_path / "run", "--lora_modules_to_save", *modules])
    assert_one_line_error(res, "lora_modules_to_save names embed_tokens, the input embedding of MistralForCausalLM, "
                               "whose LM head lm_head is tied to it (tie_word_embeddings)")


# ---- issue 61 class 2: the other ways a recipe could train a tied model's head or embedding

def test_a_lora_on_the_lm_head_is_one_line_before_any_rank(recipe, tmp_path, cache_dir, checks):
    """TRL refused it in every rank's setup (its fused LM head reads lm_head.weight); the launcher names it first."""
    config = yaml.safe_load((recipe / "sft.yaml").read_text())
    del config["lora_modules_to_save"]  # the tiny recipe trains the whole head; this user tries a LoRA on it instead
    (recipe / "sft.yaml").write_text(yaml.safe_dump(config))
    res = checks([str(recipe), "--model_name_or_path", tied_copy_of_the_tiny_model(tmp_path, cache_dir),
                  "--output_dir", tmp_path / "run", "--lora_target_modules", "q_proj", "lm_head"])
    assert_one_line_error(res, "lora_target_modules ['q_proj', 'lm_head'] puts a LoRA adapter on lm_head, the LM "
                               "head of MistralForCausalLM")
    assert "Fix: train the whole head instead (lora_modules_to_save: [lm_head] (an untied trained copy" in res.stderr


@pytest.mark.parametrize("key, fix", [
    ("trainable_token_indices", "Fix: to train the input embedding, add embed_tokens to lora_target_modules"),
    ("ensure_weight_tying", "Fix: remove it"),
])
@pytest.mark.parametrize("where", ["yaml", "flag"])
def test_peft_settings_no_recipe_can_set_are_one_line_with_the_way_that_does(recipe, tmp_path, checks, key, fix,
                                                                            where):
    """PEFT's own tied-weights warning names ensure_weight_tying, and its docs trainable_token_indices; TRL's
    ModelConfig builds the LoraConfig without either, so a recipe that sets one gets why and what does work."""
    value = [1, 2] if key == "trainable_token_indices" else True
    if where == "yaml":
        edit_yaml(recipe / "sft.yaml", **{key: value})
        extra = []
    else:
        extra = [f"--{key}", *(str(v) for v in (value if isinstance(value, list) else [value]))]
    res = checks([str(recipe), "--output_dir", tmp_path / "run", *extra])
    assert_one_line_error(res, f"PEFT's {key} is no recipe setting (TRL builds the LoraConfig without it")
    assert fix in res.stderr


def sft_output(tmp_path, merged: bool):
    """What a LoRA SFT run leaves in its output_dir: the adapter, a checkpoint, and merged/ with save_merged_model."""
    run = tmp_path / "runs" / "smollm2-135m-lora"
    for folder in (run, run / "checkpoint-4"):
        folder.mkdir(parents=True)
        (folder / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "/cache/smollm2-135m",
                                                                "peft_type": "LORA"}))
        (folder / "adapter_model.safetensors").write_bytes(b"")
    if merged:
        (run / "merged").mkdir()
        (run / "merged" / "config.json").write_text("{}")
    return run


@pytest.mark.parametrize("recipe", ["smollm2-135m-dpo", "smollm2-135m-grpo"])
@pytest.mark.parametrize("where, merged, fix", [
    ("", True, "Fix: set model_name_or_path to {run}/merged (the run's base model with this adapter merged"),
    ("checkpoint-4", True, "Fix: set model_name_or_path to {run}/merged"),
    ("", False, "Fix: rerun that recipe with --save_merged_model true, which writes {run}/merged"),
], ids=["run", "checkpoint", "no-merged"])
def test_an_sft_runs_adapter_folder_is_named_with_its_merged_path(tmp_path, cache_dir, checks, recipe, where, merged,
                                                                  fix):
    run = sft_output(tmp_path, merged)
    res = checks([recipe, "--model_name_or_path", run / where if where else run, "--output_dir", tmp_path / "out"])
    assert_one_line_error(res, f"is a LoRA adapter of /cache/smollm2-135m (adapter_config.json, no config.json)")
    assert fix.format(run=run) in res.stderr and "has not run here yet" not in res.stderr


def test_a_config_that_ties_a_stored_separate_head_is_one_line_before_any_rank(tmp_path, cache_dir, checks,
                                                                              monkeypatch, capsys):
    """tie_word_embeddings: true over weights that hold their own, different lm_head (the tiny model as built, its
    config edited): transformers loads it untied, and the ranks failed: FSDP2's setup with KeyError "attribute 'weight'
    already exists", FSDP1's with a gloo size mismatch, without RAM-efficient loading the pack's tie check (measured
    launches). Stored once, as a tied model saves it, it reaches the ranks."""
    from conftest import RanksWouldStart, launcher_until_ranks

    model = tied_copy_of_the_tiny_model(tmp_path, cache_dir, store_head=True)
    args = ["tiny-cpu-lora", "--model_name_or_path", str(model), "--output_dir", str(tmp_path / "run")]
    assert_one_line_error(checks(args), f"{model}/config.json ties the LM head to the input embedding "
                                        "(tie_word_embeddings: true), but the weights store a lm_head.weight that "
                                        "differs from model.embed_tokens.weight")
    model = tied_copy_of_the_tiny_model(tmp_path / "faithful", cache_dir)
    with pytest.raises(RanksWouldStart):  # lora_modules_to_save: [lm_head], as tiny-cpu-lora trains it
        launcher_until_ranks([*args[:2], str(model), *args[3:]], monkeypatch, capsys)


def test_a_key_without_its_colon_is_said_at_its_own_line(tmp_path):
    """`max_steps 12` on line 2 was said "at line 3", where PyYAML noticed it."""
    from fsdp_recipes.config.yaml_keys import load_yaml
    from fsdp_recipes.errors import UserError

    path = tmp_path / "sft.yaml"
    path.write_text("learning_rate: 1.0e-4\nmax_steps 12\nlogging_steps: 1\n")
    with pytest.raises(UserError) as err:
        load_yaml(path)
    assert str(err.value) == (f"malformed YAML in {path} at line 2 (while scanning a simple key; noticed at line 3): "
                              "could not find expected ':'. Fix: correct the YAML syntax there.")
