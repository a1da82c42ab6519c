"""FLOPs per token against hand-computed values for real model configs, peak table, MFU arithmetic."""

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig

from fsdp_recipes.metrics import flops


def meta_model(config):
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


# Llama 3.1 8B (config.json of meta-llama/Llama-3.1-8B), copied here: no hub at test time.
LLAMA_3_8B = LlamaConfig(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False,
)
# Mistral 7B v0.3 (config.json of mistralai/Mistral-7B-v0.3).
MISTRAL_7B = MistralConfig(
    vocab_size=32768, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False,
)


def hand_count_non_embedding(vocab, d, ffn, layers, heads, kv_heads):
    """Per layer: q, o (d*d each), k, v (d * kv_dim each), gate/up/down (3*d*ffn), 2 RMSNorms (2d);
    then the final norm (d) and the LM head (vocab*d). The input embedding is excluded."""
    kv_dim = d // heads * kv_heads
    per_layer = 2 * d * d + 2 * d * kv_dim + 3 * d * ffn + 2 * d
    return layers * per_layer + d + vocab * d


@pytest.mark.parametrize(
    "config, expected_non_embedding",
    [
        (LLAMA_3_8B, 6_979_584_000 + 4096 + 525_336_576),  # 32 layers x 218,112,000 + final norm + LM head
        (MISTRAL_7B, 6_979_584_000 + 4096 + 134_217_728),
    ],
)
def test_full_finetune_flops_match_hand_computation(config, expected_non_embedding):
    assert hand_count_non_embedding(
        config.vocab_size, 4096, 14336, 32, 32, 8
    ) == expected_non_embedding
    counts = flops.count_params(meta_model(config))
    assert counts["trainable_non_embedding"] == expected_non_embedding
    assert counts["total"] == expected_non_embedding + config.vocab_size * 4096
    assert flops.attention_shape(config) == (32, 32, 128)  # 32 layers, 32 heads of 4096 / 32 = 128
    seq = 4096
    fpt = flops.flops_per_token(expected_non_embedding, 0, 32, 32, 128, seq)
    # 6N + 12 * L * H * d_head * T, written out by hand (PaLM paper, Chowdhery et al. 2022, appendix B; nanoGPT's
    # estimate_mfu uses the same count): 2N forward, 4N backward, plus attention's QK^T and AV over T positions
    assert fpt == 6 * expected_non_embedding + 12 * 32 * 32 * 128 * 4096


def test_lora_counts_frozen_weights_as_four_n():
    full = flops.flops_per_token(1000, 0, 2, 4, 8, 16)
    lora = flops.flops_per_token(10, 990, 2, 4, 8, 16)
    attention = 12 * 2 * 4 * 8 * 16
    assert full == 6 * 1000 + attention
    assert lora == 6 * 10 + 4 * 990 + attention


def test_count_params_splits_frozen_and_trainable():
    model = meta_model(MISTRAL_7B)
    for name, p in model.named_parameters():
        p.requires_grad = name.startswith("lm_head")
    counts = flops.count_params(model)
    assert counts["trainable_non_embedding"] == 32768 * 4096
    assert counts["trainable"] == 32768 * 4096
    assert counts["frozen_non_embedding"] == 6_979_584_000 + 4096


# Dense (not 2:4 sparse) BF16 tensor-core peaks in TFLOP/s from NVIDIA's datasheets (half the "with sparsity"
# figure), copied here by hand: H100 SXM 989, PCIe 756, NVL 835 (H100 datasheet); H200 SXM 989, NVL 835 (H200
# datasheet); A100 312; L40S 362; L4 121.
@pytest.mark.parametrize(
    "name, peak",
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H100 NVL", 835e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA H200 NVL", 835e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA L40S", 362e12),
        ("NVIDIA L4", 121e12),
    ],
)
def test_peak_flops_table(name, peak):
    assert flops.peak_flops(name) == (peak, None)


@pytest.mark.parametrize("name", ["NVIDIA GeForce GTX 1080", "", None])
def test_unknown_device_gives_none_and_a_reason(name):
    value, reason = flops.peak_flops(name)
    assert value is None and reason


def test_mfu_arithmetic():
    # 8 GPUs at 989 TFLOP/s, 5e10 FLOPs/token, 6,700 tokens/s/GPU -> 6700 * 5e10 / 989e12 = 33.9%
    assert flops.mfu(5e10, 8 * 6700, 989e12, 8) == pytest.approx(0.3387, abs=1e-4)


def test_extra_forwards_run_on_the_reference_or_the_policy():
    """The one rule the run report and make plan share: 2N + 4 x layers x heads x head_dim x length per forward,
    N the reference's (LoRA: the frozen base; full: a copy of it all) or the policy's (every other forward).
    10 trainable + 990 frozen weights, 2 layers x 4 heads x 8, 16 tokens: attention's forward third is 4,096."""
    kto = {"reference": 2.0, "kl_policy": 1.0}
    assert flops.extra_forward_flops(kto, 10, 990, True, 2, 4, 8, 16) == 2 * (2 * 990 + 4096) + (2 * 1000 + 4096)
    assert flops.extra_forward_flops(kto, 10, 990, False, 2, 4, 8, 16) == 3 * (2 * 1000 + 4096)
    assert flops.extra_forward_flops({}, 10, 990, True, 2, 4, 8, 16) == 0
