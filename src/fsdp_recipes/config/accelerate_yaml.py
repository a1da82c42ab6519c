"""The recipe's accelerate YAML: read it, reject keys accelerate would ignore, and check that its FSDP/HSDP
topology and settings fit the job and the method (LoRA or full) before any process starts.
"""

from __future__ import annotations

from pathlib import Path

from fsdp_recipes.config.accelerate_values import check_values
from fsdp_recipes.config.yaml_keys import _suggest, load_yaml
from fsdp_recipes.errors import UserError


def check_accelerate_config(path: str | Path) -> dict:
    """Parse with accelerate's own loader, then apply the rules that accelerate only discovers at run time."""
    raw = read_accelerate_config(path)
    check_accelerate_keys(path, raw)
    return raw



def read_accelerate_config(path: str | Path) -> dict:
    """The YAML and the pack's FSDP rules, without importing accelerate (which imports torch, 2 s: the launcher
    needs the config before it starts the ranks, and checks the keys while they import)."""
    raw = load_yaml(path, "accelerate config")
    check_values(path, raw)  # a bad value: one line now, not an error in the ranks
    fsdp = raw.get("fsdp_config") or {}
    if raw.get("distributed_type") == "FSDP":
        version = int(fsdp.get("fsdp_version", 1))
        if version == 2:
            fsdp1_only = sorted(k for k in fsdp if k in FSDP1_ONLY_KEYS)
            if fsdp1_only:
                raise UserError(
                    f"{path}: {', '.join(fsdp1_only)} only apply to FSDP1 but fsdp_version is 2. "
                    "Fix: remove them (FSDP2 uses fsdp_reshard_after_forward instead of fsdp_sharding_strategy)."
                )
    return raw



WRAP_OPTION = "--fsdp_transformer_layer_cls_to_wrap"


def take_wrap_override(overrides: list[str], acc: dict, path) -> tuple[list[str], dict, list[str]]:
    """`--fsdp_transformer_layer_cls_to_wrap A[,B]` among a recipe's command-line overrides is an `accelerate launch`
    option, not a recipe field: returns the overrides without it, the accelerate config with it (what the checks
    read) and the option for `accelerate launch` (which lets it win over the config file); the last one given
    counts. Unchanged where it is not given."""
    rest, value = [], None
    args = iter(overrides)
    for arg in args:
        if arg == WRAP_OPTION:
            value = next(args, "")
        elif arg.startswith(WRAP_OPTION + "="):
            value = arg.split("=", 1)[1]
        else:
            rest.append(arg)
    if value is None:
        return list(overrides), acc, []
    classes = [c.strip() for c in value.split(",") if c.strip()]
    if not classes or value.startswith("-"):
        raise UserError(f"{WRAP_OPTION} needs a class name, e.g. {WRAP_OPTION} Qwen2DecoderLayer (several: "
                        "A,B). Fix: add the model's decoder layer class, or leave the option out (the pack then "
                        "wraps the model's own, its _no_split_modules).")
    fsdp = acc.get("fsdp_config") or {}
    if acc.get("distributed_type") != "FSDP" or fsdp.get("fsdp_auto_wrap_policy") != "TRANSFORMER_BASED_WRAP":
        raise UserError(f"{WRAP_OPTION} applies to FSDP wrapping by layer class, and {path} does not wrap so "
                        f"(distributed_type {acc.get('distributed_type')}, fsdp_auto_wrap_policy "
                        f"{fsdp.get('fsdp_auto_wrap_policy')}). Fix: leave the option out, or set "
                        "fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP there.")
    joined = ",".join(classes)
    acc = dict(acc, fsdp_config=dict(fsdp, fsdp_transformer_layer_cls_to_wrap=joined))
    return rest, acc, [WRAP_OPTION, joined]



def check_accelerate_keys(path: str | Path, raw: dict) -> None:
    """accelerate's own loader, and the keys in sections where accelerate ignores unknown ones silently."""
    from accelerate.commands.config.config_args import load_config_from_file

    try:
        load_config_from_file(str(path))
    except Exception as err:  # accelerate raises TypeError/ValueError for unknown or bad keys
        raise UserError(f"accelerate cannot read {path}: {err}. Fix: compare with accelerate_configs/.") from None
    for section in ("fsdp_config", "parallelism_config"):
        known = launch_options(section.split("_config")[0] + "_")
        for key in raw.get(section) or {}:
            if key not in known:
                raise UserError(f"{path}: unknown {section} key `{key}` (accelerate would ignore it). "
                                f"Fix: {_suggest(key, known)}")



def launch_options(prefix: str) -> set[str]:
    """The `accelerate launch` options starting with `prefix`: the keys its config sections may hold."""
    from accelerate.commands.launch import launch_command_parser

    return {a.dest for a in launch_command_parser()._actions if a.dest.startswith(prefix)}



def hsdp_sizes(acc: dict) -> tuple[int, int] | None:
    """(replicate, shard) group sizes of an FSDP2 HSDP config, else None."""
    par = acc.get("parallelism_config") or {}
    replicate = int(par.get("parallelism_config_dp_replicate_size", 1))
    if acc.get("distributed_type") != "FSDP" or replicate <= 1:
        return None
    return replicate, int(par.get("parallelism_config_dp_shard_size", 1))



def check_topology(acc: dict, path, num_machines: int, num_processes: int) -> None:
    """An HSDP layout must cover the world exactly, with each shard group inside one node."""
    sizes = hsdp_sizes(acc)
    if sizes is None:
        return
    replicate, shard = sizes
    par = acc.get("parallelism_config") or {}
    if any(int(par.get(f"parallelism_config_{d}_size", 1)) > 1 for d in ("tp", "cp")):
        return  # a mesh with more dimensions: config/mesh.py checks its product
    if replicate * shard != num_processes:
        raise UserError(
            f"{path}: dp_replicate_size {replicate} x dp_shard_size {shard} = {replicate * shard}, but the job has "
            f"{num_processes} processes. Fix: make their product the world size ({num_machines} node(s) x GPUs per node)."
        )
    per_node = num_processes // max(num_machines, 1)
    if num_machines > 1 and (shard > per_node or per_node % shard):
        raise UserError(
            f"{path}: a shard group of {shard} does not fit inside one node of {per_node} GPUs, so FSDP's all-gathers "
            f"would cross the network. Fix: set parallelism_config_dp_shard_size to {per_node} (or a divisor of it)."
        )



def check_fsdp_with_peft(acc: dict, use_peft: bool, path, processes: int = 2) -> None:
    """FSDP1 flattens parameters; LoRA mixes frozen and trainable ones, which needs use_orig_params. And FSDP1 on
    one process runs NO_SHARD, whose state dict of a LoRA model torch cannot build: the first checkpoint save fails
    in torch's post-hook ("FSDP assumes ...weight is in the state_dict"), whatever fsdp_state_dict_type says. Seen
    with SHARDED_ and FULL_STATE_DICT on CPU (torch 2.13) and with FULL_STATE_DICT on an H100 (torch 2.11, the
    first GPU run's smoke of mistral-small-lora, 2026-11-26), so the run would lose its work at the first save."""
    fsdp = acc.get("fsdp_config") or {}
    if not (use_peft and acc.get("distributed_type") == "FSDP" and int(fsdp.get("fsdp_version", 1)) == 1):
        return
    if not fsdp.get("fsdp_use_orig_params"):
        raise UserError(
            f"{path}: LoRA under FSDP1 needs fsdp_use_orig_params: true (FSDP1 cannot flatten frozen and trainable "
            "parameters together). Fix: set fsdp_use_orig_params: true, or use fsdp_version: 2."
        )
    if processes == 1:
        raise UserError(
            f"{path}: LoRA under FSDP1 with one process cannot save checkpoints (FSDP1 runs NO_SHARD there, and "
            "torch cannot build its state dict of a LoRA model: the first save fails). Fix: fsdp_version: 2 "
            "(accelerate_configs/fsdp2_1node.yaml), or num_processes 2 or more (on one GPU, a smoke run checks "
            "the recipe on CPU instead: CUDA_VISIBLE_DEVICES= make smoke)."
        )


# Keys that mean something only to FSDP1; accelerate ignores or rejects them under FSDP2 (its FSDP2 migration
# guide). A user who writes them in an FSDP2 config expects an effect they will not get.
FSDP1_ONLY_KEYS = {
    "fsdp_sharding_strategy",
    "fsdp_backward_prefetch",
    "fsdp_forward_prefetch",
    "fsdp_use_orig_params",
    "fsdp_sync_module_states",
}
