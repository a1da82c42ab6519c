"""Every accelerate YAML loads with accelerate's own loader, every recipe YAML with TRL's parser, and the
recipes' accelerate copies match accelerate_configs/."""

import os
import subprocess
import sys

import pytest
from accelerate.commands.config.config_args import load_config_from_file

from conftest import REPO
from fsdp_recipes.config import handoff, recipes
from fsdp_recipes.config.accelerate_yaml import check_accelerate_config
from fsdp_recipes.config.run_config import parse_args
from fsdp_recipes.errors import UserError

ACCELERATE_YAMLS = sorted(
    p for p in [*REPO.glob("accelerate_configs/*.yaml"), *REPO.glob("recipes/*/accelerate.yaml")]
    if p.name != "recipes.yaml"
)
RECIPES = recipes.available(REPO / "recipes")


def test_there_is_something_to_check():
    assert "tiny-cpu-lora" in RECIPES and len(ACCELERATE_YAMLS) >= 4


@pytest.mark.parametrize("path", ACCELERATE_YAMLS, ids=lambda p: str(p.relative_to(REPO)))
def test_accelerate_yaml_loads_with_accelerate(path):
    config = load_config_from_file(str(path))
    assert config.distributed_type.value in {"FSDP", "MULTI_GPU", "NO"}
    check_accelerate_config(path)  # the pack's own rules pass too


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_yaml_parses_with_trl(name, cache_dir, tmp_path):
    # use_cpu lets bf16 recipes validate on this CPU-only machine; nothing else is overridden.
    cfg = parse_args(["--config", str(recipes.config_file(REPO / "recipes" / name)), "--use_cpu", "true"])
    assert cfg.pack.recipe_name == name
    assert cfg.training.output_dir == f"runs/{name}"
    assert cfg.model.model_name_or_path and (cfg.script.dataset_name or cfg.mixture.datasets)
    for required in ("launch.sh", "README.md"):
        assert (REPO / "recipes" / name / required).is_file()
    # what the launcher hands its ranks (config/handoff.py) makes the same configuration, field for field
    handoff.write(cfg.settings, tmp_path / "settings.json")
    assert parse_args(handoff.rank_argv(tmp_path / "settings.json")).resolved() == cfg.resolved()
    if not cfg.model.use_peft:  # TRL reads LoRA's fields only with use_peft: on a full recipe they mislead its reader
        written = recipes.config_file(REPO / "recipes" / name).read_text().splitlines()
        assert not [line for line in written if line.startswith(("lora_", "use_rslora", "use_dora"))], name


def test_ranks_build_their_configuration_from_the_launchers_reading_alone(tmp_path):
    """The YAML read once, the command line's values typed in (a list, a float, a `--no_` flag, `--key=value`, `env`):
    the ranks parse the settings file with the YAML gone and no flag, and get the launcher's configuration."""
    recipe = tmp_path / "sft.yaml"
    recipe.write_text((REPO / "recipes/tiny-cpu-lora/sft.yaml").read_text() + "env:\n  FSDP_RECIPES_TEST_HANDOFF: '7'\n")
    argv = ["--config", str(recipe), "--lora_target_modules", "q_proj", "v_proj", "--learning_rate=3e-4",
            "--no_auto_resume", "--max_steps", "5"]
    launcher = parse_args(argv)
    assert {k: launcher.settings[k] for k in ("lora_target_modules", "learning_rate", "auto_resume",
                                              "max_steps", "env")} == {
        "lora_target_modules": ["q_proj", "v_proj"], "learning_rate": 3e-4, "auto_resume": False, "max_steps": 5,
        "env": {"FSDP_RECIPES_TEST_HANDOFF": "7"}}
    handoff.write(launcher.settings, tmp_path / "settings.json")
    recipe.unlink()
    rank = parse_args(handoff.rank_argv(tmp_path / "settings.json"))
    assert rank.resolved() == launcher.resolved()
    assert (rank.training.learning_rate, rank.pack.auto_resume, rank.model.lora_target_modules) == (
        3e-4, False, ["q_proj", "v_proj"])


def test_a_list_field_is_emptied_with_none_and_the_ranks_get_it_empty(tmp_path):
    """tiny-cpu-lora's YAML sets lora_modules_to_save: [lm_head]; `--lora_modules_to_save none` (transformers'
    `--report_to none`) makes it None, as the launcher reads it and as the ranks rebuild it from the handoff."""
    tiny = str(REPO / "recipes/tiny-cpu-lora/sft.yaml")
    for spelling in (["--lora_modules_to_save", "none"], ["--lora_modules_to_save=None"]):
        launcher = parse_args(["--config", tiny, *spelling, "--max_steps", "5"])
        assert launcher.model.lora_modules_to_save is None and launcher.settings["lora_modules_to_save"] is None
        assert launcher.training.max_steps == 5  # the flags after it still apply
        handoff.write(launcher.settings, tmp_path / "settings.json")
        rank = parse_args(handoff.rank_argv(tmp_path / "settings.json"))
        assert rank.model.lora_modules_to_save is None and rank.resolved() == launcher.resolved()
    # the other list flags pass as written, `--field=value` included
    assert parse_args(["--config", tiny, "--lora_target_modules=q_proj", "--lora_modules_to_save", "lm_head",
                       "embed_tokens"]).model.lora_target_modules == "q_proj"  # TRL's ModelConfig unwraps one module
    # a list default of [] empties to []
    assert parse_args(["--config", tiny, "--include_for_metrics", "none"]).training.include_for_metrics == []


def test_the_last_list_flag_wins_as_in_argparse():
    tiny = str(REPO / "recipes/tiny-cpu-lora/sft.yaml")
    model = lambda *flags: parse_args(["--config", tiny, *flags]).model
    assert model("--lora_modules_to_save", "lm_head", "--lora_modules_to_save", "none").lora_modules_to_save is None
    assert model("--lora_modules_to_save", "none", "--lora_modules_to_save", "lm_head").lora_modules_to_save == [
        "lm_head"]
    assert model("--lora_modules_to_save", "none", "--max_steps", "5", "--lora_modules_to_save=embed_tokens",
                 ).lora_modules_to_save == ["embed_tokens"]


@pytest.mark.parametrize("flags, message", [
    (["--lora_modules_to_save"], r"^--lora_modules_to_save is given no value\. Fix: --lora_modules_to_save <value> "
                                 r"\[<value> \.\.\.\], or --lora_modules_to_save none for no values\.$"),
    (["--lora_modules_to_save", "--max_steps", "5"], r"^--lora_modules_to_save is given no value\."),
    (["--lora_modules_to_save="], r"^--lora_modules_to_save is given no value\."),
    (["--lora_modules_to_save", "none", "lm_head"], r"^--lora_modules_to_save none lm_head: `none` empties the list, "
                                                    r"so it cannot stand beside other values\. Fix: "),
    # None is PEFT's per-architecture default targets (none for qwen3_moe), not no modules; the planner counts 0
    (["--lora_target_modules", "none"], r"^--lora_target_modules none: lora_target_modules cannot be emptied: None is "
                                        r"PEFT's default target modules .* Fix: name the modules, .* or --use_peft "
                                        r"false for full fine-tuning\.$"),
    (["--label_names=None"], r"^--label_names none: label_names cannot be emptied: None is transformers' default "
                             r"label names .* Fix: name them, --label_names labels\.$"),
])
def test_an_ambiguous_list_flag_is_one_line(flags, message):
    with pytest.raises(UserError, match=message):
        parse_args(["--config", str(REPO / "recipes/tiny-cpu-lora/sft.yaml"), *flags])


def test_a_missing_settings_file_is_one_line(tmp_path):
    with pytest.raises(UserError, match=r"^--recipe_settings .*missing.json cannot be read .* Fix: start the ranks "
                                        r"with the launcher"):
        parse_args(handoff.rank_argv(tmp_path / "missing.json"))


@pytest.mark.slow
def test_recipe_accelerate_copies_are_in_sync(monkeypatch, capsys):
    """`python scripts/sync_recipes.py --check`, in this process: its imports (TRL's configs, the planner) are the
    suite's already, 10-19 s as a process of its own."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("sync_recipes", REPO / "scripts" / "sync_recipes.py")
    sync = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sync)
    monkeypatch.setattr(sys, "argv", ["sync_recipes.py", "--check"])
    assert sync.main() == 0, capsys.readouterr().err


def test_make_help_lists_targets_and_recipes():
    res = subprocess.run(["make", "--no-print-directory", "help"], cwd=REPO, capture_output=True, text=True)
    assert res.returncode == 0
    for word in ("make finetune", "make test", *RECIPES):
        assert word in res.stdout


def test_generated_sft_yaml_refuses_a_comment_naming_another_models_size():
    """The 123B recipe inherited "merging a 24B model" from the 24B one; the generator now refuses that."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("sync_recipes", REPO / "scripts" / "sync_recipes.py")
    sync = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sync)
    line = "save_merged_model: false   # merging a 24B model needs ~48 GB"
    with pytest.raises(SystemExit, match=r"recipes/big/sft\.yaml: a comment inherited from recipes/small/sft\.yaml "
                                         r"names 24B"):
        sync.check_inherited_comments("big", "small", [line], "LoRA on Mistral Large 2 (123B)")
    sync.check_inherited_comments("small-2x", "small", [line], "the same 24B model on 2 GPUs")  # its own size: fine


ATTENTION_NAMES = ("flash_attention_2", "flash_attention_3", "flex_attention", "eager", "kernels-community")


CP_RECIPES = [n for n in RECIPES if "cp_size" in (REPO / "recipes" / n / "accelerate.yaml").read_text()]


@pytest.mark.parametrize("name", CP_RECIPES)
def test_a_cp_recipes_comments_suggest_no_attention_the_launcher_refuses_under_cp(name):
    """The 128k recipe inherited "flash_attention_2 once flash-attn is installed" from its twin; under its cp mesh the
    launcher refuses flash_attention_2 (speed/attention.py), so the hint would lead to a refused launch."""
    import yaml

    from fsdp_recipes.speed.attention import refuse_other_than_sdpa_under_cp

    acc_path = REPO / "recipes" / name / "accelerate.yaml"
    acc = yaml.safe_load(acc_path.read_text())
    for line in recipes.config_file(REPO / "recipes" / name).read_text().splitlines():
        comment = line.split("#", 1)[1] if "#" in line else ""
        for attn in ATTENTION_NAMES:
            if attn in comment and "refuse" not in comment:
                with pytest.raises(UserError):  # only a name the launcher refuses makes the hint wrong
                    refuse_other_than_sdpa_under_cp(attn, acc, acc_path)
                pytest.fail(f"recipes/{name}: {line.strip()!r} suggests {attn}, which its cp mesh refuses")


class YamlReads:
    """Which YAML files the pack's own code reads, counted by path, while it runs (Path.read_text, open); a read by
    a library (accelerate's own loader, which `accelerate launch` runs as well) is not the pack's."""

    def __init__(self, monkeypatch) -> None:
        import builtins
        import collections
        from pathlib import Path

        self.counts = collections.Counter()
        read_text, opened = Path.read_text, builtins.open

        def counted(path, frame) -> None:
            if str(path).endswith((".yaml", ".yml")) and frame.f_globals.get("__name__", "").startswith("fsdp_recipes"):
                self.counts[Path(path).resolve()] += 1

        def read_text_counted(path, *a, **k):
            counted(path, sys._getframe(1))
            return read_text(path, *a, **k)

        def open_counted(file, *a, **k):
            counted(file, sys._getframe(1))
            return opened(file, *a, **k)

        monkeypatch.setattr(Path, "read_text", read_text_counted)
        monkeypatch.setattr(builtins, "open", open_counted)


def test_the_launcher_reads_the_recipe_once(monkeypatch, capsys, cache_dir):
    """Issue 56's "the recipe read once": from the command line to the ranks' start, the launcher reads the trainer
    YAML and the accelerate YAML once each and parses the configuration once (here, without GPUs; with GPUs and
    activation checkpointing `auto`, the planner parses its own view of the same Recipe once more, reading no file:
    test_checkpointing_policies); the ranks then take the settings file (test above). The counter is shown to count:
    a second recipes.load reads both files again."""
    from conftest import RanksWouldStart, launcher_until_ranks
    from fsdp_recipes.config import run_config
    from fsdp_recipes.launch import launcher  # noqa: F401 (its modules imported, to be counted)
    from fsdp_recipes.train import run_checks  # noqa: F401 (imported by the launcher's checks when they run)

    folder = (REPO / "recipes" / "tiny-cpu-lora").resolve()
    parses = []
    parse = run_config.parse_args
    for module in [m for name, m in sys.modules.items() if name.startswith("fsdp_recipes")]:
        # `from ...run_config import parse_args` too; vars(), not getattr: fsdp_recipes.api's __getattr__ would
        # import and keep the patched one for good
        if vars(module).get("parse_args") is parse:
            monkeypatch.setattr(module, "parse_args", lambda *a, **k: parses.append(a) or parse(*a, **k))
    reads = YamlReads(monkeypatch)
    with pytest.raises(RanksWouldStart):
        launcher_until_ranks(["tiny-cpu-lora", "--max_steps", "3"], monkeypatch, capsys)
    assert reads.counts == {folder / "sft.yaml": 1, folder / "accelerate.yaml": 1}
    assert len(parses) == 1
    recipes.load(folder)
    assert reads.counts == {folder / "sft.yaml": 2, folder / "accelerate.yaml": 2}


def test_the_launchers_early_settings_are_typed_as_the_full_parse_types_them():
    """Recipe.early: the YAML's values with the command line's on top, typed before TRL's classes are imported. The
    command line's "false" is False (a string would be true), numbers are numbers, PackArguments' defaults fill
    in, and a value the full parse would refuse is one line here too."""
    tiny = recipes.load(REPO / "recipes" / "tiny-cpu-lora", ["--tiny_assets", "false", "--min_gpus=2",
                                                               "--output_dir", "/tmp/elsewhere"])
    early = tiny.early
    assert (early.tiny_assets, early.min_gpus, early.output_dir) == (False, 2, "/tmp/elsewhere")
    assert (early.smollm2_assets, early.addition_preferences, early.continues_from) == (False, False, None)
    assert early.dataset_name == os.environ["FSDP_RECIPES_CACHE"] + "/tiny-arith"  # expanded, as the parse does
    assert recipes.load(REPO / "recipes" / "tiny-cpu-lora").early.tiny_assets is True  # the YAML's `true`
    tiny.overrides += ["--addition_preferences", "Y"]
    assert tiny.early.addition_preferences is True  # read as the overrides stand now
    bare = recipes.load(REPO / "recipes" / "tiny-cpu-lora", ["--smollm2_assets", "--max_steps", "3"])
    assert bare.early.smollm2_assets is True  # a bare yes/no flag, as HfArgumentParser reads it (const True)
    assert parse_args([*bare.argv(), "--use_cpu", "true"]).pack.smollm2_assets is True  # the full parse agrees
    with pytest.raises(UserError, match=r"^tiny_assets: 'maybe' is not yes or no\. Fix: --tiny_assets true"):
        recipes.load(REPO / "recipes" / "tiny-cpu-lora", ["--tiny_assets", "maybe"]).early
    with pytest.raises(UserError, match=r"^min_gpus: 'two' is not a whole number\. Fix: --min_gpus 2"):
        recipes.load(REPO / "recipes" / "tiny-cpu-lora", ["--min_gpus", "two"]).early


def test_an_empty_yaml_value_is_the_full_parses_default(tmp_path):
    """`min_gpus:` and `smollm2_assets:` left empty: the full parse reads None as the field's default, and so does
    Recipe.early (PackArguments' 0 and False), not a refusal."""
    import shutil

    folder = tmp_path / "empty-values"
    shutil.copytree(REPO / "recipes" / "tiny-cpu-lora", folder)
    with (folder / "sft.yaml").open("a") as f:
        f.write("\nmin_gpus:\nsmollm2_assets:\n")
    early = recipes.load(folder).early
    assert (early.min_gpus, early.smollm2_assets) == (0, False)


def test_a_library_validation_error_is_one_line_with_its_whole_message(monkeypatch):
    """TrainingArguments' own checks: load_best_model_at_end's message ends its first line with "but found" and
    lists the strategies below (the line said only "... but found."); bf16 on a machine without a GPU asked to
    "assign use_cpu" without naming the flag."""
    import transformers

    sft = str(REPO / "recipes" / "tiny-cpu-lora" / "sft.yaml")
    with pytest.raises(UserError, match=r"but found - Evaluation strategy: \S+ - Save strategy: \S+\. Fix"):
        parse_args(["--config", sft, "--save_strategy", "no", "--load_best_model_at_end", "true"])
    monkeypatch.setattr(transformers.training_args, "is_torch_bf16_gpu_available", lambda: False)
    with pytest.raises(UserError, match="bf16 is on and torch sees no GPU with bf16.* Fix: add --use_cpu true"):
        parse_args(["--config", sft, "--bf16", "true"])
    assert parse_args(["--config", sft, "--bf16", "true", "--use_cpu", "true"]).training.bf16
    with pytest.raises(UserError, match=r"\['prompt=question'\] on the command line belong to no flag. Fix: quote"):
        parse_args(["--config", sft, "--dataset_format", "prompt_completion", "prompt=question"])  # unquoted
