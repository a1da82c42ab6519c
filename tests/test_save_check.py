"""The completeness check of the final save catches the known failure classes."""

import pytest
import torch
from safetensors.torch import save_file

from fsdp_recipes.checkpoint.save_check import IncompleteSave, compare, open_saved, read_saved

A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


def adapter():
    return {A: torch.randn(8, 32), B: torch.randn(32, 8)}


def test_identical_files_pass(tmp_path):
    full = adapter()
    save_file(full, tmp_path / "adapter_model.safetensors")
    assert compare(full, read_saved(tmp_path), check_lora_b=True) == {"tensors": 2, "lora_b_checked": 1,
                                                                      "model_shapes_checked": 0}


def test_sharded_model_files_are_read_lazily_and_checked(tmp_path):
    """The final-save check reads a sharded model directory tensor by tensor (save_check.open_saved)."""
    import json

    full = {"a.weight": torch.randn(4, 4), "b.weight": torch.randn(2, 4)}
    save_file({"a.weight": full["a.weight"]}, tmp_path / "model-00001-of-00002.safetensors")
    save_file({"b.weight": full["b.weight"] + 1}, tmp_path / "model-00002-of-00002.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a.weight": "model-00001-of-00002.safetensors", "b.weight": "model-00002-of-00002.safetensors"}}))
    lazy = open_saved(tmp_path)
    assert sorted(lazy) == ["a.weight", "b.weight"] and torch.equal(lazy["a.weight"], full["a.weight"])
    with pytest.raises(IncompleteSave, match="b.weight: saved values differ"):
        compare(full, lazy, check_lora_b=False)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(IncompleteSave, match="model-00002-of-00002.safetensors is missing"):
        open_saved(tmp_path)


def test_rank0_slice_is_caught():
    full = adapter()
    sliced = {A: full[A][:4].clone(), B: full[B][:16].clone()}  # what a rank-0-only FSDP save holds
    with pytest.raises(IncompleteSave, match=r"saved shape \(4, 32\), full shape \(8, 32\)"):
        compare(full, sliced, check_lora_b=True)


def test_a_gather_that_kept_a_shard_is_caught_against_the_models_shapes():
    """The save and its check see the same gathered tensors; the model's own (DTensor global) shapes catch a gather
    that returned rank 0's slice, even when the files faithfully hold that slice."""
    full = adapter()
    sliced = {A: full[A][:4].clone(), B: full[B][:16].clone()}
    assert compare(sliced, sliced, check_lora_b=True)["tensors"] == 2  # files == gather: nothing else would see it
    with pytest.raises(IncompleteSave, match=r"gathered shape \(4, 32\), the model's \(8, 32\)"):
        compare(sliced, sliced, check_lora_b=True, model_shapes={A: (8, 32), B: (32, 8)})


def test_missing_tensor_is_caught():
    full = adapter()
    with pytest.raises(IncompleteSave, match="1 tensors missing"):
        compare(full, {A: full[A]}, check_lora_b=True)


def test_different_values_are_caught():
    full = adapter()
    stale = {A: full[A], B: full[B] + 1e-3}
    with pytest.raises(IncompleteSave, match="differ from the weights in memory"):
        compare(full, stale, check_lora_b=True)


def test_untrained_lora_b_is_caught_only_after_training():
    full = {A: torch.randn(8, 32), B: torch.zeros(32, 8)}
    with pytest.raises(IncompleteSave, match="1 of 1 LoRA B matrices are still all zeros"):
        compare(full, dict(full), check_lora_b=True)
    assert compare(full, dict(full), check_lora_b=False)["tensors"] == 2


def test_sharded_model_directory_is_read_whole(tmp_path):
    import json

    save_file({"a": torch.ones(2)}, tmp_path / "model-00001-of-00002.safetensors")
    save_file({"b": torch.zeros(3)}, tmp_path / "model-00002-of-00002.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    assert sorted(read_saved(tmp_path)) == ["a", "b"]
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(IncompleteSave, match="is missing"):
        read_saved(tmp_path)


def test_load_check_catches_weights_that_differ_from_the_file(tmp_path):
    from transformers import MistralConfig, MistralForCausalLM

    from fsdp_recipes.checkpoint.load_check import file_key, verify_loaded_weights

    model = MistralForCausalLM(MistralConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                             num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
    model.save_pretrained(tmp_path)
    assert verify_loaded_weights(model, tmp_path, is_main=True)["parameters_checked"] == 12
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.zero_()  # what a rank that missed the broadcast would hold
    with pytest.raises(RuntimeError, match="1 parameters differ"):
        verify_loaded_weights(model, tmp_path, is_main=True)
    assert file_key("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight") == \
        "model.layers.0.self_attn.q_proj.weight"
    assert file_key("base_model.model.lm_head.modules_to_save.default.weight") == "lm_head.weight"
    assert file_key("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight") is None


def test_shard_check_catches_a_wrong_region(tmp_path):
    from safetensors.torch import load_file, save_file

    from fsdp_recipes.checkpoint.sharded_save import shard_mismatches

    state = {"a.weight": torch.randn(4, 3), "b.weight": torch.randn(2)}
    save_file(state, tmp_path / "model-00001-of-00001.safetensors")
    assert shard_mismatches(state, tmp_path) == []
    broken = load_file(tmp_path / "model-00001-of-00001.safetensors")
    broken["a.weight"][1, 2] += 1.0
    save_file(broken, tmp_path / "model-00001-of-00001.safetensors")
    assert shard_mismatches(state, tmp_path) == ["a.weight differs"]
    assert shard_mismatches({**state, "c.weight": torch.zeros(1)}, tmp_path)[-1] == "c.weight missing"
