"""QLoRA under FSDP2 (speed/four_bit.py): the 4-bit storage in FSDP's own dtype, the settings FSDP cannot shard
refused before any rank starts, and a 2-process run whose storage is sharded and whose losses equal one process's."""

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

import conftest
from conftest import launch
from fsdp_recipes.speed import four_bit
from fsdp_recipes.errors import UserError
from recipe_variant import recipe_variant

@pytest.fixture
def bnb(monkeypatch):
    """bitsandbytes on the path, for this test only (conftest.QLORA_SITE): its directory."""
    site = conftest.qlora_site()
    monkeypatch.syspath_prepend(site)
    return site


FSDP2 = {"distributed_type": "FSDP", "mixed_precision": "no", "fsdp_config": {"fsdp_version": 2}}


def model_args(**kw):
    base = dict(load_in_4bit=True, load_in_8bit=False, use_peft=True, dtype="float32", bnb_4bit_quant_storage=None,
                bnb_4bit_quant_type="nf4", use_bnb_nested_quant=False)
    return SimpleNamespace(**{**base, **kw})


NO_MIXED = SimpleNamespace(bf16=False, fp16=False)


@pytest.mark.parametrize("training, acc_mixed, dtype, fsdp, want", [
    (NO_MIXED, "bf16", "float32", True, "bfloat16"),  # FSDP2's MixedPrecisionPolicy casts to bf16: store bf16
    (NO_MIXED, "fp16", "bfloat16", True, "float16"),
    (NO_MIXED, "no", "float32", True, "float32"),  # no policy: the model's own dtype
    (NO_MIXED, None, "bfloat16", True, "bfloat16"),
    # TrainingArguments' bf16 wins over the accelerate config, as in transformers' Trainer: the default recipe's
    # accelerate YAML says "no" and the launcher adds --bf16 true on GPUs and bf16 CPUs
    (SimpleNamespace(bf16=True, fp16=False), "no", "float32", True, "bfloat16"),
    (SimpleNamespace(bf16=False, fp16=True), "no", "float32", True, "float16"),
    (SimpleNamespace(bf16=True, fp16=False), "bf16", "float32", False, "float32"),  # DDP: nothing casts parameters
])
def test_the_storage_is_the_dtype_fsdp_gathers_in(training, acc_mixed, dtype, fsdp, want):
    assert four_bit.storage_dtype(dtype, training, acc_mixed, fsdp) == want


def test_the_pack_sets_the_storage_it_passes_to_transformers(monkeypatch, bnb):
    import torch

    args = model_args(dtype="bfloat16")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    config = four_bit.quantization_config(args, NO_MIXED)
    assert config.load_in_4bit and config.bnb_4bit_quant_type == "nf4"
    assert config.bnb_4bit_quant_storage == torch.bfloat16 and args.bnb_4bit_quant_storage == "bfloat16"
    assert four_bit.quantization_config(model_args(load_in_4bit=False), NO_MIXED) is None


@pytest.mark.parametrize("changes, acc, fragment", [
    ({"load_in_4bit": False, "load_in_8bit": True}, FSDP2, "load_in_8bit cannot be sharded by FSDP"),
    ({"use_peft": False}, FSDP2, "4-bit weights cannot be trained"),
    ({"dtype": "auto"}, FSDP2, "load_in_4bit with dtype 'auto'"),
    ({"bnb_4bit_quant_storage": "uint8"}, FSDP2, "bnb_4bit_quant_storage uint8 differs"),  # accelerate issue 3983
    ({"bnb_4bit_quant_storage": "float32"}, {**FSDP2, "mixed_precision": "bf16"}, "corrupt them"),  # rounds bits
    ({}, {**FSDP2, "fsdp_config": {"fsdp_version": 1}}, "under FSDP1 is not checked"),
])
def test_what_fsdp_cannot_shard_is_refused(changes, acc, fragment, bnb):
    with pytest.raises(UserError, match=fragment) as err:
        four_bit.check(model_args(**changes), NO_MIXED, acc, "accelerate.yaml")
    assert "Fix:" in str(err.value)


def test_without_bitsandbytes_4_bits_are_one_line(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    with pytest.raises(UserError, match=r"load_in_4bit needs bitsandbytes, which is not installed. Fix: pip install"):
        four_bit.check(model_args(), NO_MIXED, FSDP2, "accelerate.yaml")


def test_a_right_setting_passes(bnb):
    four_bit.check(model_args(), NO_MIXED, FSDP2, "accelerate.yaml")
    four_bit.check(model_args(bnb_4bit_quant_storage="bfloat16", dtype="bfloat16"), NO_MIXED,
                       {**FSDP2, "mixed_precision": "bf16"}, "accelerate.yaml")
    four_bit.check(model_args(load_in_4bit=False), NO_MIXED, FSDP2, "x")  # no 4 bits: nothing to check
    with pytest.raises(UserError, match="bnb_4bit_quant_storage float32 differs"):  # bf16 from the Trainer's flag
        four_bit.check(model_args(bnb_4bit_quant_storage="float32"), SimpleNamespace(bf16=True, fp16=False),
                           FSDP2, "accelerate.yaml")


def test_4bit_layers_compute_alike_on_a_cpu_with_avx512_bf16(bnb, cache_dir, monkeypatch):
    """bitsandbytes 0.50 repacks a 4-bit layer's weight for its AVX-512 BF16 CPU kernel at the first forward in eval
    mode, and asserts that the layer's width is a multiple of 32: the tiny model's 688-wide MLP crashed there on an
    AMD EPYC (Zen 4) VM. Told it has that CPU (whatever this one has), a 4-bit model the pack loads evaluates and
    generates as on any other CPU."""
    import torch
    from bitsandbytes.nn import modules

    monkeypatch.setattr(modules, "has_avx512bf16", lambda: True)  # read when each Linear4bit is built
    model = four_bit.load_4bit(str(cache_dir / "tiny-mistral"), model_args())
    layers = [m for m in model.modules() if type(m).__name__ == "Linear4bit"]
    assert len(layers) == 28 and {m.out_features % 32 for m in layers} == {0, 688 % 32}
    with torch.no_grad():
        out = model.eval().generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, do_sample=False)
    assert out.shape == (1, 5)


def losses(run):
    history = json.loads((run / "log_history.json").read_text())["log_history"]
    return {h["step"]: h["loss"] for h in history if "loss" in h}


COMMON = ["--load_in_4bit", "true", "--max_steps", "4", "--logging_steps", "1", "--eval_strategy", "no",
          "--warmup_steps", "0"]
# the 2-process run also checkpoints at steps 2 and 4 and writes merged/: the resume and merged-model tests read it
SAVES = ["--save_strategy", "steps", "--save_steps", "2", "--save_merged_model", "true", "--measure_memory", "true"]


@pytest.fixture(scope="module")
def two(tmp_path_factory, cache_dir):
    """tiny-cpu-lora in 4 bits on 2 processes (FSDP2, float32 storage), 4 steps, checkpoints at 2 and 4, merged/:
    (its folder, its recipe). LoRA on the linears only: the trained LM head of a tied model is the pack's own case
    (peft_fsdp.py), not QLoRA's."""
    tmp = tmp_path_factory.mktemp("qlora")
    recipe = recipe_variant(tmp, "two", drop=("lora_modules_to_save",))
    out = tmp / "two-run"
    res = launch([str(recipe), *COMMON, *SAVES, "--output_dir", str(out)], cache_dir,
                 **conftest.library_server(conftest.qlora_site()))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return out, recipe


@pytest.mark.slow
def test_qlora_on_two_processes_shards_the_4bit_storage_and_matches_one_process(two, tmp_path, cache_dir, bnb):
    two, _ = two
    one_recipe = recipe_variant(tmp_path, "one", drop=("lora_modules_to_save",), accelerate={"num_processes": 1})
    one = tmp_path / "one-run"
    res = launch([str(one_recipe), *COMMON, "--save_merged_model", "false",
                  "--per_device_train_batch_size", "32",  # the same 32 rows per step
                  "--output_dir", str(one)], cache_dir, **conftest.library_server(bnb))
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

    # bytes per rank measured against the plan: the probe counts each rank's parameter shards (the 4-bit storage
    # at half a byte per weight); the planner's weights are those plus the scales, which no parameter holds
    from fsdp_recipes.config.model_check import load_config, meta_model
    from fsdp_recipes.planning import memory_budget, plan

    model_args = SimpleNamespace(**args)
    shape = plan.model_shape(meta_model(load_config(Path(args["model_name_or_path"]) / "config.json")),
                                   model_args)
    setup = memory_budget.Setup(shard=2, world=2, strategy="FSDP", load_bytes=4, compute_bytes=4,
                                mixed_precision=False, tokens=1, checkpointed=False, optimizer_bytes=8,
                                runtime_bytes=0, **four_bit.planner_setup(model_args, None))
    planned = memory_budget.budget(shape, setup)
    probe = json.loads((two / "memory_probe.rank0.json").read_text())
    assert shape.quantized > 0 and probe["weights"] == planned["weights"] - round(shape.quantized * setup.scale_bytes)
    # TRL keeps a 4-bit model's adapters in bf16 (no mixed precision here): their gradients and AdamW moments too
    assert probe["gradients"] == planned["gradients"] == shape.trainable * 2 // 2
    assert probe["optimizer_states"] == planned["optimizer_states"] == shape.trainable * 4 // 2


@pytest.mark.slow
def test_a_4bit_run_resumed_from_its_checkpoint_repeats_its_losses_and_adapter(two, tmp_path, cache_dir, bnb):
    """The one launch that resumes: the same command from the 2-process run's checkpoint-2 into another folder. The
    4-bit base is quantized again from the same weights (deterministic), the adapter, AdamW's moments, the schedule
    and the RNG come from the checkpoint: steps 3 and 4 repeat the first run's losses, and the final adapter its
    weights, bit for bit (measured: both equal to the last digit on the 2-core VM)."""
    import torch
    from safetensors.torch import load_file

    two, recipe = two
    resumed = tmp_path / "resumed"
    res = launch([str(recipe), *COMMON, *SAVES, "--resume_from_checkpoint", str(two / "checkpoint-2"),
                  "--output_dir", str(resumed)], cache_dir, **conftest.library_server(bnb))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    m = json.loads((resumed / "metrics.json").read_text())
    assert m["status"] == "completed" and m["steps"] == 4 and m["resumed_from"] == str(two / "checkpoint-2")
    a, b = losses(two), losses(resumed)
    for step in (3, 4):  # steps 1 and 2 are the checkpoint's own log history
        assert b[step] == a[step], (step, a, b)  # the same world size, threads and order: exactly
    wa, wb = load_file(two / "adapter_model.safetensors"), load_file(resumed / "adapter_model.safetensors")
    assert wa.keys() == wb.keys() and len(wa) > 0
    assert all(torch.equal(wa[key], wb[key]) for key in wa)
    assert m["final_save_check"]["tensors"] == len(wa)
    assert json.loads((resumed / "run_args.json").read_text())["model_args"]["load_in_4bit"] is True


@pytest.mark.slow
def test_the_merged_model_is_the_dequantised_base_plus_the_adapter_and_answers_as_the_4bit_model(two, bnb):
    """save_merged of a 4-bit run: the 4-bit base dequantised to the compute dtype (float32 here) with the adapter
    merged in, a plain model (no quantization_config) whose logits equal the 4-bit base + adapter's to float32
    rounding, and whose greedy answers are the same; merging into the original weights instead gives another model."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fsdp_recipes.speed import four_bit
    from fsdp_recipes.evaluation.eval_rows import load_prompts

    two, _ = two
    run_args = json.loads((two / "run_args.json").read_text())
    args = run_args["model_args"]
    config = json.loads((two / "merged" / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "float32"
    merged = AutoModelForCausalLM.from_pretrained(two / "merged").eval()
    adapted = PeftModel.from_pretrained(four_bit.load_4bit(args["model_name_or_path"], args), str(two)).eval()
    assert type(adapted.base_model.model.model.layers[0].mlp.down_proj.base_layer).__name__ == "Linear4bit"
    tok = AutoTokenizer.from_pretrained(two)
    tok.padding_side = "left"
    texts = [tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p, _ in
             load_prompts(run_args, 8)]  # the summary's held-out prompts
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        lm, la = merged(**enc).logits, adapted(**enc).logits
    # float32 throughout: x (W + s B A)^T against x W^T + s (x A^T) B^T, the same numbers summed in another order
    assert (lm - la).abs().max().item() <= 1e-4 * la.abs().max().item(), (lm - la).abs().max().item()
    with torch.no_grad():
        gm = merged.generate(**enc, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
        ga = adapted.generate(**enc, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
    assert torch.equal(gm, ga)

    # the merged weights are the dequantised 4-bit ones plus the adapter's change, not the original ones plus it
    base = AutoModelForCausalLM.from_pretrained(args["model_name_or_path"], dtype=torch.float32)
    dequantised = four_bit.load_4bit(args["model_name_or_path"], args, dequantise=True)
    name = "model.layers.0.mlp.down_proj.weight"
    w_merged, w_deq, w_orig = (m.state_dict()[name] for m in (merged, dequantised, base))
    delta = adapted.base_model.model.model.layers[0].mlp.down_proj.get_delta_weight("default")
    assert torch.allclose(w_merged, w_deq + delta, atol=1e-6)
    assert (w_merged - (w_orig + delta)).abs().max() > 100 * 1e-6  # NF4's rounding, kept


@pytest.mark.slow
def test_make_gguf_writes_the_merged_model_of_a_4bit_run(two, tmp_path, monkeypatch):
    """The merged model is a plain float32 model: `make gguf` writes it, and the file holds its weights. The tiny
    model's 268-token byte-level BPE tokenizer is none llama.cpp knows (test_gguf.py: refused), so a copy of the run
    gets a SentencePiece one, which llama.cpp's converter takes first; the real model's export is
    tests/test_default_recipe.py's."""
    import gguf
    import torch
    from safetensors.torch import load_file

    from fsdp_recipes.serving import gguf_export
    from gguf_tiny import sentencepiece_tokenizer, use_converter

    use_converter(monkeypatch)
    two = shutil.copytree(two[0], tmp_path / "run")
    sentencepiece_tokenizer(two / "merged", 268)
    out = tmp_path / "model.f32.gguf"
    assert gguf_export.main([str(two), "--type", "f32", "--out", str(out)]) == 0
    weights = load_file(two / "merged" / "model.safetensors")
    written = {t.name: t for t in gguf.GGUFReader(out).tensors}
    down = written["blk.0.ffn_down.weight"]  # not permuted: the file's values are the merged ones
    got = torch.from_numpy(down.data.copy()).reshape(weights["model.layers.0.mlp.down_proj.weight"].shape)
    assert torch.equal(got, weights["model.layers.0.mlp.down_proj.weight"])
    assert len(written) == len(weights)  # every tensor once (a tied head is written as the embedding)


@pytest.mark.slow
def test_the_summary_scores_the_4bit_base_and_the_merged_model_alike(two, bnb, recwarn):
    """The end-of-run summary of a 4-bit run: the base scored as it trained (in 4 bits), the merged model, and the
    4-bit base + adapter, whose answers the merged model's equal, and whose exact match is the merged model's. PEFT's
    deprecation warning when it wraps the 4-bit base stays off the summary's console (it reached it once)."""
    from fsdp_recipes.evaluation import scoring
    from fsdp_recipes.launch import summary

    two, _ = two
    run_args = json.loads((two / "run_args.json").read_text())
    check = summary.learning_check(two, run_args, 16)
    assert not [w for w in recwarn if "is_gradient_checkpointing" in str(w.message)]
    assert check["n"] == 16 and check["trained_model"] == str(two / "merged")
    four = check["four_bit"]
    assert four["merged_same_answers"] == four["answers_compared"] == 16
    assert four["adapted"]["correct"] == check["trained_correct"] and four["adapted"]["n"] == 16
    assert four["adapted_loss"] == pytest.approx(check["stages"][-1]["loss"], rel=1e-3)  # float32 rounding apart
    assert all(e["trained_4bit"] == e["trained"] for e in check["examples"])
    text = summary.render(two, json.loads((two / "metrics.json").read_text()), check)
    assert f"the 4-bit base + adapter {four['adapted']['correct']}/16 (" in text and "answer on 16/16" in text
    assert scoring.eval_section(check)["four_bit"] == four


# Llama 3.1 70B's published shape (meta-llama/Llama-3.1-70B config.json): 80 layers, hidden 8192, intermediate 28672,
# 64 query heads and 8 key/value heads of 128, vocabulary 128256, untied embeddings.
LLAMA_70B = dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                 num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False)


def test_the_planner_counts_llama_70b_in_4_bits_as_worked_out_by_hand():
    from transformers import LlamaConfig

    from fsdp_recipes.config.model_check import meta_model
    from fsdp_recipes.planning import memory_budget, plan

    args = SimpleNamespace(use_peft=True, lora_r=16, lora_target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                           lora_dropout=0.0, lora_modules_to_save=None, load_in_4bit=True, use_bnb_nested_quant=False)
    m = plan.model_shape(meta_model(LlamaConfig(**LLAMA_70B)), args)
    # one layer's linears: q and o 8192 x 8192, k and v 8192 x 1024, gate, up and down 8192 x 28672
    layer = 2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 28672
    assert layer == 855_638_016 and m.layer_quantized == layer and m.quantized == 80 * layer == 68_451_041_280
    assert m.largest_quantized == 8192 * 28672
    # LoRA r16 on q, k, v, o: r x (in + out) each, 80 layers
    lora = 80 * 16 * ((8192 + 8192) * 2 + (8192 + 1024) * 2)
    assert m.trainable == lora == 65_536_000
    rest = 2 * 128256 * 8192 + 80 * 2 * 8192 + 8192  # embeddings, LM head, norms: in bf16
    assert m.params - m.trainable - m.quantized == rest == 2_102_665_216

    setup = memory_budget.Setup(shard=2, world=2, strategy="FSDP", load_bytes=2, compute_bytes=2, mixed_precision=True,
                                tokens=4096, checkpointed=True, optimizer_bytes=8, runtime_bytes=0,
                                **four_bit.planner_setup(args, None))
    b = memory_budget.budget(m, setup)
    # sharded over 2: bf16 rest, NF4 at half a byte, bf16 adapters (TRL casts a 4-bit model's adapters to bf16, and
    # accelerate does not upcast a 4-bit model's); then the absmax scales, whole on each rank
    assert b["weights"] == (rest * 2 + 68_451_041_280 // 2 + lora * 2) // 2 + 68_451_041_280 // 16 == 23_559_151_616
    assert b["gradients"] == lora * 2 // 2 and b["optimizer_states"] == lora * 4 // 2  # AdamW's moments in bf16 too
    assert b["dequantised_working_copy"] == 8192 * 28672 * 2  # the largest linear in bf16, once
    # FSDP gathers two layers' packed bytes and the root unit at the compute width, and one layer's adapter gradients
    lora_layer = lora // 80
    gathered = 2 * (layer + 2 * 8192 + lora_layer) + rest - 80 * 2 * 8192
    assert b["communication_buffers"] == (gathered - 2 * layer) * 2 + 2 * layer // 2 + lora_layer * 2
    nested = memory_budget.budget(m, memory_budget.Setup(**{**vars(setup), "scale_bytes":
                                                            four_bit.NF4_NESTED_SCALE_BYTES}))
    # nested quantization: a uint8 per 64 and an fp32 per 16384 instead of an fp32 per 64: 3.2 GB less per rank
    assert b["weights"] - nested["weights"] == 68_451_041_280 // 16 - (68_451_041_280 // 64 + 68_451_041_280 // 4096)
