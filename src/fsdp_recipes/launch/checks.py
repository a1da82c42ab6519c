"""The launcher's checks of a recipe: those that need no heavy import first (keys, the topology), then the recipe
as the ranks will parse it, the model, the dataset and its rows, while the ranks import."""

from __future__ import annotations

import json
import warnings

# Only light modules here: the heavy imports (torch, transformers, TRL) happen in check_settings below, while the ranks
# import the same in parallel.
from fsdp_recipes import speed
from fsdp_recipes.config import accelerate_yaml, hardware, mesh, model_check, model_found, value_checks
from fsdp_recipes.config.job import job_machines, job_processes
from fsdp_recipes.config.recipes import Recipe
from fsdp_recipes.config.run_config import RunConfig
from fsdp_recipes.data import length_report, lengths, loading, recipe_tokenizer
from fsdp_recipes.launch.lines import say
from fsdp_recipes.speed import yarn
from fsdp_recipes.train import kinds, run_checks


def check_launch(recipe: Recipe) -> None:
    """What can be checked without importing torch: the pack's FSDP rules (read with the YAML) and the speed
    options', the GPU count
    (torch counts them here only when nvidia-smi / CUDA_VISIBLE_DEVICES show too few; else check_recipe does),
    the topology."""
    acc = recipe.accelerate
    speed.check_accelerate(acc, recipe.folder / "accelerate.yaml")  # the options' rules of the YAML the user edits
    machines = job_machines(acc)
    # The GPU requirement before the recipe YAML: a GPU recipe's settings (bf16, hub model) cannot be checked
    # on CPU. min_gpus counts the whole job; each of its nodes runs this launcher with its share.
    min_gpus = recipe.early.min_gpus
    per_node = hardware.gpus_per_node(min_gpus, machines)
    if per_node > 0 and ((hint := hardware.gpu_count_hint()) is None or hint < per_node):
        # torch's count now: no ranks start without GPUs
        hardware.check_gpus(min_gpus, recipe.name, machines, recipe.folder)
    mesh.check_mesh(acc, recipe.accelerate_path, job_processes(acc))  # the product of its sizes, first
    accelerate_yaml.check_topology(acc, recipe.accelerate_path, machines, job_processes(acc))


def warn(recipe: Recipe, lines: list[str]) -> None:
    for line in lines:
        recipe.warnings.append(line)
        say(f"warning: {line}")


def check_recipe(recipe: Recipe) -> RunConfig:
    """accelerate's reading of its config; the recipe as the ranks will parse it, the model and the dataset. Sets
    recipe.cfg."""
    cfg = check_settings(recipe)
    check_model_and_data(recipe, cfg)
    return cfg


def check_settings(recipe: Recipe) -> RunConfig:
    """accelerate's reading of its config, the recipe as the ranks will parse it and its settings: what the
    launcher knows before it reads the model's files and the data (the previous run's decision comes between). Sets
    recipe.cfg."""
    acc = recipe.accelerate
    named = recipe.folder / "accelerate.yaml"  # what the user edits, also when a smoke test runs a scaled copy
    accelerate_yaml.check_accelerate_keys(named, recipe.accelerate_written)
    with warnings.catch_warnings():  # the training processes parse again and show these warnings there
        warnings.simplefilter("ignore")
        cfg = run_checks.parse_and_check(recipe.argv(), nodes=job_machines(acc), raw=recipe.raw,
                                         world_size=job_processes(acc))
    warn(recipe, value_checks.schedule_warnings(cfg.training)
         + value_checks.unused_lora_flags(recipe.overrides, cfg.model.use_peft)
         + value_checks.epochs_ignored(recipe.overrides, cfg.training))
    accelerate_yaml.check_fsdp_with_peft(acc, cfg.model.use_peft, named, job_processes(acc))
    speed.check_launch(cfg, acc, named)  # their accelerate rules, their GPUs (nvidia-smi)
    recipe.cfg = cfg
    return cfg


def check_model_and_data(recipe: Recipe, cfg: RunConfig) -> None:
    """The parsed recipe against its model (the mesh's heads, the wrap class, LoRA targets) and its local data (the
    format, the rows, the token lengths)."""
    acc, named = recipe.accelerate, recipe.folder / "accelerate.yaml"
    model_json = model_found.model_config_json(cfg.model.model_name_or_path, cfg.model.model_revision)
    shape = json.loads(model_json.read_text()) if model_json else {}
    mesh.check_mesh_fits(mesh.mesh_of(acc, named), named, shape.get("num_attention_heads"),
                         shape.get("num_key_value_heads"), getattr(cfg.training, "max_length", None), cfg)

    def more(model, acc: dict, path) -> None:  # the meta-device model's checks: the options', and its context
        speed.check_model(model, acc, path)
        beyond = yarn.beyond_context(cfg, getattr(model.config, "max_position_embeddings", None),
                                     type(model).__name__)  # the class `make plan` names
        warn(recipe, [beyond] if beyond else [])

    wrap = model_check.check(cfg.model.model_name_or_path, recipe.folder, acc, named, cfg.model,
                             wrap_on_command_line=bool(recipe.launch_options), more=more,
                             model_named=recipe.user_model is not None)
    if wrap and wrap.warning:  # which layers FSDP wraps, and why those
        warn(recipe, [wrap.line])
    elif wrap:
        say(wrap.line)
    if wrap and wrap.chosen:  # the model on the command line lacks the recipe's class: its own, for accelerate
        recipe.launch_options = [accelerate_yaml.WRAP_OPTION, ",".join(wrap.chosen)]
        fsdp = dict(acc["fsdp_config"], **{model_check.WRAP_KEY: ",".join(wrap.chosen)})
        recipe.accelerate = acc = dict(acc, fsdp_config=fsdp)
    if loading.is_local(cfg.script, cfg.mixture):
        import datasets

        kind = kinds.load(cfg.trainer)
        datasets.disable_progress_bars()  # a check, not work to watch: keep its error the only line
        # datasets logs a bad JSON file at error level with its traceback; loading.py names the line instead
        datasets.utils.logging.set_verbosity(datasets.utils.logging.CRITICAL)
        splits = kind.load_datasets(cfg)
        for line in loading.NOTES:  # the format found and how it maps; the eval split, or that there is none
            say(line)
        warn(recipe, loading.WARNINGS)
        # a local model's tokenizer, with the chat template the trainer will use (a hub model's: rank 0 measures)
        tokenizer, template = recipe_tokenizer.load_tokenizer(cfg, cached=False)
        # the rows: errors with the file and line; rows that teach nothing are one counted warning
        warn(recipe, kind.check_data(cfg, splits, tokenizer))
        if tokenizer is not None:  # token lengths, and what max_length cuts: a table, and one warning where it cuts
            measured = lengths.measure_splits(cfg, splits, tokenizer, template)
            table, cut = length_report.report(measured, cfg, tokenizer, cfg.script.dataset_name or "mixture")
            for line in table:
                say(line)
            warn(recipe, cut)
    elif model_found.looks_local(cfg.model.model_name_or_path):  # hub data's rows are rank 0's; its tokenizer ours
        recipe_tokenizer.local_tokenizer(cfg.model.model_name_or_path,
                                        bool(getattr(cfg.training, "trust_remote_code", False)))
