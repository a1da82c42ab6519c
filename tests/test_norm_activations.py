"""A full fine-tune's trained RMSNorm weights keep their normalized input for the weight's gradient: what the planner
counts per layer and for the final norm (planning/memory_budget.py's docstring), worked by hand on a made-up model,
and held against what autograd saves in the tiny Mistral, in this process."""

import types
from dataclasses import replace

import pytest

from fsdp_recipes.planning import memory_budget

# a made-up model: 2 layers, hidden 16, q 16, kv 8, intermediate 32, vocab 64; full fine-tuning (norms trained)
FULL = memory_budget.ModelShape(
    params=8000, trainable=8000, layers=2, hidden=16, q_dim=16, kv_dim=8, intermediate=32, vocab=64,
    layer_params=3000, layer_trainable=3000, root_params=2000, lora_dropout_width=0, lora_rank_width=0,
    norms_trained=True)
FROZEN = replace(FULL, norms_trained=False)  # frozen norms (LoRA's): the count before for every model
# FSDP2 over 4 GPUs, bf16 weights under bf16 mixed precision (c = 2), 1,024 tokens a GPU, no checkpointing
BF16 = memory_budget.Setup(shard=4, world=4, strategy="FSDP", load_bytes=2, compute_bytes=2, mixed_precision=True,
                           tokens=1024, checkpointed=False, optimizer_bytes=8, runtime_bytes=0)


def test_a_trained_norm_keeps_its_normalized_input_too():
    # 2 norms x 16 x (fp32 input 4 + output 2 + normalized 2) = 256; q, k, v, attention output, gate, up, SiLU,
    # product: 2 x (2 x 16 + 2 x 8 + 4 x 32) = 352; 608 B a token (the count before: 2 x 16 x 6 = 192 + 352 = 544)
    assert memory_budget.activations_per_token_per_layer(FULL, BF16) == 256 + 352 == 608
    assert memory_budget.activations_per_token_per_layer(FROZEN, BF16) == 192 + 352 == 544
    # fp32 compute (no mixed precision): 2 x 16 x (4 + 4 + 4) = 384 + 4 x (2 x 16 + 2 x 8 + 4 x 32) = 704
    fp32 = replace(BF16, load_bytes=4, compute_bytes=4, mixed_precision=False)
    assert memory_budget.activations_per_token_per_layer(FULL, fp32) == 384 + 704 == 1088


def test_the_final_norm_of_a_full_fine_tune_keeps_4h_plus_2ch():
    """The root's activations, 1,024 tokens: the final norm's fp32 input 4h, the chunked head's copy of its output
    ch and its normalized tensor ch (c = 2: 8h, the count before); the head's fp32 tile 1,024 x 64 x 4; the fp32
    gradients of the hidden states 1,024 x 16 x 4 and, the head training, of its weight 64 x 16 x 4."""
    layers = 1024 * 2 * 608
    root = 1024 * 16 * (4 + 2 + 2) + 1024 * 64 * 4 + 1024 * 16 * 4 + 64 * 16 * 4
    assert memory_budget.budget(FULL, BF16)["activations"] == layers + root == 1_708_032
    # the norms frozen (LoRA's): 4h + ch, the head's copy alone (measured below; the count before: 8h)
    frozen_root = 1024 * 16 * (4 + 2) + 1024 * 64 * 4 + 1024 * 16 * 4 + 64 * 16 * 4
    assert memory_budget.budget(FROZEN, BF16)["activations"] == 1024 * 2 * 544 + frozen_root
    # fp32 compute: 4h + 2 x 4h = 12h (the count before: 8h)
    fp32 = replace(BF16, load_bytes=4, compute_bytes=4, mixed_precision=False)
    assert memory_budget.budget(FULL, fp32)["activations"] == (
        1024 * 2 * 1088 + 1024 * 16 * 12 + 1024 * 64 * 4 + 1024 * 16 * 4 + 64 * 16 * 4)


@pytest.mark.parametrize("use_peft", [False, True])
def test_shape_of_marks_the_norms_trained_in_full_fine_tuning_only(cache_dir, use_peft):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(cache_dir / "tiny-mistral"))
    args = types.SimpleNamespace(use_peft=use_peft, lora_target_modules="all-linear", lora_r=4, lora_dropout=0.0,
                                 lora_modules_to_save=None, lora_target_parameters=None)
    assert memory_budget.shape_of(model, args).norms_trained is not use_peft


def saved_per_token(model, ids):
    """Bytes per token autograd saves in layer 1's modules and in the final norm, by module; with the chunked head."""
    import torch

    params = {p.untyped_storage()._cdata for p in model.parameters()}
    where, saved = ["root"], {}
    modules = [(f"layers.1.{n}", m) for n, m in model.model.layers[1].named_modules() if n]
    for name, module in [*modules, ("norm", model.model.norm)]:
        module.register_forward_pre_hook(lambda m, a, name=name: where.append(name))
        module.register_forward_hook(lambda m, a, o: where.pop() and None)

    def pack(t):
        if t.untyped_storage()._cdata not in params:  # t kept: its storage stays its own
            saved.setdefault(t.untyped_storage()._cdata, (where[-1], t))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=ids, labels=ids, fused_lm_head=True).loss.backward()
    by_module = {}
    for module, t in saved.values():
        by_module[module] = by_module.get(module, 0) + t.untyped_storage().nbytes() / ids.numel()
    return by_module, saved


def test_one_layer_and_the_final_norm_of_the_tiny_mistral_save_what_the_formula_counts(cache_dir):
    """One process, bf16 weights (what FSDP2's bf16 policy gathers for the forward) under bf16 autocast (accelerate's),
    TRL's chunked head, 3 rows of 11 tokens, trained norms against frozen ones. The tiny Mistral: hidden 256, q 256,
    kv 128, intermediate 688, 4 heads. A norm keeps its fp32 input 256 x 4 = 1,024 B a token and its fp32 rsqrt 4,
    and trained its bf16 normalized input 256 x 2 = 512. Layer 1: 2 x 256 x (4 + 2 + 2) = 4,096 + 2 x (2 x 256 +
    2 x 128 + 4 x 688) = 7,040: 11,136, and 24 B of per-row scalars (2 rsqrt, 4 heads' log-sum-exp); frozen, 512 B
    less a norm. The head keeps its own bf16 copy of the 30 labelled rows' hidden states (the norm's output)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    ids = torch.randint(4, 268, (3, 11), generator=torch.Generator().manual_seed(0))
    measured = {}
    for trained in (True, False):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(cache_dir / "tiny-mistral"),
                                                 dtype=torch.bfloat16)
        add_fused_lm_head(model)
        for name, p in model.named_parameters():
            p.requires_grad_(trained or "norm" not in name)
        measured[trained] = by_module, saved = saved_per_token(model, ids)
        per_norm = 1024 + 4 + (512 if trained else 0)
        assert by_module["layers.1.input_layernorm"] == by_module["layers.1.post_attention_layernorm"] == per_norm
        assert by_module["norm"] == per_norm
        heads_copy = [t for module, t in saved.values() if module == "root" and t.dtype == torch.bfloat16
                      and tuple(t.shape) == (30, 256)]
        assert len(heads_copy) == 1  # the chunked head's saved `hidden`: the labelled rows, 30 x 256 x 2 B
    layer_1 = {t: sum(n for m, n in measured[t][0].items() if m.startswith("layers.1.")) for t in (True, False)}
    shape = memory_budget.ModelShape(
        params=0, trainable=0, layers=4, hidden=256, q_dim=256, kv_dim=128, intermediate=688, vocab=268,
        layer_params=0, layer_trainable=0, root_params=0, lora_dropout_width=0, lora_rank_width=0, norms_trained=True)
    setup = replace(BF16, tp=1)
    assert memory_budget.activations_per_token_per_layer(shape, setup) == 11_136
    assert layer_1[True] == 11_136 + 24 == 11_160
    frozen = replace(shape, norms_trained=False)
    assert memory_budget.activations_per_token_per_layer(frozen, setup) == 10_112
    assert layer_1[False] == 10_112 + 24 == 10_136
