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


def test_a_rank0_slice_saved_in_a_checkpoint_fails_the_resume_check(tmp_path):
    """accelerate PR 4206 / peft PR 3251: FSDP2 + PEFT saved only rank 0's slice of each LoRA tensor. A checkpoint
    holding such a save is refused when a run resumes from it, before its first step (resume_check.py)."""
    from fsdp_recipes.checkpoint.resume_check import compare_with_adapter

    full = adapter()
    save_file({A: full[A][:4].clone(), B: full[B][:16].clone()}, tmp_path / "adapter_model.safetensors")
    with pytest.raises(RuntimeError, match=r"2 differ \(e.g. .*lora_A.weight: shape \(8, 32\) in memory, \(4, 32\) "
                                           r"saved\)"):
        compare_with_adapter(full, tmp_path)


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

    from fsdp_recipes.checkpoint.save_check import shard_mismatches

    state = {"a.weight": torch.randn(4, 3), "b.weight": torch.randn(2)}
    save_file(state, tmp_path / "model-00001-of-00001.safetensors")
    assert shard_mismatches(state, tmp_path) == []
    broken = load_file(tmp_path / "model-00001-of-00001.safetensors")
    broken["a.weight"][1, 2] += 1.0
    save_file(broken, tmp_path / "model-00001-of-00001.safetensors")
    assert shard_mismatches(state, tmp_path) == ["a.weight differs"]
    assert shard_mismatches({**state, "c.weight": torch.zeros(1)}, tmp_path)[-1] == "c.weight missing"


def test_the_dict_a_save_was_given_is_still_whole_for_the_check(tmp_path):
    """transformers' save_pretrained pops every tensor out of the state dict it writes; the check after the save
    reuses that dict (save_check.save_state_dict passes a copy)."""
    from types import SimpleNamespace

    from transformers import MistralConfig, MistralForCausalLM

    from fsdp_recipes.checkpoint.save_check import save_state_dict

    model = MistralForCausalLM(MistralConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                             num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
    trainer = SimpleNamespace(_save=lambda out, state_dict: model.save_pretrained(out, state_dict=state_dict),
                              args=SimpleNamespace(should_save=True))
    full = dict(model.state_dict())
    save_state_dict(trainer, str(tmp_path), full)
    assert len(full) == 12
    assert compare(full, open_saved(tmp_path), check_lora_b=False)["tensors"] == 12


def test_only_the_writing_process_calls_the_trainers_save(tmp_path):
    """Trainer._save is written for the writing process; transformers 5.17 does not return early on the others and
    saved rank 1's live, sharded model (the final LoRA save failed there: "invalid python storage")."""
    from types import SimpleNamespace

    from fsdp_recipes.checkpoint.save_check import save_state_dict

    calls = []
    for should_save in (False, True):
        trainer = SimpleNamespace(_save=lambda out, state_dict: calls.append((out, state_dict)),
                                  args=SimpleNamespace(should_save=should_save))
        save_state_dict(trainer, str(tmp_path), None)
    assert calls == [(str(tmp_path), None)]


def save_adapter(model, tensors: dict, directory):
    """Write `tensors` (the PeftModel's trainable parameter names) as the adapter files, as the final save does."""
    model.save_pretrained(str(directory), state_dict=dict(tensors))


def a_bad_gather(model) -> dict:
    """The trainable tensors as a broken gather could return them: right names and shapes, one tensor's values off."""
    bad = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    bad[sorted(bad)[-1]] += 1.0
    return bad


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
def test_fsdp2_files_are_compared_with_each_ranks_live_shards(world_of_one, tmp_path):
    """The round trip (files == the dict that was written) passes a bad gather; the live shards do not."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from conftest import tiny_lora_model
    from fsdp_recipes.checkpoint.resume_check import adapter_key
    from fsdp_recipes.checkpoint.save_check import LIVE_SHARDS, verified_line, verify_against_memory

    model = tiny_lora_model()
    good = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    bad = a_bad_gather(model)
    save_adapter(model, good, tmp_path / "good")
    save_adapter(model, bad, tmp_path / "bad")
    mesh = init_device_mesh("cpu", (1,))
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert compare({adapter_key(n): t for n, t in bad.items()}, open_saved(tmp_path / "bad"),
                   check_lora_b=True)["tensors"] == 8  # the round trip alone sees nothing wrong
    with pytest.raises(IncompleteSave, match=r"against the weights in memory on 1 tensor shard\(s\).*lora_B.weight differs"):
        verify_against_memory(model, tmp_path / "bad", is_main=True)
    assert verify_against_memory(model, tmp_path / "good", is_main=True) == LIVE_SHARDS
    assert verified_line({"tensors": 8, "compared_with": LIVE_SHARDS}) == (
        "final save verified: 8 tensors complete and unsharded; the files equal each rank's shards of the weights "
        "in memory")


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
def test_fsdp1_adapter_files_are_compared_with_a_fresh_gather(world_of_one, tmp_path):
    from peft.utils.other import fsdp_auto_wrap_policy
    from torch.distributed.fsdp import FullyShardedDataParallel

    from conftest import tiny_lora_model
    from fsdp_recipes.checkpoint.save_check import REGATHERED, verify_against_memory

    model = tiny_lora_model()
    save_adapter(model, {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad},
                 tmp_path / "good")
    save_adapter(model, a_bad_gather(model), tmp_path / "bad")
    wrapped = FullyShardedDataParallel(model, auto_wrap_policy=fsdp_auto_wrap_policy(model),
                                       device_id=torch.device("cpu"), use_orig_params=True)
    with pytest.raises(IncompleteSave, match="lora_B.weight: saved values differ from the weights in memory"):
        verify_against_memory(wrapped, tmp_path / "bad", is_main=True)
    assert verify_against_memory(wrapped, tmp_path / "good", is_main=True) == REGATHERED


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
def test_what_the_files_are_compared_with_is_named(world_of_one, tmp_path):
    """Without FSDP the check's state dict is the live one; FSDP1 full fine-tuning compares nothing independent,
    and the log line says so."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from transformers import MistralConfig, MistralForCausalLM

    from fsdp_recipes.checkpoint.save_check import LIVE, SAVED_COPY, verified_line, verify_against_memory

    model = MistralForCausalLM(MistralConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                             num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
    assert verify_against_memory(model, tmp_path, is_main=True) == LIVE
    wrapped = FullyShardedDataParallel(model, device_id=torch.device("cpu"))
    assert verify_against_memory(wrapped, tmp_path, is_main=True) == SAVED_COPY
    assert verified_line({"tensors": 12, "compared_with": SAVED_COPY}) == (
        "final save verified: 12 tensors complete and unsharded; the files equal the state dict gathered for the "
        "save (FSDP1 full fine-tuning: the live shards were not compared)")


def test_the_final_save_reports_what_its_files_were_compared_with(tmp_path, capsys):
    """train/final_save.py save_final without FSDP (no process group): the report and the log line name the comparison."""
    from types import SimpleNamespace

    from transformers import MistralConfig, MistralForCausalLM

    from fsdp_recipes.checkpoint.save_check import LIVE
    from fsdp_recipes.train.final_save import save_final

    model = MistralForCausalLM(MistralConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                             num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
    accelerator = SimpleNamespace(get_state_dict=lambda m: dict(m.state_dict()), is_main_process=True,
                                  unwrap_model=lambda m: m, wait_for_everyone=lambda: None)
    trainer = SimpleNamespace(is_fsdp_enabled=False, model=model, accelerator=accelerator,
                              save_model=lambda out: model.save_pretrained(out), state=SimpleNamespace(global_step=0),
                              args=SimpleNamespace(learning_rate=0.0, warmup_steps=0))
    cfg = SimpleNamespace(training=SimpleNamespace(output_dir=str(tmp_path)), model=None,
                          pack=SimpleNamespace(save_merged_model=False))
    report = SimpleNamespace(final_save_check=None, final_save_rss=None)
    save_final(trainer, cfg, None, report)
    assert report.final_save_check == {"tensors": 12, "lora_b_checked": 0, "model_shapes_checked": 12,
                                       "compared_with": LIVE}
    assert ("[train] final save verified: 12 tensors complete and unsharded; the files equal the weights in "
            "memory") in capsys.readouterr().out


def tiny_moe(tmp_path):
    """A random Qwen3-MoE (4 experts) saved by save_pretrained, which writes its fused experts one per expert."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                               num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                               num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8))
    model.save_pretrained(tmp_path)
    return model


def test_a_moe_save_is_checked_under_the_names_its_files_use(tmp_path):
    """In memory one tensor per layer holds every expert's gate and up projections; the files hold one per expert and
    projection. By the model's names every Qwen3-MoE and Mixtral full fine-tune failed its final-save check
    (scripts/arch_matrix.py); under the save's own layout it passes, and a wrong value still fails."""
    from fsdp_recipes.checkpoint.save_check import checkpoint_layout

    model = tiny_moe(tmp_path)
    files = open_saved(tmp_path)
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in files and "model.layers.0.mlp.experts.gate_up_proj" not in files
    state = dict(model.state_dict())
    with pytest.raises(IncompleteSave, match="tensors missing from the files"):
        compare(dict(state), files, check_lora_b=False)
    layout = lambda sd: checkpoint_layout(model, sd)  # noqa: E731
    assert compare(dict(state), files, check_lora_b=False, layout=layout)["tensors"] == len(files)
    state["model.layers.0.mlp.experts.down_proj"] = state["model.layers.0.mlp.experts.down_proj"] + 1
    with pytest.raises(IncompleteSave, match=r"experts\.0\.down_proj\.weight: saved values differ"):
        compare(state, files, check_lora_b=False, layout=layout)


def test_a_ranks_shard_of_fused_experts_is_compared_with_its_experts_files(tmp_path):
    """Rank 1 of 2 holds experts 2 and 3 of the fused tensor (FSDP2 shards dim 0): only their files are compared."""
    from fsdp_recipes.checkpoint.save_check import converted_mismatches, safetensors_index, shard_mismatches

    model = tiny_moe(tmp_path)
    name = "model.layers.0.mlp.experts.gate_up_proj"
    fused = model.state_dict()[name]
    region = (slice(2, 4), slice(0, fused.shape[1]), slice(0, fused.shape[2]))
    where = safetensors_index(tmp_path)
    assert converted_mismatches(model, name, fused, fused[2:4], region, where) == []
    wrong = fused[2:4].clone()
    wrong[0, 0, 0] += 1  # expert 2's gate projection (the first half of dim 1)
    assert converted_mismatches(model, name, fused, wrong, region, where) == [
        f"model.layers.0.mlp.experts.2.gate_proj.weight ({name} in memory) differs"]
    assert converted_mismatches(model, name, fused, fused[0:2], region, where) != []  # the wrong experts' values
    state = dict(model.named_parameters())
    assert shard_mismatches(state, tmp_path, model=model) == []
    assert f"{name} missing" in shard_mismatches(state, tmp_path)  # by the model's names alone


def test_the_replica_model_names_experts_as_the_files_do(tmp_path):
    """Every rank but 0 starts from an empty model (speed/ram_efficient_loading.py), which loading no weights left with no
    conversion on record: its shard check would look for the fused name the files do not have."""
    from fsdp_recipes.checkpoint.save_check import checkpoint_layout
    from fsdp_recipes.speed.ram_efficient_loading import empty_model

    tiny_moe(tmp_path)
    replica = empty_model(str(tmp_path), {"dtype": "float32"})
    names = checkpoint_layout(replica, {"model.layers.0.mlp.experts.down_proj": torch.zeros(4, 32, 8)})
    assert sorted(names) == [f"model.layers.0.mlp.experts.{e}.down_proj.weight" for e in range(4)]


def _tiny_family(family: str):
    """A random tiny model of a family whose save renames or converts weights (transformers 5.23 conversion_mapping):
    GPT-NeoX writes its LM head (lm_head in memory) as embed_out, by a mapping keyed by class name; Mixtral renames
    block_sparse_moe and splits the fused experts; Qwen2-MoE splits them (both keyed by model_type)."""
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    if family == "gpt_neox":
        return transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(**common))
    if family == "mixtral":
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **common, num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2))
    return transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        **common, num_key_value_heads=1, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
        shared_expert_intermediate_size=16))


@pytest.mark.parametrize("family", ["gpt_neox", "mixtral", "qwen2_moe"])
@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
def test_every_rank_checks_its_shards_under_the_names_rank_0_wrote(world_of_one, tmp_path, monkeypatch, family):
    """Rank 1 of a RAM-efficient run (speed/ram_efficient_loading.py: no weights loaded, no conversion on record),
    FSDP2-sharded, checks its shards against the files rank 0's save wrote. fully_shard renames the class
    (FSDPGPTNeoXForCausalLM), so transformers' lookup by class missed GPT-NeoX's rename there: 'rank 1: lm_head.weight
    missing' failed every 2-rank GPT-NeoX full fine-tune. Every rank now takes rank 0's conversions."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    from fsdp_recipes.checkpoint import save_check
    from fsdp_recipes.speed.ram_efficient_loading import empty_model

    _tiny_family(family).save_pretrained(tmp_path / "base")
    rank0 = AutoModelForCausalLM.from_pretrained(tmp_path / "base")  # records the conversions its checkpoint used
    rank0.save_pretrained(tmp_path / "out")  # what the final save writes
    files = open_saved(tmp_path / "out")
    replica = empty_model(str(tmp_path / "base"), {"dtype": "float32"})
    replica.load_state_dict(rank0.state_dict())  # accelerate's broadcast of rank 0's weights
    fully_shard(replica, mesh=init_device_mesh("cpu", (1,)))
    renamed = [name for name, _ in replica.named_parameters() if name not in files]
    assert renamed, "the family's save writes some tensors under other names"
    # this process plays rank 1; rank 0 sends its record through the all-gather
    monkeypatch.setattr(dist, "get_rank", lambda *a, **k: 1)
    monkeypatch.setenv("RANK", "1")  # fsdp_recipes.dist.rank(): torchrun's variable
    monkeypatch.setattr(save_check, "gather_objects", lambda sent: [save_check.conversions_record(rank0), sent],
                        raising=False)
    assert save_check.verify_against_memory(replica, tmp_path / "out", is_main=False) == save_check.LIVE_SHARDS
    with torch.no_grad():  # and a wrong value in a renamed tensor is still found, under the file's name
        dict(replica.named_parameters())[renamed[-1]].to_local().view(-1)[0] += 1
    with pytest.raises(IncompleteSave, match=rf"rank 1: .*\({renamed[-1]} in memory\) differs"):  # played rank
        save_check.verify_against_memory(replica, tmp_path / "out", is_main=False)
