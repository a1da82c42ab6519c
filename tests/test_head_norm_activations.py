"""Qwen3's q_norm and k_norm (an RMSNorm over each query and key head before RoPE) keep what the other norms keep, over
the q and kv heads: what the planner counts (planning/memory_budget.py's head_norms_per_layer), worked by hand on the
tiny Qwen3 config below and on Qwen3-8B's, found by shape_of from the model's modules, and held against what autograd
saves in that tiny Qwen3, in this process."""

import types
from dataclasses import replace

from fsdp_recipes.planning import memory_budget

# a tiny Qwen3 layer: hidden 256, 4 query heads and 2 key/value heads of 64 (q 256, kv 128), intermediate 688
TINY = dict(vocab_size=268, hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, max_position_embeddings=64, tie_word_embeddings=False)
SHAPE = memory_budget.ModelShape(
    params=0, trainable=0, layers=2, hidden=256, q_dim=256, kv_dim=128, intermediate=688, vocab=268, layer_params=0,
    layer_trainable=0, root_params=0, lora_dropout_width=0, lora_rank_width=0, norms_trained=True, head_norm_rows=6)
# bf16 under bf16 mixed precision (c = 2), one GPU's 1,024 tokens, no checkpointing
BF16 = memory_budget.Setup(shard=1, world=1, strategy="FSDP", load_bytes=2, compute_bytes=2, mixed_precision=True,
                           tokens=1024, checkpointed=False, optimizer_bytes=8, runtime_bytes=0)


def test_the_head_norms_of_a_tiny_qwen3_layer_by_hand():
    # the layer without head norms (test_norm_activations.py's tiny Mistral has the same widths): trained norms
    # 2 x 256 x (4 + 2 + 2) = 4,096, q, k, v, attention output, MLP 2 x (2 x 256 + 2 x 128 + 4 x 688) = 7,040;
    # q_norm and k_norm: fp32 input (256 + 128) x 4 = 1,536, the normalized bf16 copy (256 + 128) x 2 = 768 (trained
    # only), rsqrt one fp32 per head: (4 + 2) x 4 = 24
    assert memory_budget.activations_per_token_per_layer(SHAPE, BF16) == 4096 + 7040 + 1536 + 768 + 24 == 13_464
    frozen = replace(SHAPE, norms_trained=False)  # LoRA's: norms 2 x 256 x 6 = 3,072, no normalized copies
    assert memory_budget.activations_per_token_per_layer(frozen, BF16) == 3072 + 7040 + 1536 + 24 == 11_672
    # without head norms (every other architecture) the count is the one before
    assert memory_budget.activations_per_token_per_layer(replace(SHAPE, head_norm_rows=0), BF16) == 11_136
    # under tp 2 the heads, and so their norms, are split: (1,536 + 768 + 24) / 2 = 1,164 of the 2,328
    tp = replace(BF16, tp=2)
    assert (memory_budget.activations_per_token_per_layer(SHAPE, tp)
            - memory_budget.activations_per_token_per_layer(replace(SHAPE, head_norm_rows=0), tp)) == 1_164


def test_qwen3_8b_full_fine_tune_by_hand():
    """Qwen3-8B (recipes/qwen3-8b-full/model_config.json): 32 query heads and 8 key/value heads of 128, q 4,096,
    kv 1,024: (4 + 2) x 5,120 + 4 x 40 = 30,880 B a layer-token more, 36 layers x 4,096 tokens = 4.24 GiB."""
    m = replace(SHAPE, layers=36, hidden=4096, q_dim=4096, kv_dim=1024, intermediate=12288, head_norm_rows=40)
    without = replace(m, head_norm_rows=0)
    assert memory_budget.head_norms_per_layer(m, BF16) == 30_880
    assert (memory_budget.activations_per_token_per_layer(m, BF16)
            - memory_budget.activations_per_token_per_layer(without, BF16)) == 30_880


def test_shape_of_finds_the_head_norms_from_the_models_modules():
    """Qwen3 and Qwen3-MoE have q_norm and k_norm in their attention, Mistral none; shape_of reads the model, not a
    name, and counts a norm's rows from its weight's width (head_dim: one row a head)."""
    import torch
    from transformers import AutoModelForCausalLM, MistralConfig, Qwen3Config, Qwen3MoeConfig

    args = types.SimpleNamespace(use_peft=False, lora_target_modules="all-linear", lora_r=4, lora_dropout=0.0,
                                 lora_modules_to_save=None, lora_target_parameters=None)
    moe = dict(TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
    with torch.device("meta"):
        for config, rows in [(Qwen3Config(**TINY), 6), (Qwen3MoeConfig(**moe), 6),
                             (MistralConfig(**{k: v for k, v in TINY.items() if k != "head_dim"}), 0)]:
            model = AutoModelForCausalLM.from_config(config)
            assert memory_budget.shape_of(model, args).head_norm_rows == rows, type(config).__name__


def test_a_tiny_qwen3_layer_saves_what_the_formula_counts():
    """One process, bf16 weights under bf16 autocast, TRL's chunked head, 3 rows of 11 tokens (test_norm_activations'
    setting), trained norms and frozen ones: each head norm keeps exactly its count, and layer 1 the formula's
    13,464 (11,672 frozen) and 24 B of the other per-row scalars (2 rsqrt, 4 heads' log-sum-exp), as the tiny
    Mistral."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config
    from trl.trainer.utils import add_fused_lm_head

    from test_norm_activations import saved_per_token

    ids = torch.randint(4, 268, (3, 11), generator=torch.Generator().manual_seed(0))
    for trained in (True, False):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(Qwen3Config(**TINY), dtype=torch.bfloat16)
        add_fused_lm_head(model)
        for name, p in model.named_parameters():
            p.requires_grad_(trained or "norm" not in name)
        by_module, _ = saved_per_token(model, ids)
        normalized = 2 if trained else 0
        assert by_module["layers.1.self_attn.q_norm"] == 256 * (4 + normalized) + 4 * 4
        assert by_module["layers.1.self_attn.k_norm"] == 128 * (4 + normalized) + 2 * 4
        layer_1 = sum(n for m, n in by_module.items() if m.startswith("layers.1."))
        shape = replace(SHAPE, norms_trained=trained)
        assert layer_1 == memory_budget.activations_per_token_per_layer(shape, BF16) + 24 == (
            13_488 if trained else 11_696)
