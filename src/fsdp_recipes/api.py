"""The pack's Python interface for programs outside it: benchmarks, dev scripts, a user's notebook.

    from fsdp_recipes.api import load_recipe, plan_recipe, budget

Everything else in the package is its inside and may move between releases; `bench/` and `scripts/` import only
these names (tests/test_api.py fails on any other import of the pack there). A name is imported when first used, so
`import fsdp_recipes.api` costs nothing (the planner's and trainer's imports pull torch); `tests/test_api.py` resolves
every row, so a row whose target moved fails there, not in a benchmark on a GPU.
"""

from __future__ import annotations

import importlib

# name -> "module:attribute" (one module, data.loading, is a row of its own: bench/data.py times its load_for)
EXPORTS: dict[str, str] = {
    # recipes and their configuration
    "load_recipe": "fsdp_recipes.config.recipes:load",  # Recipe: the folder, its YAMLs and the overrides, read once
    "available_recipes": "fsdp_recipes.config.recipes:available",
    "recipe_config_file": "fsdp_recipes.config.recipes:config_file",
    "parse_args": "fsdp_recipes.config.run_config:parse_args",  # the RunConfig every rank parses
    "parse_and_check": "fsdp_recipes.train.run_checks:parse_and_check",  # ... with the launcher's checks
    "check_recipe": "fsdp_recipes.launch.checks:check_recipe",
    "check_fsdp_with_peft": "fsdp_recipes.config.accelerate_yaml:check_fsdp_with_peft",
    "load_yaml": "fsdp_recipes.config.yaml_keys:load_yaml",
    "model_config": "fsdp_recipes.config.model_check:load_config",
    "meta_model": "fsdp_recipes.config.model_check:meta_model",  # the recipe's model on the meta device
    "gpus_here": "fsdp_recipes.config.placement:gpus_here",
    "GPUS_ENV": "fsdp_recipes.config.placement:ENV",
    "cpu_bf16_flags": "fsdp_recipes.config.hardware:cpu_bf16_flags",
    "nvidia_smi": "fsdp_recipes.config.hardware:nvidia_smi",
    # the planner (`fsdp-recipes plan`)
    "plan_recipe": "fsdp_recipes.planning.plan:load_recipe",  # (folder, accelerate, RunConfig, meta model)
    "model_shape": "fsdp_recipes.planning.plan:model_shape",
    "planned_setups": "fsdp_recipes.planning.plan:setups",
    "budget_markdown": "fsdp_recipes.planning.plan:budget_markdown",
    "budget": "fsdp_recipes.planning.memory_budget:budget",
    "Setup": "fsdp_recipes.planning.memory_budget:Setup",
    "activations_per_token_per_layer": "fsdp_recipes.planning.memory_budget:activations_per_token_per_layer",
    "Topology": "fsdp_recipes.planning.comms:Topology",
    "Work": "fsdp_recipes.planning.comms:Work",
    "estimate_comms": "fsdp_recipes.planning.comms:estimate",  # each collective's group and bytes
    "ring_bytes": "fsdp_recipes.planning.comms:ring_bytes",
    "fabric": "fsdp_recipes.planning.fabric:fabric",
    "count_params": "fsdp_recipes.metrics.flops:count_params",
    # training: what the entry point builds, for a program that drives the steps itself
    "set_up_process": "fsdp_recipes.train.build:set_up_process",
    "run_report_for": "fsdp_recipes.train.build:run_report_for",
    "trainer_for": "fsdp_recipes.train.build:trainer_for",
    "train_main": "fsdp_recipes.train.entry:main",  # the rank entry point (`fsdp-recipes-train`)
    "train_once": "fsdp_recipes.train.entry:train_once",  # one run that leaves the process group up
    "exit_without_teardown": "fsdp_recipes.train.entry:exit_without_teardown",
    "accelerate_cmd": "fsdp_recipes.launch.ranks:accelerate_cmd",
    "enable_cpu_fsdp": "fsdp_recipes.patches.cpu_fsdp:enable",  # FSDP on gloo, before the process group
    # tensor parallel as the entry point sets it up: the mesh, then transformers' DistributedConfig for from_pretrained
    "set_up_tensor_parallel": "fsdp_recipes.train.tensor_parallel:set_up_process",
    "tensor_parallel_config": "fsdp_recipes.train.tensor_parallel:distributed_config",
    "free_port": "fsdp_recipes.dist:free_port",
    "rank": "fsdp_recipes.dist:rank",
    "barrier": "fsdp_recipes.dist:barrier",
    "gather_objects": "fsdp_recipes.dist:gather_objects",
    "data_loading": "fsdp_recipes.data.loading",  # load_for: a recipe's dataset as its trainer kind loads it
    # the smoke run's tiny stand-ins of a recipe's model (`fsdp-recipes smoke`)
    "smoke_model_source": "fsdp_recipes.launch.smoke:model_source",
    "build_smoke_model": "fsdp_recipes.launch.smoke:build_model",
    "fit_smoke_tokenizer": "fsdp_recipes.launch.smoke:fit_tokenizer",
    "shrink_model_config": "fsdp_recipes.launch.smoke:shrink",
    "scale_accelerate": "fsdp_recipes.launch.smoke:scale_accelerate",  # a recipe's accelerate YAML for fewer GPUs
    "SUMMARY_FORCE_ENV": "fsdp_recipes.launch.summary:FORCE_ENV",
    "SUMMARY_PROMPTS_ENV": "fsdp_recipes.launch.summary:PROMPTS_ENV",
    # speed and memory options
    "settle_speed_options": "fsdp_recipes.speed:settle",  # as the entry point does, before the trainer is built
    "CHECKPOINTING_POLICIES": "fsdp_recipes.speed.activation_checkpointing:CANDIDATES",
    "checkpointing_setup_fields": "fsdp_recipes.speed.activation_checkpointing:setup_fields",
    "SPEED_OPTIONS": "fsdp_recipes.speed:OPTIONS",  # the registry: an option's module by its name
    "four_bit_planner_setup": "fsdp_recipes.speed.four_bit:planner_setup",
    "torch_varlen_available": "fsdp_recipes.speed.varlen_attention:torch_varlen_available",
    "varlen_kernel": "fsdp_recipes.speed.varlen_attention:varlen_kernel",
    "varlen_row_by_row": "fsdp_recipes.speed.varlen_attention:row_by_row",  # the kernel's reference
    # local assets: the tests' tiny model and data, the default's SmolLM2
    "ensure_tiny_assets": "fsdp_recipes.assets.tiny_assets:ensure_assets",
    "build_tiny_model": "fsdp_recipes.assets.tiny_assets:build_model",
    "make_example": "fsdp_recipes.assets.tiny_assets:make_example",
    "write_tiny_dataset": "fsdp_recipes.assets.tiny_assets:write_dataset",
    "ensure_smollm2": "fsdp_recipes.assets.smollm2:ensure_assets",
    "SMOLLM2_DIST": "fsdp_recipes.assets.smollm2:DIST",
    "SMOLLM2_INSTALL": "fsdp_recipes.assets.smollm2:INSTALL",
    "ADDITION_TRAIN_QUESTIONS": "fsdp_recipes.assets.addition_preferences:TRAIN_QUESTIONS",
    "cache_dir": "fsdp_recipes.paths:cache_dir",
    # evaluation
    "generate": "fsdp_recipes.evaluation.generation:generate",
    "wilson": "fsdp_recipes.evaluation.intervals:wilson",
    "paired": "fsdp_recipes.evaluation.intervals:paired",
    "mcnemar_exact": "fsdp_recipes.evaluation.intervals:mcnemar_exact",
    # runs and records
    "latest_complete": "fsdp_recipes.checkpoint.markers:latest_complete",
    "versions": "fsdp_recipes.metrics.environment:versions",
    "device_info": "fsdp_recipes.metrics.environment:device_info",
    "file_stamp": "fsdp_recipes.records:file_stamp",
    "now_iso": "fsdp_recipes.records:now_iso",
    "write_json_atomic": "fsdp_recipes.records:write_json_atomic",
    "UserError": "fsdp_recipes.errors:UserError",
    "EXIT_PREEMPTED": "fsdp_recipes.errors:EXIT_PREEMPTED",
}

__all__ = sorted(EXPORTS)


def __getattr__(name: str):
    target = EXPORTS.get(name)
    if target is None:
        raise AttributeError(f"fsdp_recipes.api has no {name!r}: its names are in EXPORTS (docs/api.md)")
    module, _, attribute = target.partition(":")
    value = importlib.import_module(module)
    if attribute:
        value = getattr(value, attribute)
    globals()[name] = value  # once
    return value


def __dir__():
    return __all__
