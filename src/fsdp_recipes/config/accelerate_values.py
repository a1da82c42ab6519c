"""The values of a recipe's accelerate YAML, checked when the recipe is read (before any rank starts): accelerate
itself finds a bad one only in the ranks, some cryptically (`fsdp_version: 3` reads `true` as a sharding strategy:
KeyError 'TRUE'; a word for a yes/no: "invalid truth value maybe", naming no key).

The allowed values are accelerate's own (accelerate.utils.constants and its dataclasses' enums), copied here
because importing accelerate imports torch (2 s, and the launcher reads this before the ranks import);
tests/test_accelerate_values.py fails when accelerate's differ.
"""

from __future__ import annotations

from pathlib import Path

from fsdp_recipes.errors import UserError

# accelerate.utils.dataclasses.PrecisionType, DistributedType
MIXED_PRECISION = ["no", "fp16", "bf16", "fp8"]
DISTRIBUTED_TYPES = ["NO", "MULTI_CPU", "MULTI_GPU", "MULTI_NPU", "MULTI_MLU", "MULTI_SDAA", "MULTI_MUSA",
                     "MULTI_XPU", "DEEPSPEED", "FSDP", "XLA", "MEGATRON_LM", "MULTI_HPU", "MULTI_NEURON"]
# accelerate.utils.constants
FSDP_AUTO_WRAP_POLICY = ["TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP"]
FSDP_STATE_DICT_TYPE = ["FULL_STATE_DICT", "LOCAL_STATE_DICT", "SHARDED_STATE_DICT"]
FSDP_SHARDING_STRATEGY = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"]
FSDP_BACKWARD_PREFETCH = ["BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH"]
FSDP_VERSIONS = [1, 2]
# accelerate.utils.environment.str_to_bool, which reads the env vars `accelerate launch` writes from these keys
TRUTH = ("y", "yes", "t", "true", "on", "1", "n", "no", "f", "false", "off", "0")
# (RAM-efficient loading's own key is its speed option's to check: speed/ram_efficient_loading.py)
FSDP_YES_NO = ["fsdp_offload_params", "fsdp_activation_checkpointing", "fsdp_use_orig_params",
               "fsdp_sync_module_states", "fsdp_forward_prefetch"]
COUNTS = {"num_processes": 1, "num_machines": 1, "machine_rank": 0}  # the smallest each may be


def check_values(path: str | Path, raw: dict) -> None:
    """One line naming the file, the key, the value and the allowed values for the first bad one."""
    mixed = raw.get("mixed_precision")
    if mixed is not None and str(mixed).lower() not in MIXED_PRECISION:
        bad(path, "mixed_precision", mixed, MIXED_PRECISION,
            "bf16 on GPUs that have it, else 'no' (quoted: YAML reads no as false)")
    dist = raw.get("distributed_type")
    if dist is not None and (dist is False or str(dist) not in DISTRIBUTED_TYPES):  # DistributedType(value): as written
        bad(path, "distributed_type", dist, DISTRIBUTED_TYPES,
            "FSDP (write \"NO\" quoted: YAML reads no as false)")
    for key, least in COUNTS.items():
        if key in raw and not count(raw[key], least):
            raise UserError(f"{path}: {key} {raw[key]!r} is not a whole number of {least} or more. "
                            f"Fix: write it as a number, e.g. {key}: {least}.")
    fsdp = raw.get("fsdp_config") or {}
    if not isinstance(fsdp, dict):
        raise UserError(f"{path}: fsdp_config is not a section of keys. Fix: compare with accelerate_configs/.")
    version = fsdp.get("fsdp_version", 1)
    if not count(version, 1) or int(str(version)) not in FSDP_VERSIONS:
        bad(path, "fsdp_config.fsdp_version", version, FSDP_VERSIONS, "2 (FSDP2)")
    version = int(str(version))
    for key, allowed, fix, numbered in (
            ("fsdp_auto_wrap_policy", FSDP_AUTO_WRAP_POLICY,
             "TRANSFORMER_BASED_WRAP (one FSDP unit per decoder layer)", False),
            ("fsdp_state_dict_type", FSDP_STATE_DICT_TYPE, "FULL_STATE_DICT or SHARDED_STATE_DICT", True),
            ("fsdp_backward_prefetch", FSDP_BACKWARD_PREFETCH, "BACKWARD_PRE", True)):
        value = fsdp.get(key)
        if value is None or (key == "fsdp_backward_prefetch" and version == 2):
            continue  # accelerate skips a null; FSDP2 has no such key, which accelerate_yaml's FSDP1 rule names
        # accelerate takes the enum's number too (StateDictType(int(...)), BackwardPrefetch(int(...)))
        in_range = numbered and str(value).isdigit() and 1 <= int(str(value)) <= len(allowed)
        if not in_range and str(value).upper() not in allowed:
            bad(path, f"fsdp_config.{key}", value, allowed, fix)
    if version == 2 and str(fsdp.get("fsdp_state_dict_type", "")).upper() == "LOCAL_STATE_DICT":
        bad(path, "fsdp_config.fsdp_state_dict_type", fsdp["fsdp_state_dict_type"], ["FULL_STATE_DICT",
            "SHARDED_STATE_DICT"], "FULL_STATE_DICT or SHARDED_STATE_DICT (FSDP2 has no LOCAL_STATE_DICT)")
    strategy = fsdp.get("fsdp_sharding_strategy")
    if strategy is not None and version == 1 and not sharding_strategy(strategy):  # FSDP2: accelerate_yaml's rule
        bad(path, "fsdp_config.fsdp_sharding_strategy", strategy, FSDP_SHARDING_STRATEGY, "FULL_SHARD")
    for key in FSDP_YES_NO:
        if key in fsdp and not yes_no(fsdp[key]):
            bad(path, f"fsdp_config.{key}", fsdp[key], ["true", "false"], "true or false")
    reshard = fsdp.get("fsdp_reshard_after_forward")
    if reshard is not None and version == 2 and not yes_no(reshard):
        bad(path, "fsdp_config.fsdp_reshard_after_forward", reshard, ["true", "false"],
            "true (shard again after each layer's forward) or false (keep them gathered: more memory, less traffic)")
    if reshard is not None and version == 1 and not (yes_no(reshard) or sharding_strategy(reshard)):
        bad(path, "fsdp_config.fsdp_reshard_after_forward", reshard, FSDP_SHARDING_STRATEGY, "FULL_SHARD")
    for key, value in (raw.get("parallelism_config") or {}).items():
        if key.endswith("_size") and not count(value, 1):
            raise UserError(f"{path}: parallelism_config.{key} {value!r} is not a whole number of 1 or more. "
                            "Fix: write it as a number, e.g. 1.")


def bad(path, key: str, value, allowed: list, fix: str) -> None:
    raise UserError(f"{path}: {key} {value!r} is not one of {', '.join(map(str, allowed))}. "
                    f"Fix: {key.split('.')[-1]}: {fix}.")


def count(value, least: int) -> bool:
    """A whole number (an int, or its digits in a string) of at least `least`; not a bool."""
    if isinstance(value, bool) or not isinstance(value, (int, str)) or not str(value).strip().isdigit():
        return False
    return int(str(value)) >= least


def yes_no(value) -> bool:
    return isinstance(value, (bool, int, str)) and str(value).lower() in TRUTH


def sharding_strategy(value) -> bool:
    """A name (any case) or its number 1-5, as accelerate's FSDP1 plugin reads it."""
    text = str(value).upper()
    return not isinstance(value, bool) and (text in FSDP_SHARDING_STRATEGY
                                            or (text.isdigit() and 1 <= int(text) <= len(FSDP_SHARDING_STRATEGY)))
