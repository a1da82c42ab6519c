"""`attn_implementation: packed_varlen`: attention over packed rows with no S x S mask, registered in transformers'
AttentionInterface (and its mask in AttentionMaskInterface) under NAME. attention.py picks it (`auto`) on CUDA
for packed rows.

Why: TRL's padding-free collator (`padding_free: true`, or packing with `bfd`) flattens a batch into one row and
hands the model `position_ids`, `cu_seq_lens_q/k` and `max_length_q/k`. With `sdpa`, transformers ignores the
cu_seq_lens and builds a block-diagonal boolean mask from the position_ids (masking_utils.py create_causal_mask ->
find_packed_sequence_indices -> packed_sequence_compatibility_function): T x T, every layer runs SDPA's masked
kernel over the whole flattened row (two 4096-token sequences cost as much as one of 8192), and the mask rules out
the flash kernels. Here the rows' bounds go to a variable-length kernel instead, which attends within each row only.

What runs:
- Packed rows (no padding mask, and either cu_seq_lens from the collator or position_ids that restart): on CUDA
  torch's own `torch.nn.attention.varlen.varlen_attn` (the flash kernels inside the torch wheel: nothing to
  install); elsewhere, or without that module, a reference that computes the same thing, SDPA with `is_causal` on
  each row in turn (no mask either; this is what the CPU tests check against eager attention on unpacked rows).
- Anything else (full rows, padded rows, generation with a cache): transformers' own sdpa function and mask,
  unchanged.

How the mask function tells a packed batch: create_causal_mask turns `allow_is_causal_skip` off for a packed
batch, and also for an or/and mask overlay (which it marks with `use_vmap`) or a compiled cache's decoding step
(one query). So no padding mask, the skip off, no vmap and more than one query of a self-attention: packed.
Models that overlay block masks without vmap (`block_sequence_ids`) are not for this implementation.
"""

from __future__ import annotations

NAME = "packed_varlen"


def register() -> None:
    """Make NAME an attn_implementation transformers accepts in this process (before from_pretrained)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, packed_varlen_attention)
    AttentionMaskInterface.register(NAME, packed_varlen_mask)


def torch_varlen_available() -> bool:
    """torch ships `torch.nn.attention.varlen` (2.10 and later); its kernels run on CUDA only."""
    import importlib.util

    return importlib.util.find_spec("torch.nn.attention.varlen") is not None


def packed_varlen_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0, mask_function=None,
                       attention_mask=None, allow_is_causal_skip: bool = True, use_vmap: bool = False, **kwargs):
    """None for a packed batch (the attention function takes the rows' bounds from the kwargs); otherwise exactly
    the mask transformers builds for sdpa (masking_utils.sdpa_mask)."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    packed = attention_mask is None and not allow_is_causal_skip and not use_vmap and q_length == kv_length > 1
    if packed:
        return None
    return sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function or causal_mask_function,
                     attention_mask, allow_is_causal_skip=allow_is_causal_skip, use_vmap=use_vmap, **kwargs)


def packed_varlen_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                            is_causal=None, **kwargs):
    """transformers' attention-function signature: query (B, H, T, D), key/value (B, Hkv, T, D); returns
    (B, T, H, D) and no weights."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    bounds = packed_bounds(query, key, attention_mask, kwargs)
    if bounds is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    if kwargs.get("softcap") is not None:
        raise ValueError(f"attn_implementation {NAME} does not support softcap; use eager or flex_attention")
    cu_seq_lens, max_length = bounds
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    window = kwargs.get("sliding_window")
    if query.is_cuda and dropout == 0.0 and torch_varlen_available():
        return varlen_kernel(query, key, value, cu_seq_lens, max_length, scaling, causal, window), None
    return row_by_row(query, key, value, cu_seq_lens, scaling, causal, window, dropout), None


def packed_bounds(query, key, attention_mask, kwargs: dict):
    """(cu_seq_lens over the flattened B*T tokens, longest row) of a packed self-attention batch, else None."""
    import torch

    t = query.shape[2]
    if attention_mask is not None or key.shape[2] != t or t < 2:
        return None
    cu = kwargs.get("cu_seq_lens_q")
    if cu is not None:  # TRL's collator computed them on the CPU (the same for keys: self-attention): no device sync
        longest = kwargs.get("max_length_q")
        return cu, int(longest) if longest is not None else int(cu.diff().max())
    position_ids = kwargs.get("position_ids")
    if position_ids is None:
        return None
    # A row starts where the positions do not go on by one (transformers' find_packed_sequence_indices rule), and
    # at each batch row. Reading the starts syncs with the device: the collator's cu_seq_lens avoid it.
    batch = query.shape[0]
    positions = position_ids.expand(batch, -1)
    starts = torch.ones_like(positions, dtype=torch.bool)
    starts[:, 1:] = positions[:, 1:] - positions[:, :-1] != 1
    first = starts.flatten().nonzero().flatten()
    if first.numel() == batch:  # one sequence per batch row: full rows, plain causal SDPA
        return None
    cu = torch.cat([first, first.new_tensor([batch * t])]).to(torch.int32)
    return cu, int(cu.diff().max())


def row_by_row(query, key, value, cu_seq_lens, scaling, causal: bool, window, dropout: float):
    """The reference: SDPA on each packed row alone (is_causal, no mask; a sliding window masks within the row
    only), the outputs joined back in order. The same arithmetic as the kernel, one launch per row."""
    import torch
    import torch.nn.functional as F

    b, h, t, d = query.shape
    q, k, v = (x.transpose(0, 1).reshape(x.shape[1], b * t, d)[None] for x in (query, key, value))  # (1, H, B*T, D)
    gqa = key.shape[1] != h
    bounds = cu_seq_lens.tolist()
    out = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end == start:
            continue
        mask, row_causal = None, causal
        if window is not None and end - start > window:  # kv within `window` of q (masking_utils' sliding overlay)
            i = torch.arange(end - start, device=query.device)
            mask = i[None, :] > i[:, None] - window
            if causal:
                mask &= i[None, :] <= i[:, None]
            row_causal = False
        out.append(F.scaled_dot_product_attention(
            q[:, :, start:end], k[:, :, start:end], v[:, :, start:end], attn_mask=mask, dropout_p=dropout,
            is_causal=row_causal, scale=scaling, enable_gqa=gqa))
    joined = torch.cat(out, dim=2)  # (1, H, B*T, D)
    return joined[0].reshape(h, b, t, d).permute(1, 2, 0, 3)  # (B, T, H, D)


def varlen_kernel(query, key, value, cu_seq_lens, max_length: int, scaling, causal: bool, window):
    """torch.nn.attention.varlen.varlen_attn over the flattened tokens: (T, H, D) tensors, int32 bounds; causal is
    the window (-1, 0), a sliding window of w tokens (w - 1, 0)."""
    import torch
    from torch.nn.attention.varlen import varlen_attn

    b, h, t, d = query.shape
    dtype = query.dtype
    # The flash kernels take 16-bit inputs only: a float32 query (PEFT keeps some layers in float32) runs in the
    # autocast dtype, else bf16, and comes back as float32 (transformers' flash path does the same)
    half = dtype if dtype in (torch.float16, torch.bfloat16) else (
        torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else torch.bfloat16)
    q, k, v = (x.transpose(1, 2).reshape(b * t, x.shape[1], d).to(half) for x in (query, key, value))
    left = -1 if window is None else window - 1
    out = varlen_attn(q, k, v, cu_seq_lens.to(device=q.device, dtype=torch.int32),
                      cu_seq_lens.to(device=q.device, dtype=torch.int32), max_length, max_length,
                      scale=scaling, window_size=(left, 0) if causal else (left, -1 if window is None else left),
                      enable_gqa=key.shape[1] != h)
    return out.view(b, t, h, d).to(dtype)
