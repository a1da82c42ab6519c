"""Small helpers for the few collectives the pack runs itself (run report, preemption, checkpoint markers,
the load and resume checks)."""

from __future__ import annotations

import contextlib


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


def gather_objects(value) -> list:
    """One picklable value from every rank, in rank order; [value] without a process group."""
    import torch.distributed as dist

    if not initialized():
        return [value]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def barrier() -> None:
    import torch.distributed as dist

    if initialized():
        dist.barrier()


@contextlib.contextmanager
def gathered_parameters(model, trainable_only: bool = False):
    """(name, full unsharded tensor) of every parameter, as an iterator that every rank must run to the end:
    FSDP2 gathers each DTensor as it comes (`full_tensor()`), FSDP1 gathers its flat shards once for the block
    (`summon_full_params`); without FSDP the tensors are the parameters themselves."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.tensor import DTensor

    def tensors():
        for name, param in model.named_parameters():
            if not trainable_only or param.requires_grad:
                yield name, (param.full_tensor() if isinstance(param, DTensor) else param.data)

    if isinstance(model, FullyShardedDataParallel):
        with FullyShardedDataParallel.summon_full_params(model, writeback=False):
            yield tensors()
    else:
        yield tensors()
