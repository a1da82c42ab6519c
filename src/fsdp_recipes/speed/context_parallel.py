"""Context parallel where torch's ring attention cannot run: the all-to-all form (DeepSpeed-Ulysses) over SDPA.

A recipe whose accelerate YAML names `parallelism_config_cp_size: N` trains each row split over N ranks. accelerate
1.15 and transformers 5.23 do the rest of context parallel themselves: the mesh (FSDP shards over dp_shard x cp),
the data (the N ranks of a cp group get the same batch), the Trainer's CP inputs (shift_labels, global
position_ids, the buffers to split) and the loss (tokens counted on the whole batch over all ranks, divided by cp;
the loss scaled by the world size; gradients averaged over dp_shard x cp). What they leave to torch's
`context_parallel` is the split and the attention, and torch's ring handles SDPA's CUDA kernels only (flash,
efficient, cudnn: not the CPU's), while FlexAttention cannot run backward on a CPU (torch 2.13).

So where there is no CUDA, `use_all_to_all(accelerator)` replaces the context accelerate wraps each step in
(`accelerator._cp_context`, set by `_prepare_cp`) with `all_to_all_context`. What that takes of the libraries'
private code (accelerate's `_prepare_cp` and mask hooks, transformers' "sdpa" entry, torch's split order) is in
patches/context_parallel.py, behind its version guard:

    split: each buffer (input_ids, labels, shift_labels, attention_mask, position_ids) cut along the sequence as
        torch's ring cuts it: torch's head-tail load balancer, so rank r of N holds chunks r and 2N-1-r of 2N (the
        positions stay the global ones: position_ids is split, not regenerated)
    attention: an all-to-all turns [batch, heads, S/N tokens] into [batch, heads/N, S tokens] (the whole row for a
        share of the heads), the gathered tokens are put back in order, SDPA runs causal over the whole row, and the
        reverse all-to-all returns each rank its tokens for every head. The CPU's SDPA kernel and gloo's all-to-all
        suffice; each rank attends over the whole row, so the causal work is balanced by heads anyway.

accelerate's hooks (`_attach_context_parallel_hooks`) already drop the padding mask for `is_causal=True` on each
self_attn, as for the ring: right-padded rows give the same attention on every real token.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from fsdp_recipes.patches import context_parallel as patches

# what a step under all_to_all_context tells the attention: the cp group and the order of the gathered tokens. A
# plain dict, not thread-local: activation checkpointing recomputes the attention in backward, which autograd may run
# on another thread (a device's)
_ACTIVE: dict = {}


def shard_indices(seq_len: int, cp: int) -> torch.Tensor:
    """[cp, seq_len / cp]: the positions of the row each cp rank holds, as torch's ring splits it (its default
    head-tail load balancer when seq_len is a multiple of 2 x cp; contiguous chunks otherwise, as torch does)."""
    if seq_len % cp:
        raise ValueError(f"a row of {seq_len} tokens does not split over {cp} context-parallel ranks")
    order = patches.ring_order(seq_len, cp)  # torch's order is private: patches/context_parallel.py
    return (torch.arange(seq_len) if order is None else order).reshape(cp, seq_len // cp)


def shard(tensor: torch.Tensor, seq_dim: int, rank: int, cp: int) -> torch.Tensor:
    """The part of `tensor` (a whole row's buffer) rank `rank` of `cp` holds."""
    index = shard_indices(tensor.size(seq_dim), cp)[rank].to(tensor.device)
    return tensor.index_select(seq_dim, index)


class _AllToAll(torch.autograd.Function):
    """dist.all_to_all_single over the first dimension (one slice per rank of the group). Its backward is the same
    exchange: the slice rank a sent to rank b is the gradient b sends back to a."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        out = tensor.new_empty(tensor.shape)  # contiguous, whatever the strides of `tensor`
        dist.all_to_all_single(out, tensor.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.new_empty(grad.shape)
        dist.all_to_all_single(out, grad.contiguous(), group=ctx.group)
        return out, None


def tokens_to_heads(x: torch.Tensor, group, cp: int) -> torch.Tensor:
    """[B, H, S/cp, D] on each rank -> [B, H/cp, S, D]: this rank's share of the heads over the whole row, the tokens
    in the order of the ranks that held them."""
    b, h, s, d = x.shape
    sent = x.reshape(b, cp, h // cp, s, d).transpose(0, 1)  # slice j: the heads rank j attends for
    got = _AllToAll.apply(sent, group)  # slice j: rank j's tokens of this rank's heads
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * s, d)


def heads_to_tokens(x: torch.Tensor, group, cp: int) -> torch.Tensor:
    """The inverse of tokens_to_heads: [B, H/cp, S, D] -> [B, H, S/cp, D]."""
    b, hc, seq, d = x.shape
    sent = x.reshape(b, hc, cp, seq // cp, d).permute(2, 0, 1, 3, 4)  # slice j: rank j's tokens
    got = _AllToAll.apply(sent, group)  # slice j: this rank's tokens of rank j's heads
    return got.transpose(0, 1).reshape(b, cp * hc, seq // cp, d)


def all_to_all_attention(module, query, key, value, attention_mask=None, dropout: float = 0.0, scaling=None,
                         **kwargs):
    """A transformers attention function (AttentionInterface's signature: q, k, v [B, heads, tokens, D]; returns
    [B, tokens, heads, D] and no weights) over this rank's tokens of the row, computing attention over the whole
    row. Causal always: context parallel, like accelerate's hooks for the ring, knows causal masks only."""
    group, cp, order, restore = _ACTIVE["group"], _ACTIVE["cp"], _ACTIVE["order"], _ACTIVE["restore"]
    heads, kv_heads = query.size(1), key.size(1)
    if heads % cp:
        raise ValueError(f"context parallel {cp} does not divide the model's {heads} attention heads")
    if kv_heads % cp:  # grouped-query attention with fewer key/value heads than ranks: send each query head its own
        key = key.repeat_interleave(heads // kv_heads, dim=1)
        value = value.repeat_interleave(heads // kv_heads, dim=1)
    q, k, v = (tokens_to_heads(t, group, cp).index_select(2, restore) for t in (query, key, value))
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True, scale=scaling, dropout_p=dropout,
        enable_gqa=k.size(1) != q.size(1))
    out = heads_to_tokens(out.index_select(2, order), group, cp)
    return out.transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def all_to_all_context(mesh, *, buffers=None, buffer_seq_dims=None, no_restore_buffers=None):
    """torch's `context_parallel(mesh, buffers=..., buffer_seq_dims=..., no_restore_buffers=...)` with the all-to-all
    attention for the ring: each buffer is split in place as torch splits it (and put back on exit unless named in
    no_restore_buffers), and SDPA, as transformers' attention functions name it, is the all-to-all form inside."""
    group, cp = mesh.get_group(), mesh.size()
    rank = dist.get_rank(group)
    buffers, seq_dims = list(buffers or []), list(buffer_seq_dims or [])
    keep = no_restore_buffers or set()
    originals = [None if any(b is k for k in keep) else b.clone() for b in buffers]
    seq_len = buffers[0].size(seq_dims[0]) if buffers else None
    for buffer, seq_dim in zip(buffers, seq_dims):
        part = shard(buffer, seq_dim, rank, cp)
        buffer.resize_(part.shape)
        buffer.copy_(part)
    if seq_len is not None:
        order = shard_indices(seq_len, cp).flatten()  # the gathered tokens' positions, rank by rank
        restore = torch.argsort(order)
        device = buffers[0].device
        _ACTIVE.update(group=group, cp=cp, order=order.to(device), restore=restore.to(device))
    try:
        # the Trainer asks for attn_implementation "sdpa" under context parallel (transformers' _prepare_context_
        # parallel_inputs): the model keeps that name, and the name means the all-to-all form while a step runs
        with patches.sdpa_is(all_to_all_attention):
            yield
    finally:
        _ACTIVE.clear()
        for buffer, original in zip(buffers, originals):
            if original is not None:
                buffer.resize_(original.shape)
                buffer.copy_(original)


def ring_available() -> bool:
    """Whether torch's ring can run here: SDPA's CUDA kernels."""
    return torch.cuda.is_available()


def use_all_to_all(accelerator) -> bool:
    """Where the ring cannot run and the accelerator has a cp mesh: each step's context parallel is the all-to-all
    form. accelerate's `_prepare_cp` (called by `prepare` when cp_size > 1) is replaced on this accelerator only
    (patches/context_parallel.py), so that its hooks still go on the model and its cp mesh is the one split over.
    Whether it applied."""
    pc = getattr(accelerator, "parallelism_config", None)
    if pc is None or not pc.cp_enabled or ring_available():
        return False
    patches.step_context_on(
        accelerator, lambda **kw: all_to_all_context(accelerator.torch_device_mesh["cp"], **kw))
    patches.check_step_patches(pc.cp_size)
    return True


def install(trainer) -> str | None:
    """A built trainer's context parallel, before train() prepares it: which form its steps run ("ring": torch's, on
    CUDA; "all-to-all" elsewhere), None without a cp mesh. The token counter stays on every rank: each counts the
    whole batch (the ranks of a cp group get the same one, counted in training_step before the cp context splits
    it), and the run report divides the ranks' sum by tp x cp, as for tensor parallel (metrics/run_report.py)."""
    pc = getattr(trainer.accelerator, "parallelism_config", None)
    if pc is None or not pc.cp_enabled:
        return None
    return "all-to-all" if use_all_to_all(trainer.accelerator) else "ring"
