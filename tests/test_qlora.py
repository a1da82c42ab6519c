"""QLoRA under FSDP2 (config/quantization.py): the 4-bit storage in FSDP's own dtype, the settings FSDP cannot shard
refused before any rank starts, and a 2-process run whose storage is sharded and whose losses equal one process's."""

import json
from types import SimpleNamespace

import pytest

from conftest import launch, need_module
from fsdp_recipes.config import quantization
from fsdp_recipes.errors import UserError
from recipe_variant import recipe_variant

FSDP2 = {"distributed_type": "FSDP", "mixed_precision": "no", "fsdp_config": {"fsdp_version": 2}}


def model_args(**kw):
    base = dict(load_in_4bit=True, load_in_8bit=False, use_peft=True, dtype="float32", bnb_4bit_quant_storage=None,
                bnb_4bit_quant_type="nf4", use_bnb_nested_quant=False)
    return SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize("acc, dtype, want", [
    ({"mixed_precision": "bf16"}, "float32", "bfloat16"),  # FSDP2's MixedPrecisionPolicy casts to bf16: store bf16
    ({"mixed_precision": "fp16"}, "bfloat16", "float16"),
    ({"mixed_precision": "no"}, "float32", "float32"),  # no policy: the model's own dtype
    ({}, "bfloat16", "bfloat16"),
])
def test_the_storage_is_the_dtype_fsdp_gathers_in(acc, dtype, want):
    assert quantization.fsdp_param_dtype(acc, dtype) == want


def test_the_pack_sets_the_storage_it_passes_to_transformers():
    need_module("bitsandbytes")
    import torch

    args = model_args(dtype="bfloat16")
    config = quantization.quantization_config(args, "bf16")
    assert config.load_in_4bit and config.bnb_4bit_quant_type == "nf4"
    assert config.bnb_4bit_quant_storage == torch.bfloat16 and args.bnb_4bit_quant_storage == "bfloat16"
    assert quantization.quantization_config(model_args(load_in_4bit=False), "bf16") is None


@pytest.mark.parametrize("changes, acc, fragment", [
    ({"load_in_4bit": False, "load_in_8bit": True}, FSDP2, "load_in_8bit cannot be sharded by FSDP"),
    ({"use_peft": False}, FSDP2, "4-bit weights cannot be trained"),
    ({"dtype": "auto"}, FSDP2, "load_in_4bit with dtype 'auto'"),
    ({"bnb_4bit_quant_storage": "uint8"}, FSDP2, "bnb_4bit_quant_storage uint8 differs"),  # accelerate issue 3983
    ({"bnb_4bit_quant_storage": "float32"}, {**FSDP2, "mixed_precision": "bf16"}, "corrupt them"),  # rounds bits
    ({}, {**FSDP2, "fsdp_config": {"fsdp_version": 1}}, "under FSDP1 is not checked"),
])
def test_what_fsdp_cannot_shard_is_refused(changes, acc, fragment):
    need_module("bitsandbytes")
    with pytest.raises(UserError, match=fragment) as err:
        quantization.check(model_args(**changes), acc, "accelerate.yaml")
    assert "Fix:" in str(err.value)


def test_a_right_setting_passes():
    need_module("bitsandbytes")
    quantization.check(model_args(), FSDP2, "accelerate.yaml")
    quantization.check(model_args(bnb_4bit_quant_storage="bfloat16", dtype="bfloat16"),
                       {**FSDP2, "mixed_precision": "bf16"}, "accelerate.yaml")
    quantization.check(model_args(load_in_4bit=False), FSDP2, "x")  # no 4 bits: nothing to check


def losses(run):
    history = json.loads((run / "log_history.json").read_text())["log_history"]
    return {h["step"]: h["loss"] for h in history if "loss" in h}


@pytest.mark.slow
def test_qlora_on_two_processes_shards_the_4bit_storage_and_matches_one_process(tmp_path, cache_dir):
    need_module("bitsandbytes")
    common = ["--load_in_4bit", "true", "--max_steps", "4", "--logging_steps", "1", "--eval_strategy", "no",
              "--save_merged_model", "false", "--warmup_steps", "0"]
    two = tmp_path / "two"
    res = launch(["tiny-cpu-lora", *common, "--output_dir", str(two)], cache_dir)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    one_recipe = recipe_variant(tmp_path, "one", accelerate={"num_processes": 1})
    one = tmp_path / "one-run"
    res = launch([str(one_recipe), *common, "--per_device_train_batch_size", "32",  # the same 32 rows per step
                  "--output_dir", str(one)], cache_dir)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]

    a, b = losses(two), losses(one)
    assert all(v == v and 0 < v < 20 for v in a.values()), a  # finite, not the 0 or NaN of accelerate issue 3983
    assert a[4] < a[1], a  # falling
    for step in range(1, 5):  # float32 throughout: only the reduction order differs
        assert a[step] == pytest.approx(b[step], rel=1e-3), (step, a, b)

    m2, m1 = (json.loads((r / "metrics.json").read_text()) for r in (two, one))
    # the packed 4-bit storage is sharded: each rank holds half of what one process holds
    assert m2["param_shards"]["local_numel_per_rank"] == [m1["param_shards"]["global_numel"] // 2] * 2
    args = json.loads((two / "run_args.json").read_text())["model_args"]
    assert args["load_in_4bit"] is True and args["bnb_4bit_quant_storage"] == "float32"  # set by the pack
    assert m2["final_save_check"]["tensors"] > 0  # every rank's adapter shards complete in the saved file
