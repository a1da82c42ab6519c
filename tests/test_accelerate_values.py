"""config/accelerate_values.py: its allowed values are accelerate's own, the pack's configs pass, and a bad value is
one line naming the file, the key, the value and the allowed ones (tests/test_mistakes.py: through the launcher)."""

from pathlib import Path

import pytest
import yaml

from fsdp_recipes.config import accelerate_values as values
from fsdp_recipes.errors import UserError

REPO = Path(__file__).resolve().parents[1]


def test_the_allowed_values_are_accelerates():
    from accelerate.utils import constants
    from accelerate.utils.dataclasses import DistributedType, PrecisionType

    assert sorted(values.MIXED_PRECISION) == sorted(p.value for p in PrecisionType)
    assert sorted(values.DISTRIBUTED_TYPES) == sorted(d.value for d in DistributedType)
    assert values.FSDP_AUTO_WRAP_POLICY == constants.FSDP_AUTO_WRAP_POLICY
    assert values.FSDP_STATE_DICT_TYPE == constants.FSDP_STATE_DICT_TYPE
    assert values.FSDP_SHARDING_STRATEGY == constants.FSDP_SHARDING_STRATEGY
    assert values.FSDP_BACKWARD_PREFETCH == constants.FSDP_BACKWARD_PREFETCH


CONFIGS = sorted(REPO.glob("accelerate_configs/*.yaml")) + sorted(REPO.glob("recipes/*/accelerate.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(REPO)))
def test_the_packs_configs_pass(path):
    raw = yaml.safe_load(path.read_text())
    if "compute_environment" in raw:  # accelerate_configs/recipes.yaml is the recipes' table, no accelerate config
        values.check_values(path, raw)


@pytest.mark.parametrize("raw, fragment", [
    ({"mixed_precision": False}, "mixed_precision False is not one of no, fp16, bf16, fp8"),
    ({"distributed_type": "FSPD"}, "distributed_type 'FSPD' is not one of NO, MULTI_CPU"),
    ({"num_machines": 0}, "num_machines 0 is not a whole number of 1 or more"),
    ({"fsdp_config": {"fsdp_version": 1, "fsdp_sharding_strategy": "FULL"}}, "fsdp_sharding_strategy 'FULL'"),
    ({"fsdp_config": {"fsdp_version": 1, "fsdp_reshard_after_forward": "ALL"}}, "'ALL' is not one of FULL_SHARD"),
    ({"fsdp_config": {"fsdp_offload_params": "sometimes"}}, "fsdp_offload_params 'sometimes' is not one of true"),
    ({"parallelism_config": {"parallelism_config_dp_shard_size": "eight"}}, "parallelism_config_dp_shard_size 'eight'"),
])
def test_a_bad_value_is_one_line(raw, fragment):
    with pytest.raises(UserError) as err:
        values.check_values("x/accelerate.yaml", raw)
    line = str(err.value)
    assert line.startswith("x/accelerate.yaml: ") and fragment in line and "Fix: " in line and "\n" not in line, line


def test_what_accelerate_reads_passes():
    values.check_values("a.yaml", {"mixed_precision": "BF16", "num_processes": "8", "fsdp_config": {
        "fsdp_version": 1, "fsdp_reshard_after_forward": "shard_grad_op", "fsdp_sharding_strategy": 1,
        "fsdp_use_orig_params": "True"}})
    values.check_values("a.yaml", {"fsdp_config": {"fsdp_version": "2", "fsdp_reshard_after_forward": "false"}})


def test_what_accelerate_skips_or_numbers_passes_and_what_it_rejects_does_not():
    """A review found: nulls accelerate skips (utils/launch.py) and the enums' numbers it reads
    (StateDictType(int(...)), BackwardPrefetch(int(...))) were refused; a lowercase distributed_type, which
    DistributedType("fsdp") rejects in the ranks, passed."""
    values.check_values("a.yaml", {"fsdp_config": {"fsdp_version": 1, "fsdp_auto_wrap_policy": None,
                                                   "fsdp_state_dict_type": 2, "fsdp_backward_prefetch": "1"}})
    values.check_values("a.yaml", {"fsdp_config": {"fsdp_version": 2, "fsdp_state_dict_type": None,
                                                   "fsdp_backward_prefetch": None}})
    with pytest.raises(UserError, match=r"fsdp_state_dict_type 4 is not one of"):
        values.check_values("a.yaml", {"fsdp_config": {"fsdp_version": 1, "fsdp_state_dict_type": 4}})
    with pytest.raises(UserError, match=r"distributed_type 'fsdp' is not one of NO"):
        values.check_values("a.yaml", {"distributed_type": "fsdp"})
    # FSDP2 has no backward prefetch key at all: accelerate_yaml's FSDP1 rule says to remove it, not a value to use
    values.check_values("a.yaml", {"fsdp_config": {"fsdp_version": 2, "fsdp_backward_prefetch": "PRE"}})


def test_ram_efficient_loadings_yes_no_is_its_speed_options_to_check():
    from fsdp_recipes.speed import ram_efficient_loading

    acc = {"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 2, "fsdp_cpu_ram_efficient_loading": "maybe"}}
    values.check_values("a.yaml", acc)  # not this module's key (test_speed_options: named in speed/ alone)
    with pytest.raises(UserError, match=r"^a.yaml: fsdp_config.fsdp_cpu_ram_efficient_loading 'maybe' is not one of "
                                        r"true, false\. Fix: fsdp_cpu_ram_efficient_loading: true or false\.$"):
        ram_efficient_loading.check_accelerate(acc, "a.yaml")
