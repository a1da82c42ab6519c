"""Model FLOPs per token, peak device FLOPs and MFU.

Convention (PaLM paper appendix B; nanoGPT `estimate_mfu`; torchtitan `get_num_flop_per_token`):
a matmul with N weights costs 2N FLOPs per token forward, 2N for the input gradient and 2N for the weight
gradient, so full fine-tuning costs 6N, and attention's score/value matmuls add 12 * L * H * d_head * T.
N excludes the input embedding (a lookup, not a matmul); the LM head is included.

LoRA: the frozen weights still run forward (2N) and pass gradients through to earlier layers (2N), but
compute no weight gradient, so they cost 4N; the trainable adapters cost the full 6N. This is the work
the hardware really does, so the MFU of LoRA runs is comparable with full fine-tuning's.

Mixture of experts (Qwen3-MoE, Mixtral): a token passes through the attention, the router and top_k of the
num_experts experts of each layer, so N is the *active* parameters: the non-expert ones plus top_k / num_experts of
the expert weights (`model.layers.N.mlp.experts.*`, fused (E, ...) tensors in transformers 5). Weights, gradients and
optimizer states are held for all of them (planning/memory_budget.py). Qwen3-30B-A3B: 30.5B parameters, 3.3B active.
"""

from __future__ import annotations

# Dense (not 2:4 sparse) BF16 tensor-core peaks, FLOP/s, from NVIDIA's product datasheets. Matched in order
# against torch.cuda.get_device_name(): more specific names first ("H100 NVL" before "H100").
PEAK_BF16_DENSE_FLOPS: list[tuple[str, float]] = [
    ("H100 NVL", 835e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),  # SXM5, reported as "NVIDIA H100 80GB HBM3"
    ("H200 NVL", 835e12),
    ("GH200", 989e12),
    ("H200", 989e12),  # SXM
    ("B200", 2250e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
    ("A10", 125e12),
]


def peak_flops(device_name: str | None) -> tuple[float | None, str | None]:
    """(dense bf16 FLOP/s, None) for a known GPU, else (None, reason)."""
    if not device_name:
        return None, "no device name"
    for key, flops in PEAK_BF16_DENSE_FLOPS:
        if key in device_name:
            return flops, None
    return None, f"no peak-FLOPs figure for device '{device_name}' (a GPU this table does not list)"


def flops_per_token(
    trainable_params: int, frozen_params: int, n_layers: int, n_heads: int, head_dim: int, seq_len: float
) -> float:
    """Training FLOPs per token. Params exclude the input embedding; see the module docstring."""
    return 6 * trainable_params + 4 * frozen_params + 12 * n_layers * n_heads * head_dim * seq_len


def forward_flops(params: int, n_layers: int, n_heads: int, head_dim: int, seq_len: float) -> float:
    """A forward only, per token: 2N plus attention's forward third (4 * L * H * d_head * T). DPO's reference model:
    N is the reference's non-embedding weights, with LoRA the base with the adapter disabled (the frozen weights),
    with full fine-tuning a copy of the policy (its trainable weights). GRPO's sampling: the policy's weights."""
    return 2 * params + 4 * n_layers * n_heads * head_dim * seq_len


def extra_forward_weights(name: str, trainable_params: int, frozen_params: int, lora: bool) -> int:
    """The non-embedding weights an extra forward (a trainer kind's extra_forwards, train/kinds) runs: the reference
    model's for "reference" (LoRA: the base with the adapter disabled, the frozen weights; full fine-tuning: a copy of
    the whole model), the policy's own for every other ("kl_policy", "old_policy", "generation")."""
    if name == "reference" and lora:
        return frozen_params
    return trainable_params + frozen_params


def extra_forward_flops(extra_forwards: dict[str, float], trainable_params: int, frozen_params: int, lora: bool,
                        n_layers: int, n_heads: int, head_dim: int, seq_len: float) -> float:
    """FLOPs per trained token of a kind's forwards besides the trained sequence's own forward and backward
    (extra_forwards: forwards per trained token, by name). One rule for the run report's MFU and make plan's
    compute time (planning/comms.py), so the two cannot drift."""
    return sum(per_token * forward_flops(extra_forward_weights(name, trainable_params, frozen_params, lora),
                                         n_layers, n_heads, head_dim, seq_len)
               for name, per_token in extra_forwards.items())


def experts_of(config) -> tuple[int, int] | None:
    """(top_k, num_experts) of a mixture-of-experts config, None for a dense model. Qwen3-MoE names the experts
    num_experts, Mixtral num_local_experts (its config maps num_experts to it), DeepSeek-style configs n_routed_experts."""
    if config is None:
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    top_k = getattr(text, "num_experts_per_tok", None)
    experts = next((getattr(text, k) for k in ("num_experts", "num_local_experts", "n_routed_experts")
                    if isinstance(getattr(text, k, None), int)), None)
    return (int(top_k), experts) if top_k and experts else None


def is_expert_param(name: str) -> bool:
    """A routed expert's weight (or an adapter on it): `...mlp.experts.gate_up_proj`, `...experts.3.w1.weight`. The
    router (`mlp.gate`) and a shared expert (`mlp.shared_expert`) run for every token and are not."""
    return ".experts." in name or name.endswith(".experts")


def count_params(model) -> dict[str, int]:
    """Total, trainable, and the non-embedding split that flops_per_token takes. DTensor numel is global.

    PEFT's `modules_to_save` keeps an unused `original_module` beside the trained copy: it counts towards
    the parameters but not the FLOPs. In a mixture of experts, `*_active` counts a routed expert's weights at
    top_k / num_experts (the module docstring): the FLOPs take those; `expert` is all the expert weights. A dense model's
    active counts are its counts.
    """
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    embed_ids = {id(p) for p in embed.parameters()} if embed is not None else set()
    moe = experts_of(getattr(model, "config", None))
    fraction = moe[0] / moe[1] if moe else 1.0
    counts = {"total": 0, "trainable": 0, "trainable_non_embedding": 0, "frozen_non_embedding": 0, "expert": 0,
              "active": 0.0, "trainable_active_non_embedding": 0.0, "frozen_active_non_embedding": 0.0}
    for name, p in model.named_parameters():
        n = p.numel()
        counts["total"] += n
        counts["trainable"] += n if p.requires_grad else 0
        routed = moe is not None and is_expert_param(name)
        counts["expert"] += n if routed else 0
        active = n * fraction if routed else n
        counts["active"] += active
        if id(p) not in embed_ids and ".original_module." not in name:
            split = "trainable" if p.requires_grad else "frozen"
            counts[f"{split}_non_embedding"] += n
            counts[f"{split}_active_non_embedding"] += active
    return {k: round(v) if isinstance(v, float) else v for k, v in counts.items()}


def attention_shape(config) -> tuple[int, int, int]:
    """(layers, heads, head_dim) from a transformers config."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, heads, head_dim


def mfu(flops_per_tok: float, tokens_per_second: float, peak_per_device: float, n_devices: int) -> float:
    """Achieved model FLOP/s over the devices' combined dense peak."""
    return flops_per_tok * tokens_per_second / (peak_per_device * n_devices)
