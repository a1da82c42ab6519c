"""The CUDA kernel behind `attn_implementation: packed_varlen` (src/fsdp_recipes/speed/varlen_attention.py) on one
GPU, in seconds: what tests/test_attention.py cannot check on a CPU.

    python -m bench.varlen_check --out DIR          # on the GPU machine (torch only: no transformers or TRL needed)
    python -m bench.varlen_check --dry-run          # on CPU: tiny shapes, the reference against itself, the two
                                                    # SDPA timings (plumbing only)

Llama-3-8B's attention shape (32 query heads, 8 key/value heads, head dim 128) over 8,192 packed tokens in bf16,
rows of unequal length (1,000 + 3,096 + 2,048 + 2,048, as packing leaves them), one layer's attention alone:

1. agreement: `varlen_kernel` (torch.nn.attention.varlen) against the reference the CPU path runs (`row_by_row`:
   SDPA with is_causal on each row), forward output and the gradients of q, k, v, both against a float32 reference;
   passes when the kernel's largest error is within 2x the bf16 reference's own, plus 1e-3.
2. time, forward and backward, median of 10 after 3 warm-up: the kernel; the SDPA transformers runs for packed rows
   with `sdpa` (a boolean block-diagonal mask over all 8,192 tokens); SDPA with is_causal on 2 full rows of 4,096
   (the full-rows path: the same tokens, no mask).

Writes varlen-check-<device>-<UTC time>.json into --out (and prints it); exit 1 when the agreement fails.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from fsdp_recipes.api import torch_varlen_available, varlen_kernel, varlen_row_by_row

ROWS, HEADS, KV_HEADS, HEAD_DIM = (1000, 3096, 2048, 2048), 32, 8, 128  # Llama-3-8B's attention, 2 x 4096 tokens
DRY = dict(rows=(5, 11, 8), heads=4, kv_heads=2, head_dim=16)  # an even token count: 2 "full rows" of 12


def tensors(rows, heads, kv_heads, head_dim, device, dtype):
    import torch

    g = torch.Generator(device="cpu").manual_seed(0)
    t = sum(rows)
    make = lambda h: (torch.randn(1, h, t, head_dim, generator=g) * 0.5).to(device, dtype)  # noqa: E731
    q, k, v = make(heads), make(kv_heads), make(kv_heads)
    cu = torch.tensor([0, *torch.tensor(rows).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return q, k, v, cu


def forward_backward(fn, q, k, v, grad):
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = fn(q, k, v)
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


def agreement(rows, heads, kv_heads, head_dim, device, kernel: bool) -> dict:
    """Each of output, dq, dk, dv: the largest error against float32, of the kernel (or, without one, of the
    reference run again) and of the bf16 reference."""
    import torch

    scale = head_dim ** -0.5
    q, k, v, cu = tensors(rows, heads, kv_heads, head_dim, device, torch.bfloat16)
    grad = torch.randn(1, sum(rows), heads, head_dim, generator=torch.Generator().manual_seed(1)).to(device)
    reference = lambda q, k, v: varlen_row_by_row(q, k, v, cu, scale, True, None, 0.0)  # noqa: E731
    under_test = (lambda q, k, v: varlen_kernel(q, k, v, cu, max(rows), scale, True, None)) \
        if kernel else reference
    exact = forward_backward(reference, *(x.float() for x in (q, k, v)), grad.float())
    bf16 = forward_backward(reference, q, k, v, grad.to(torch.bfloat16))
    tested = forward_backward(under_test, q, k, v, grad.to(torch.bfloat16))
    parts = {}
    for name, e, r, t in zip(("out", "dq", "dk", "dv"), exact, bf16, tested):
        err_ref, err = (r.float() - e).abs().max().item(), (t.float() - e).abs().max().item()
        parts[name] = {"kernel_err": err, "bf16_reference_err": err_ref, "ok": err <= 2 * err_ref + 1e-3}
    return parts


def timings(rows, heads, kv_heads, head_dim, device, kernel: bool) -> dict:
    """Median milliseconds of forward + backward per path (the kernel's where there is one)."""
    import torch
    import torch.nn.functional as F

    scale, t = head_dim ** -0.5, sum(rows)
    q, k, v, cu = tensors(rows, heads, kv_heads, head_dim, device, torch.bfloat16)
    grad = torch.randn(1, t, heads, head_dim, device=device, dtype=torch.bfloat16)
    doc = torch.repeat_interleave(torch.arange(len(rows), device=device), torch.tensor(rows, device=device))
    i = torch.arange(t, device=device)
    block_mask = (doc[:, None] == doc[None, :]) & (i[None, :] <= i[:, None])  # what transformers builds for sdpa

    def masked(q, k, v):  # as transformers' sdpa_attention_forward runs a mask on CUDA: key/value heads repeated
        k, v = (x.repeat_interleave(heads // kv_heads, dim=1) for x in (k, v))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=block_mask[None, None], scale=scale).transpose(1, 2)

    def full_rows(q, k, v):  # the same tokens as 2 full rows of t/2: is_causal, no mask
        rows2 = [x.view(x.shape[1], 2, t // 2, head_dim).transpose(0, 1) for x in (q, k, v)]
        out = F.scaled_dot_product_attention(*rows2, is_causal=True, scale=scale, enable_gqa=True)
        return out.transpose(0, 1).reshape(1, heads, t, head_dim).transpose(1, 2)

    paths = {"sdpa, block-diagonal mask": masked, "sdpa is_causal, 2 full rows": full_rows}
    if kernel:
        paths["packed_varlen kernel"] = lambda q, k, v: varlen_kernel(q, k, v, cu, max(rows), scale,
                                                                                       True, None)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    result = {}
    for name, fn in paths.items():
        times = []
        for n in range(13):
            sync()
            start = time.perf_counter()
            forward_backward(fn, q, k, v, grad)
            sync()
            if n >= 3:
                times.append((time.perf_counter() - start) * 1e3)
        result[name] = round(statistics.median(times), 3)
    return result


def main(argv: list[str] | None = None) -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="folder for the JSON")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes: the reference against itself")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.dry_run
    shape = dict(rows=ROWS, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM) if cuda else DRY
    kernel = cuda and torch_varlen_available()
    device = "cuda" if cuda else "cpu"
    record = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
              "shape": shape, "kernel": "torch.nn.attention.varlen" if kernel else "none (reference against itself)",
              "agreement": agreement(device=device, kernel=kernel, **shape)}
    record["ms_forward_backward"] = timings(device=device, kernel=kernel, **shape)
    record["ok"] = all(part["ok"] for part in record["agreement"].values())
    text = json.dumps(record, indent=1)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        stamp = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H%MZ")
        name = record["device"].lower().replace(" ", "-")
        (args.out / f"varlen-check-{name}-{stamp}.json").write_text(text + "\n")
    return 0 if record["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
