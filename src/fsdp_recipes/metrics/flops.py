"""Model FLOPs per token, peak device FLOPs and MFU.

Convention (PaLM paper appendix B; nanoGPT `estimate_mfu`; torchtitan `get_num_flop_per_token`):
a matmul with N weights costs 2N FLOPs per token forward, 2N for the input gradient and 2N for the weight
gradient, so full fine-tuning costs 6N, and attention's score/value matmuls add 12 * L * H * d_head * T.
N excludes the input embedding (a lookup, not a matmul); the LM head is included.

LoRA: the frozen weights still run forward (2N) and pass gradients through to earlier layers (2N), but
compute no weight gradient, so they cost 4N; the trainable adapters cost the full 6N. This is the work
the hardware really does, so the MFU of LoRA runs is comparable with full fine-tuning's.
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
    return None, f"no peak-FLOPs figure for device '{device_name}' (CPUs and unlisted GPUs give no MFU)"


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


def count_params(model) -> dict[str, int]:
    """Total, trainable, and the non-embedding split that flops_per_token takes. DTensor numel is global.

    PEFT's `modules_to_save` keeps an unused `original_module` beside the trained copy: it counts towards
    the parameters but not the FLOPs.
    """
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    embed_ids = {id(p) for p in embed.parameters()} if embed is not None else set()
    counts = {"total": 0, "trainable": 0, "trainable_non_embedding": 0, "frozen_non_embedding": 0}
    for name, p in model.named_parameters():
        n = p.numel()
        counts["total"] += n
        counts["trainable"] += n if p.requires_grad else 0
        if id(p) not in embed_ids and ".original_module." not in name:
            counts["trainable_non_embedding" if p.requires_grad else "frozen_non_embedding"] += n
    return counts


def attention_shape(config) -> tuple[int, int, int]:
    """(layers, heads, head_dim) from a transformers config."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, heads, head_dim


def mfu(flops_per_tok: float, tokens_per_second: float, peak_per_device: float, n_devices: int) -> float:
    """Achieved model FLOP/s over the devices' combined dense peak."""
    return flops_per_tok * tokens_per_second / (peak_per_device * n_devices)
