"""The tensor-parallel terms of the per-GPU memory budget (planning/memory_budget.py counts the rest). Each reads
memory_budget's ModelShape (m) and Setup (s); memory_budget imports this module, so they are not annotated here
(no import circle).

Tensor parallel with weights wider than the compute (a full fine-tune's fp32 weights under bf16, which config/mesh.py
requires): transformers' FSDP2 under tp has no mixed-precision policy, so autocast casts each linear's 1/tp weight
to bf16 for its matmul, outside FSDP's resharding, and autocast's cast cache holds each copy until the outermost
autocast exits at the forward's end: every layer's, checkpointed or not, and the LM head's (torch's cached_cast keeps
a leaf fp32 weight that needs a gradient; through torch.utils.checkpoint too, measured on CPU 2026-11-29). Measured
on CPU (bench/tp_cpu_collectives.py, 2026-11-29: tiny Mistral, tp 2 x dp_shard 2, fp32 under bf16 autocast,
autograd's saved tensors): 2,968,576 B of bf16 weight copies, the 4 layers' linears and the LM head at 1/tp x 2 B,
exactly. (A plain DDP or one-process run of fp32 weights under autocast would keep the same copies,
undivided: not counted here, not measured.)
The same weights keep the residual stream in fp32 (the embedding's output, and each layer's sum of it and a bf16
projection), so what a layer saves around its norms is wider than the per_layer formula's 2h(4 + 2c): each norm keeps
its fp32 input (no copy to make) and its fp32 normalized tensor (the trained weight's multiply), 2 x 2 x 4h, and
autocast casts the norm's output to bf16 once for each projection reading it, q, k, v, gate and up (5ch; none is
split by tp): 26h a layer at c = 2 instead of 16h. A checkpointed layer's input is fp32 (4h), the final norm adds
the LM head's cast (c h), and FSDP gathers the fp32 weights (4 B). Measured by the same bench (2026-11-29, its
layer_1_activations_per_token): layer 1 of 4 keeps 10,192 B per token on a rank, the formula's 6,656 + 3,520 =
10,176 and 16 B of per-row scalars (2 rsqrt, the attention's log-sum-exp); tests/test_tp_activations.py measures
it again in-process, one process without tp.

LoRA under tp with mixed precision (lora_under_tp_per_layer): the fp32 adapters are not cast either, and PEFT 0.21's
Linear.forward casts each targeted linear's input up to A's dtype (_cast_input_dtype) and autocast casts it back down
for A's matmul: a compute-width copy of the input per targeted linear, which A keeps for its weight's gradient. The
frozen base linears keep only their weights (no input), and the frozen norms only their fp32 input (4h each: the
weight's multiply needs no normalized tensor), so neither the norms' c-wide outputs nor the MLP's product is kept but
as those copies. PEFT splits the adapters with the base (peft/tuners/lora/model.py add_lora_tp_hooks_dtensor): on a
column-wise linear (q, k, v, gate, up) A is whole and reads the whole h-wide input, on a row-wise one (o, down) A
reads the 1/tp input, and every A's r-wide output is whole on each tp rank (a row-wise A's all-reduced). Per layer:

    8h + c(2q + 2kv + 3I) / tp + (c [+ 1, dropout's mask]) * (col-wise in_features + row-wise in_features / tp)
       + c * r * targets

The tiny Mistral with r 4 on every linear at tp 2: 2,048 + 2,832 + 2 x 1,752 + 56 = 8,440 B, against 6,620 before;
measured 8,456 by bench/tp_cpu_collectives.py (2026-11-29, tp 2 x dp_shard 2, bf16 base, fp32 adapters under bf16
autocast; its layer_1_activations_per_token_by_module lists each tensor), the 16 B over it the per-row scalars (2
rsqrt, the log-sum-exp). With dropout a GPU keeps a bool mask (torch's fused native_dropout), 1 B an input element;
a CPU's dropout keeps its scaled noise in the input's dtype, fp32 after PEFT's cast: measured 15,464 = 8,440 +
4 x 1,752 + 16. The adapters' bf16 copies autocast keeps go into tp_autocast_weight_copies: every
layer's (its cache, as above), its adapters on one tp rank (a column-wise B and a row-wise A at 1/tp) at c bytes;
the bench's 96,512 B on the tiny model is this count's 102,656 less the first layer's q, k, v A copies (its input
needs no gradient, so their matmuls keep none). Fused experts under tp (target_parameters) are not measured.
"""

from __future__ import annotations


def wide_weights_under_autocast(s) -> bool:
    """tp with weights wider than the compute (config/mesh.py's fp32 full fine-tune under bf16): nothing casts them
    down before the matmuls (transformers' FSDP2 under tp has no mixed-precision policy), autocast does, per op."""
    return s.tp > 1 and s.mixed_precision and s.load_bytes > s.compute_bytes


def residual_bytes(s) -> int:
    """Bytes per element of the residual stream between layers: the embedding's output and each layer's sum keep
    the weights' dtype when nothing casts the weights (fp32 under tp), else the compute width."""
    return s.load_bytes if wide_weights_under_autocast(s) else s.compute_bytes


def lora_adapters_under_autocast(m, s) -> bool:
    """LoRA under tp with mixed precision: the adapters stay fp32 (transformers' FSDP2 under tp has no mixed-precision
    policy to cast them), so PEFT casts each targeted linear's input up to them and autocast back down for A's matmul,
    a copy A keeps (docstring). QLoRA's adapters are bf16 (budget()): not this."""
    return s.tp > 1 and s.mixed_precision and m.lora_rank_width > 0 and not s.quant_bytes


def lora_under_tp_per_layer(m, s) -> float:
    """Bytes one token leaves in one layer of a LoRA model under tp (the docstring's tensor-by-tensor count, measured
    by bench/tp_cpu_collectives.py): the norms' fp32 inputs (frozen norm weights: no normalized tensor kept), the
    attention's q, k, v and output and the MLP's gate, up and SiLU(gate) at 1/tp (the frozen base linears keep no
    input), each targeted linear's own compute-width copy of its input (whole for a column-wise one, 1/tp for a
    row-wise one: o, down) with dropout's 1-byte mask, and each A's r-wide output, whole on every tp rank."""
    c = s.compute_bytes
    mlp, routing = 3 * m.intermediate, 0  # the product SiLU(gate) * up: kept only as down's LoRA input copy
    if m.experts:  # a mixture of experts: activations_per_token_per_layer's routed count (not measured under tp)
        mlp = m.top_k * (4 * m.intermediate + 2 * m.hidden + 1) + m.hidden
        routing = 4 * m.experts + 32 * m.top_k
    inputs = m.lora_input_width - m.lora_split_input_width + m.lora_split_input_width / s.tp  # on one tp rank
    mask = 1 if m.lora_dropout_width else 0  # a GPU's dropout keeps a bool mask (torch's fused native_dropout)
    return (2 * 4 * m.hidden + c * (2 * m.q_dim + 2 * m.kv_dim + mlp) / s.tp + routing + (c + mask) * inputs
            + c * m.lora_rank_width)
