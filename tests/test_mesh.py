"""A recipe's mesh (accelerate's parallelism_config) checked before any rank starts: its structure, then against the
model's heads and the rows' length, then what context parallel needs of the recipe and what the pack trains today
(config/mesh.py, issue 60)."""

from types import SimpleNamespace

import pytest

from conftest import RanksWouldStart, launcher_until_ranks
from fsdp_recipes.config.mesh import Mesh, check_mesh, check_mesh_fits, mesh_of
from fsdp_recipes.errors import UserError
from recipe_variant import recipe_variant
from test_bad_input import assert_one_line_error


def fsdp(**sizes) -> dict:
    return {"distributed_type": "FSDP", "parallelism_config": {f"parallelism_config_{k}_size": v
                                                                for k, v in sizes.items()}}


def test_the_mesh_as_accelerate_reads_it():
    assert mesh_of({"distributed_type": "FSDP"}, "a.yaml") is None  # plain FSDP: the world is one shard group
    assert mesh_of({**fsdp(tp=2), "distributed_type": "MULTI_GPU"}, "a.yaml") is None
    assert mesh_of(fsdp(dp_replicate=2, dp_shard=8), "a.yaml") == Mesh(dp_replicate=2, dp_shard=8)  # tp, cp: 1
    assert check_mesh(fsdp(dp_replicate=2, dp_shard=8), "a.yaml", 16).total == 16


@pytest.mark.parametrize("acc, processes, said", [
    (fsdp(dp_shard=2, tp=2), 8, "a.yaml: the mesh dp_replicate 1 x dp_shard 2 x tp 2 x cp 1 has 4 ranks, but the job "
                                "has 8 processes. Fix: make the sizes' product the world size"),
    (fsdp(dp_replicate=4), 4, "a.yaml: dp_replicate 4 with dp_shard 1 replicates unsharded copies, which accelerate's "
                              "ParallelismConfig refuses. Fix:"),
    (fsdp(cp=0), 1, "a.yaml: parallelism_config_cp_size is 0; a mesh dimension has at least 1 rank. Fix:"),
    (fsdp(tp="two"), 2, "a.yaml: parallelism_config_tp_size is 'two', not a whole number. Fix:"),
    ({**fsdp(tp=2), "fsdp_config": {"fsdp_activation_checkpointing": True}}, 2,
     "a.yaml: fsdp_config.fsdp_activation_checkpointing is true, but a tensor-parallel mesh is sharded by "
     "transformers at load time, which applies none of accelerate's fsdp_config. Fix: "),
], ids=["product", "replicate-unsharded", "zero", "word", "tp-ignores-fsdp-config"])
def test_a_mesh_that_cannot_be_built_is_one_line(acc, processes, said):
    with pytest.raises(UserError) as err:
        check_mesh(acc, "a.yaml", processes)
    assert str(err.value).startswith(said)


@pytest.mark.parametrize("sizes, heads, kv, length, said", [
    (dict(tp=3, dp_shard=2), 32, 8, 4096, "tp 3 does not divide the model's 32 attention heads"),
    (dict(tp=4, dp_shard=2), 32, 2, 4096, "tp 4 does not divide the model's 2 key/value heads"),
    (dict(cp=4, dp_shard=2), 32, 8, 4100, "cp 4 cannot split rows of max_length 4100 into 8 equal chunks"),
    (dict(tp=2, cp=2, dp_shard=2), 32, 8, 4096, "the mesh dp_replicate 1 x dp_shard 2 x tp 2 x cp 2 splits both "
                                                "layers (tp) and rows (cp), which the pack has not checked together"),
    (dict(tp=2, dp_shard=2, dp_replicate=2), 32, 8, 4096, "the mesh dp_replicate 2 x dp_shard 2 x tp 2 x cp 1 "
                                                          "replicates a tensor-parallel model (HSDP beside tp), which "
                                                          "the pack has not checked"),
], ids=["heads", "kv-heads", "row-chunks", "tp-cp", "tp-hsdp"])
def test_a_mesh_against_the_model_and_the_rows(sizes, heads, kv, length, said):
    with pytest.raises(UserError, match="Fix:") as err:
        check_mesh_fits(Mesh(**sizes), "a.yaml", heads, kv, length)
    assert said in str(err.value)


def recipe(trainer="sft", **training):
    """What check_mesh_fits reads of a parsed recipe (RunConfig)."""
    fields = {"packing": False, "padding_free": False, "pad_to_multiple_of": 4, **training}
    return SimpleNamespace(trainer=trainer, training=SimpleNamespace(**fields))


@pytest.mark.parametrize("cp, heads, cfg, said", [
    (2, 4, recipe(trainer="dpo"), "a.yaml: cp 2 splits rows for the trainer kinds whose loss is split-aware in TRL 1.16 (sft), not dpo"),
    (2, 4, recipe(packing=True), "packing is on (TRL refuses packing under context parallel). Fix: packing: false"),
    (2, 4, recipe(padding_free=True), "padding_free is on"),
    (2, 4, recipe(pad_to_multiple_of=None), "must be a multiple of 4, and pad_to_multiple_of is None. Fix: "
                                             "pad_to_multiple_of: 4"),
    (4, 8, recipe(pad_to_multiple_of=4), "must be a multiple of 8, and pad_to_multiple_of is 4"),
    (3, 4, recipe(pad_to_multiple_of=6), "a.yaml: cp 3 does not divide the model's 4 attention heads: without a GPU"),
], ids=["kind", "packing", "padding-free", "no-multiple", "multiple-too-small", "heads-without-gpu"])
def test_context_parallel_needs_of_the_recipe(cp, heads, cfg, said, monkeypatch):
    monkeypatch.setattr("fsdp_recipes.config.hardware.gpu_count", lambda: 0)  # the ranks run the all-to-all form
    with pytest.raises(UserError, match="Fix:") as err:
        check_mesh_fits(Mesh(cp=cp), "a.yaml", heads, heads, None, cfg)
    assert said in str(err.value)


def test_a_context_parallel_sft_recipe_trains():
    check_mesh_fits(Mesh(cp=2), "a.yaml", 4, 2, 64, recipe())
    check_mesh_fits(Mesh(dp_shard=2, cp=2), "a.yaml", 32, 8, 4096, recipe(pad_to_multiple_of=64))


@pytest.mark.parametrize("attn", ["eager", "flash_attention_2", "flex_attention"])
def test_context_parallel_attention_is_sdpa(attn):
    from fsdp_recipes.speed import attention

    cfg = SimpleNamespace(model=SimpleNamespace(attn_implementation=attn), training=SimpleNamespace(use_cpu=True))
    with pytest.raises(UserError, match=f"attn_implementation: {attn} cannot split rows over cp 2.*Fix: "
                                        "attn_implementation: sdpa or auto"):
        attention.check_launch(cfg, fsdp(cp=2), "a.yaml", say=print)
    if attn == "eager":  # the same without cp: as before
        attention.check_launch(cfg, fsdp(dp_shard=2), "a.yaml", say=print)


def test_data_parallel_meshes_train_as_before():
    check_mesh_fits(None, "a.yaml", 32, 8, 4096)
    check_mesh_fits(Mesh(dp_replicate=2, dp_shard=8), "a.yaml", 32, 8, 4100)


def test_tensor_parallel_beside_fsdp2_passes():
    """What train/tensor_parallel.py trains (tests/test_tensor_parallel.py): tp alone, and tp x dp_shard."""
    check_mesh_fits(Mesh(tp=8), "a.yaml", 64, 8, 4100)
    check_mesh_fits(Mesh(dp_shard=2, tp=8), "a.yaml", 64, 8, 4100)


@pytest.mark.parametrize("dtype", ["bfloat16", "torch.float16"])
def test_full_fine_tuning_beside_tp_keeps_fp32_weights(dtype):
    """Under tp accelerate's FSDP2 (and its upcast of a bf16 load to fp32 master weights) is off."""
    model = SimpleNamespace(use_peft=False, dtype=dtype, lora_modules_to_save=None)
    with pytest.raises(UserError, match=r"a.yaml: tp 2 with full fine-tuning .*Fix: dtype: float32 with bf16: true"):
        check_mesh_fits(Mesh(tp=2), "a.yaml", 4, 2, 64, SimpleNamespace(model=model))
    fp32 = SimpleNamespace(use_peft=False, dtype="float32", lora_modules_to_save=None)
    check_mesh_fits(Mesh(tp=2), "a.yaml", 4, 2, 64, SimpleNamespace(model=fp32))
    lora = SimpleNamespace(use_peft=True, dtype=dtype, lora_modules_to_save=None)  # PEFT keeps its adapters in fp32
    check_mesh_fits(Mesh(tp=2), "a.yaml", 4, 2, 64, SimpleNamespace(model=lora))
    check_mesh_fits(Mesh(dp_shard=2), "a.yaml", 4, 2, 64, SimpleNamespace(model=model))  # FSDP2 upcasts


def test_the_launcher_says_it_before_any_rank_starts(tmp_path, checks, monkeypatch, capsys):
    """A copied tiny recipe given tp 2 on its 2 processes: its tiny Mistral's 4 heads and 2 key/value heads divide,
    but its LoRA trains the LM head in full (lora_modules_to_save), which tp cannot; without that its checks pass
    (tensor parallel trains); with dp_shard 2 as well the product is wrong."""
    tp = {"parallelism_config": {"parallelism_config_tp_size": 2}}
    assert_one_line_error(checks([recipe_variant(tmp_path, "tp", accelerate=tp), "--output_dir", tmp_path / "run"]),
                          "lora_modules_to_save ['lm_head'] with a tensor-parallel mesh")
    folder = recipe_variant(tmp_path, "tp-lora", accelerate=tp, lora_modules_to_save=None)
    with pytest.raises(RanksWouldStart):
        launcher_until_ranks([str(folder), "--output_dir", str(tmp_path / "run")], monkeypatch, capsys)
    folder = recipe_variant(tmp_path, "tp-shard", accelerate={"parallelism_config": {
        "parallelism_config_tp_size": 2, "parallelism_config_dp_shard_size": 2}})
    assert_one_line_error(checks([folder, "--output_dir", tmp_path / "run2"]), "has 4 ranks, but the job has 2")
