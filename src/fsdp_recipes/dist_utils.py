"""Small helpers for the few collectives the pack runs itself (run report, preemption, checkpoint markers)."""

from __future__ import annotations


def initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def collective_device():
    """Where a tensor for a collective must live: gloo takes CPU tensors, NCCL needs the rank's GPU."""
    import torch
    import torch.distributed as dist

    if "gloo" in str(dist.get_backend()):
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def all_reduce(values: list[float], op: str = "sum") -> list[float]:
    """Sum or max a few numbers over ranks; unchanged without a process group."""
    import torch
    import torch.distributed as dist

    if not initialized():
        return values
    t = torch.tensor(values, dtype=torch.float64, device=collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return t.tolist()


def barrier() -> None:
    import torch.distributed as dist

    if initialized():
        dist.barrier()
