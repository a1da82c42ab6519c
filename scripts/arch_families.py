"""The architecture matrix's families: tiny random decoders built from transformers' own config classes.

Every family gets the same small shape (2 layers, hidden 64, 4 query and 2 key/value heads) and keeps its own quirks,
the settings that make it that family and that a fine-tuning path can trip on: tied or untied embeddings, sliding
windows, attention and logit softcapping, fused projections, mixture-of-experts layers, Granite's multipliers.
scripts/arch_matrix.py trains each under FSDP2; this module is the pure part (no torch at import), tested in process by
tests/test_arch_matrix.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# 2 layers, so that a family with a per-layer pattern (sliding, full) has one of each
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, max_position_embeddings=256)
# smaller than the data's sequences (15-17 tokens), so that a sliding window really cuts the attention
WINDOW = 8
SLIDING_THEN_FULL = ["sliding_attention", "full_attention"]


@dataclass(frozen=True)
class Family:
    """`model_type`: transformers' name of the config class (AutoConfig.for_model). `quirks`: the family's own
    settings, on top of SHAPE. `attn`: the attention implementation its models support. `refused`: why it cannot
    work, naming whose limitation it is; a refused family is listed, not run."""

    name: str
    model_type: str
    quirks: dict = field(default_factory=dict)
    attn: str = "sdpa"
    refused: str | None = None


FAMILIES = (
    Family("llama", "llama", dict(tie_word_embeddings=False)),  # Llama 3.1 8B: untied head
    Family("mistral", "mistral", dict(sliding_window=WINDOW, tie_word_embeddings=False)),  # Mistral 7B v0.1's window
    Family("qwen2", "qwen2", dict(tie_word_embeddings=True)),  # q/k/v biases; Qwen2 0.5B ties its head
    Family("qwen3", "qwen3", dict(tie_word_embeddings=True)),  # per-head q/k RMSNorm; Qwen3 0.6B ties
    Family("qwen3-moe", "qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                          norm_topk_prob=True, tie_word_embeddings=False)),
    Family("mixtral", "mixtral", dict(num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)),
    # softcapping and query_pre_attn_scalar are Gemma 2's; transformers runs its attention in eager only
    Family("gemma2", "gemma2", dict(query_pre_attn_scalar=16, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                                    sliding_window=WINDOW, layer_types=SLIDING_THEN_FULL, tie_word_embeddings=True),
           attn="eager"),
    Family("gemma3-text", "gemma3_text", dict(query_pre_attn_scalar=16, sliding_window=WINDOW,
                                              layer_types=SLIDING_THEN_FULL, tie_word_embeddings=True)),
    Family("phi3", "phi3", dict(tie_word_embeddings=False)),  # fused qkv_proj and gate_up_proj
    Family("olmo2", "olmo2", dict(tie_word_embeddings=False)),  # norms after attention and MLP, q/k norm
    # Granite 3's multipliers on the embeddings, residuals, attention and logits
    Family("granite", "granite", dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0625,
                                      logits_scaling=8.0, tie_word_embeddings=True)),
    Family("smollm3", "smollm3", dict(no_rope_layers=[1, 0], tie_word_embeddings=True)),  # a layer without RoPE
    Family("cohere2", "cohere2", dict(sliding_window=WINDOW, layer_types=SLIDING_THEN_FULL, logit_scale=0.25,
                                      tie_word_embeddings=True)),  # parallel attention and MLP, LayerNorm
    Family("starcoder2", "starcoder2", dict(tie_word_embeddings=True)),  # biases everywhere, LayerNorm, GELU MLP
    Family("gpt2", "gpt2", dict(n_embd=64, n_layer=2, n_head=4, n_positions=256)),  # Conv1D layers, learned positions
)


def by_name(names: list[str] | None = None) -> list[Family]:
    """The families named (all by default), in the table's order; an unknown name is one line listing the known."""
    if not names:
        return list(FAMILIES)
    known = {f.name: f for f in FAMILIES}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"no family named {', '.join(unknown)}. Fix: name one of {', '.join(known)}")
    return [known[n] for n in names]


def config_kwargs(family: Family, vocab_size: int, bos: int, eos: int, pad: int) -> dict:
    """The keyword arguments of the family's config class: the shared shape, the tokenizer's ids, the quirks.
    GPT-2 names its shape otherwise (n_embd, n_layer, ...): its quirks replace SHAPE."""
    shape = {} if family.model_type == "gpt2" else SHAPE
    return dict(shape, vocab_size=vocab_size, bos_token_id=bos, eos_token_id=eos, pad_token_id=pad, dtype="float32",
                **family.quirks)


def build_config(family: Family, tokenizer):
    """The family's own config class (AutoConfig.for_model), for this tokenizer."""
    from transformers import AutoConfig

    return AutoConfig.for_model(family.model_type, **config_kwargs(
        family, len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id))


def build_model(family: Family, tokenizer, out, seed: int = 0) -> int:
    """A randomly initialised model of the family, saved with the tokenizer into `out`; returns its parameter count."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(build_config(family, tokenizer), attn_implementation=family.attn)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def refusal_line(family: Family) -> str:
    """What the matrix prints for a family it does not run."""
    return f"{family.name}: refused: {family.refused}"
