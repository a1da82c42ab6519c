"""The architecture matrix's families: tiny random decoders built from transformers' own config classes.

Every family gets the same small shape (2 layers, hidden 64, 4 query and 2 key/value heads; GPT-NeoX and OPT, which have
no key/value head setting, 4 of each) and keeps its own quirks, the settings that make it that family and that a
fine-tuning path can trip on: tied or untied embeddings, sliding windows, attention and logit softcapping, fused
projections, mixture-of-experts layers, Granite's multipliers, layers outside model.layers.
scripts/arch_matrix.py trains each under FSDP2; this module is the pure part (no torch at import), tested in process by
tests/test_arch_matrix.py, with the check of a merge of LoRA on the experts (expert_merge).
"""

from __future__ import annotations

from dataclasses import dataclass, field

# 2 layers, so that a family with a per-layer pattern (sliding, full) has one of each
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, max_position_embeddings=256)
# smaller than the data's sequences (15-17 tokens), so that a sliding window really cuts the attention
WINDOW = 8
SLIDING_THEN_FULL = ["sliding_attention", "full_attention"]
# accelerate 1.15 cannot load a model with a buffer in its state dict (the router's e_score_correction_bias) under
# FSDP2's RAM-efficient loading (accelerate issue 3898); the pack refuses that combination in one line
RAM_EFFICIENT_OFF = "ram-efficient loading off (accelerate issue 3898)"
QWEN3_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                 tie_word_embeddings=False)
MIXTRAL = dict(num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)
# transformers 5 fuses each MoE layer's experts into 3-D parameters: PEFT's target_parameters adapts them (LoRA
# dropout 0 there, as the matrix's recipe has it), the attention layers by name, the router (mlp.gate) frozen. (PEFT
# 0.21 turns all-linear on these models into attention, experts and router: the plain qwen3-moe and mixtral rows.)
EXPERT_LORA = ("--lora_target_modules", "q_proj", "k_proj", "v_proj", "o_proj",
               "--lora_target_parameters", "mlp.experts.gate_up_proj", "mlp.experts.down_proj")
EXPERTS_NOTE = "LoRA on attention and experts (target_parameters), router frozen"


@dataclass(frozen=True)
class Family:
    """`model_type`: transformers' name of the config class (AutoConfig.for_model). `quirks`: the family's own
    settings, on top of SHAPE. `attn`: the attention implementation its models support. `fsdp` (accelerate YAML
    fsdp_config keys) and `args` (recipe fields on the command line): what a user of this family must set, and
    `note` why (shown with its results). `refused`: method -> why it cannot work, naming whose limitation it is;
    listed, not run. `methods`: the methods it runs (a variant for LoRA targets only has no full case to add; `head`
    runs on tied families only). `drop`: SHAPE's names its config lacks, left out rather than stored unused (a
    planner or launcher check that reads num_key_value_heads would see GQA the model does not have)."""

    name: str
    model_type: str
    quirks: dict = field(default_factory=dict)
    attn: str = "sdpa"
    fsdp: dict = field(default_factory=dict)
    args: tuple = ()
    note: str = ""
    refused: dict = field(default_factory=dict)
    methods: tuple = ("lora", "full", "head")
    drop: tuple = ()  # SHAPE's settings the family's config does not have (GPT-NeoX: no num_key_value_heads)


FAMILIES = (
    Family("llama", "llama", dict(tie_word_embeddings=False)),  # Llama 3.1 8B: untied head
    Family("mistral", "mistral", dict(sliding_window=WINDOW, tie_word_embeddings=False)),  # Mistral 7B v0.1's window
    Family("qwen2", "qwen2", dict(tie_word_embeddings=True)),  # q/k/v biases; Qwen2 0.5B ties its head
    Family("qwen3", "qwen3", dict(tie_word_embeddings=True)),  # per-head q/k RMSNorm; Qwen3 0.6B ties
    Family("qwen3-moe", "qwen3_moe", QWEN3_MOE),
    Family("mixtral", "mixtral", MIXTRAL),
    # LoRA on the fused 3-D expert weights (PEFT's target_parameters), besides all-linear's attention layers
    Family("qwen3-moe-experts", "qwen3_moe", QWEN3_MOE, args=EXPERT_LORA, note=EXPERTS_NOTE, methods=("lora",)),
    Family("mixtral-experts", "mixtral", MIXTRAL, args=EXPERT_LORA, note=EXPERTS_NOTE, methods=("lora",)),
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
    # mixture of experts with attention sinks, biases and sliding windows; transformers runs it in eager only
    Family("gpt-oss", "gpt_oss", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
                                      layer_types=SLIDING_THEN_FULL), attn="eager"),
    # multi-head latent attention (as many key/value heads as query heads, as DeepSeek's), a dense first layer then
    # experts, a router with a bias buffer
    Family("deepseek-v3", "deepseek_v3", dict(num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
                                              moe_intermediate_size=32, first_k_dense_replace=1, kv_lora_rank=16,
                                              q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                                              head_dim=8, n_group=1, topk_group=1),
           fsdp={"fsdp_cpu_ram_efficient_loading": False}, note=RAM_EFFICIENT_OFF),
    Family("glm4-moe", "glm4_moe", dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                        first_k_dense_replace=1, n_group=1, topk_group=1),
           fsdp={"fsdp_cpu_ram_efficient_loading": False}, note=RAM_EFFICIENT_OFF),
    Family("granite-moe", "granitemoe", dict(num_local_experts=4, num_experts_per_tok=2),
           # TRL 1.16's SFT loss asks the config for num_experts, which Granite's calls num_local_experts: the pack
           # refuses the load-balancing loss in one line, with this fix
           args=("--router_aux_loss_coef", "0.0"), note="router_aux_loss_coef 0 (TRL 1.16 reads num_experts)"),
    # linear attention (gated delta rule) and full attention layers, experts with a shared expert
    Family("qwen3-next", "qwen3_next", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                            shared_expert_intermediate_size=32, linear_num_value_heads=4,
                                            linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                                            layer_types=["linear_attention", "full_attention"])),
    Family("qwen3.5", "qwen3_5_text", dict(layer_types=["linear_attention", "full_attention"]),
           # transformers 5.23 lists Qwen3_5VisionBlock, absent from the text model, in its _no_split_modules, and
           # accelerate refuses a listed class it cannot find: the wrap class is named
           fsdp={"fsdp_transformer_layer_cls_to_wrap": "Qwen3_5DecoderLayer"},
           note="wrap class named (_no_split_modules lists a vision block)"),
    # Mamba and attention layers, experts every other layer
    Family("jamba", "jamba", dict(num_experts=4, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                                  expert_layer_offset=1),
           args=("--lora_target_modules", "q_proj", "k_proj", "v_proj", "o_proj", "in_proj", "x_proj", "out_proj",
                 "gate_proj", "up_proj", "down_proj"),
           # transformers' Jamba mixer multiplies by dt_proj.weight, so an adapter there never trains (the pack's
           # final-save check stops such a run: its LoRA B is still zero)
           note="LoRA without dt_proj (its weight is read directly)"),
    # PEFT 0.21 refuses out_proj and conv1d in Mamba models; the mixer multiplies by dt_proj.weight, as Jamba's
    Family("mamba", "mamba", dict(), attn="eager", args=("--lora_target_modules", "in_proj", "x_proj"),
           note="LoRA on in_proj, x_proj (PEFT refuses out_proj)"),
    Family("phi", "phi", dict(tie_word_embeddings=False)),  # Phi-2: rotary on half of each head (its default), dense
    Family("lfm2", "lfm2", dict(tie_word_embeddings=True)),  # short convolutions and attention layers
    # TRL 1.16's SFT loss cannot run Llama 4 (the pack refuses it in one line): listed to show that line
    Family("llama4-text", "llama4_text", dict(num_local_experts=4, num_experts_per_tok=1, intermediate_size_mlp=128)),
    # decoders outside model.layers, without num_key_value_heads (as many key/value heads as query heads): GPT-NeoX
    # (Pythia) keeps its layers in gpt_neox.layers, fuses query_key_value, runs attention and MLP in parallel, rotary
    # on a quarter of each head, an untied head; OPT in model.decoder.layers, learned positions, ReLU
    # MLP of width ffn_dim, its head tied
    Family("gpt-neox", "gpt_neox", dict(tie_word_embeddings=False),
           drop=("num_key_value_heads", "head_dim")),
    Family("opt", "opt", dict(ffn_dim=128, tie_word_embeddings=True),
           drop=("num_key_value_heads", "head_dim", "intermediate_size")),
)


def tied(family: Family) -> bool:
    """Whether the family's table entry ties the LM head to the input embedding (the matrix's `head` method)."""
    return bool(family.quirks.get("tie_word_embeddings"))


def by_name(names: list[str] | None = None) -> list[Family]:
    """The families named (all by default), in the table's order; an unknown name is one line listing the known."""
    if not names:
        return list(FAMILIES)
    known = {f.name: f for f in FAMILIES}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"no family named {', '.join(unknown)}. Fix: name one of {', '.join(known)}")
    return [known[n] for n in names]


def parse_cases(cases: list[str]) -> list[tuple[Family, str]]:
    """`--cases` entries, each `family:method` with a method the family runs (Family.methods); a malformed one is
    one line naming the form."""
    out = []
    for case in cases:
        name, sep, method = case.partition(":")
        if not sep or not name or not method or ":" in method:
            raise ValueError(f"case {case!r} is not family:method. Fix: --cases family:method,... "
                             f"(e.g. {name or 'llama'}:lora)")
        family = by_name([name])[0]
        if method not in family.methods:
            raise ValueError(f"{name} runs no {method!r} case. Fix: {name}:<one of {', '.join(family.methods)}>")
        out.append((family, method))
    return out


def config_kwargs(family: Family, vocab_size: int, bos: int, eos: int, pad: int) -> dict:
    """The keyword arguments of the family's config class: the shared shape, the tokenizer's ids, the quirks.
    GPT-2 names its shape otherwise (n_embd, n_layer, ...): its quirks replace SHAPE."""
    shape = {} if family.model_type == "gpt2" else {k: v for k, v in SHAPE.items() if k not in family.drop}
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


def refusal_line(family: Family, method: str) -> str:
    """What the matrix says of a case it does not run."""
    return f"{family.name} {method}: refused: {family.refused[method]}"


def expert_merge(base_dir, run, atol: float) -> str:
    """LoRA on the fused experts: each merged expert equals base + scaling * B_e @ A_e, from the saved adapter's
    matrices by hand (PEFT stores A as (rank x experts, in) and B as (out, rank x experts), expert e's rows of A in
    one block and its columns of B every experts-th), and the router is the base's. Logits alone could hide a
    merge that dropped the experts' deltas where they are small. The models are compared as transformers loads them
    (fused): it saves the experts one by one, in transformers 4's layout."""
    import json

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    base, merged = (AutoModelForCausalLM.from_pretrained(path).state_dict() for path in (base_dir, run / "merged"))
    adapter = load_file(str(run / "adapter_model.safetensors"))
    config = json.loads((run / "adapter_config.json").read_text())
    if any(".mlp.gate." in key for key in adapter):
        raise AssertionError("the adapter holds LoRA on the router (mlp.gate), which the recipe did not name")
    largest, checked, moved = 0.0, 0, 0
    for name, weight in base.items():
        if weight.ndim != 3:
            if ".mlp.gate." in name and not bool((merged[name] == weight).all()):
                raise AssertionError(f"{name}: the router changed in the merge")
            continue
        experts, out_features, in_features = weight.shape
        prefix = "base_model.model." + name.rsplit(".", 1)[0]
        pairs = [(adapter[key], adapter[key.replace("lora_A", "lora_B")]) for key in adapter
                 if key.startswith(prefix + ".") and key.endswith("lora_A.weight")]
        lora_a, lora_b = next((a, b) for a, b in pairs if a.shape[1] == in_features and b.shape[0] == out_features)
        rank = lora_a.shape[0] // experts
        scaling = config["lora_alpha"] / config["r"]
        for e in range(experts):
            delta = scaling * lora_b[:, e::experts] @ lora_a[e * rank:(e + 1) * rank]
            diff = (merged[name][e] - (weight[e] + delta)).abs().max().item()
            if diff > atol:
                raise AssertionError(f"{name} expert {e}: merged differs from base + LoRA by {diff:.3g}")
            # an expert that was given no token keeps its B at zero
            largest, moved = max(largest, diff), moved + bool(delta.abs().max() > 0)
        checked += experts
    if not moved:
        raise AssertionError("no expert's LoRA moved: the experts were not trained")
    return f"{checked} experts = base + B@A within {largest:.1g} ({moved} moved), router unchanged"
