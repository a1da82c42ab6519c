"""Small helpers for the few collectives the pack runs itself (run report, preemption, checkpoint markers,
the load and resume checks), a free local port for a rendezvous or a server, and who this process is in its job."""

from __future__ import annotations

import contextlib
import os
import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (the OS picks it): torchrun's rendezvous, vLLM's server."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank() -> int:
    """This process's global rank as torchrun set it (RANK); 0 outside a launch. Read from the environment, so it is
    right before the process group exists and costs no import of torch."""
    return int(os.environ.get("RANK", 0))


def slurm_job() -> tuple[str, int] | None:
    """This Slurm job's id and its restart count: `scontrol requeue` runs the same job again, with the same id and
    SLURM_RESTART_COUNT one higher (an interactive allocation's runs share an id at count 0); None outside Slurm."""
    job = os.environ.get("SLURM_JOB_ID")
    return (job, int(os.environ.get("SLURM_RESTART_COUNT") or 0)) if job else None


def initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


_HOST_GROUP = None  # the group for host numbers: see host_group()


def host_group():
    """The process group for the pack's own collectives, which all carry a few host numbers (token counts, peaks,
    flags), never device tensors: a gloo one, so they move CPU tensors over TCP and never wait for the GPU's queue.

    A collective on a device tensor would cost a host-to-device copy and a `.tolist()` that blocks the host until
    every kernel queued before it has run. accelerate's default group already has gloo beside NCCL for FSDP with
    FULL_STATE_DICT or parameter offload (`cuda:nccl,cpu:gloo`) and on CPU; only for a pure NCCL default group is
    a gloo group created, once. Creating it is itself a collective: the first call must come at the same point on
    every rank, which the pack's collectives do (each runs on every rank, in the same order)."""
    global _HOST_GROUP
    import torch.distributed as dist

    if "gloo" in str(dist.get_backend()):
        return None  # the default group takes CPU tensors
    if _HOST_GROUP is None:
        _HOST_GROUP = dist.new_group(backend="gloo")
    return _HOST_GROUP


def _reduce_op(op: str):
    import torch.distributed as dist

    return dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX


def all_reduce(values: list[float], op: str = "sum") -> list[float]:
    """Sum or max a few numbers over ranks; unchanged without a process group. Blocks this host until every rank
    has sent its numbers, but never synchronises with a GPU (host_group)."""
    import torch
    import torch.distributed as dist

    if not initialized():
        return values
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=_reduce_op(op), group=host_group())
    return t.tolist()


class PendingReduce:
    """An all-reduce of host numbers started now and read later (all_reduce_async): the ranks exchange them in the
    background while the next step runs, so reading the result a step later costs no wait."""

    def __init__(self, values: list[float], op: str):
        import torch
        import torch.distributed as dist

        self.tensor = torch.tensor(values, dtype=torch.float64)
        self.work = dist.all_reduce(self.tensor, op=_reduce_op(op), group=host_group(), async_op=True) \
            if initialized() else None

    def result(self) -> list[float]:
        if self.work is not None:
            self.work.wait()  # gloo: the host waits for the exchange (done by now), not for the GPU
            self.work = None
        return self.tensor.tolist()  # a CPU tensor: no device synchronisation


def all_reduce_async(values: list[float], op: str = "sum") -> PendingReduce:
    """Start an all-reduce of a few host numbers; `.result()` waits for it. Every rank must start the same ones in
    the same order, and read each before starting the next on the same values' behalf."""
    return PendingReduce(values, op)


def gather_objects(value) -> list:
    """One picklable value from every rank, in rank order; [value] without a process group."""
    import torch.distributed as dist

    if not initialized():
        return [value]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value, group=host_group())  # pickles through CPU tensors: no GPU round trip
    return out


def barrier() -> None:
    import torch.distributed as dist

    if initialized():
        dist.barrier()


FSDP1_PREFIX = "_fsdp_wrapped_module."  # what FSDP1 inserts into parameter names (torch's FSDP_PREFIX)


def fsdp1_units(model) -> list:
    """The FSDP1 units in `model` (the root included), in the order every rank sees them; [] without FSDP1.

    `fsdp_modules(root_only=True)` is called first for its side effect: it lazily initialises each root, which
    must happen before a nested unit is summoned on its own (else that unit would initialise itself as a root;
    torch 2.13, _runtime_utils._lazy_init). Summoning the root, as a whole-model gather does, did the same."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    FullyShardedDataParallel.fsdp_modules(model, root_only=True)
    return FullyShardedDataParallel.fsdp_modules(model)


def own_parameters(unit, prefix: str = ""):
    """(name, parameter) of what one FSDP1 unit manages itself: the parameters of its subtree minus those of the
    units nested in it. Outside a summon that is the unit's FlatParameter (use_orig_params=False) or its original
    parameters as sharded views (use_orig_params=True); inside, the unsharded original parameters."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    for name, param in unit.named_parameters(recurse=False, prefix=prefix.rstrip(".")):
        yield name, param
    for name, child in unit.named_children():
        if not isinstance(child, FullyShardedDataParallel):
            yield from own_parameters(child, f"{prefix}{name}.")


def _fsdp1_trainable_tensors(model):
    """FSDP1, trainable parameters only: summon one unit at a time, and only a unit that manages a trainable
    parameter.

    Why not `summon_full_params(root)`: that unshards every unit, frozen base included: for a 24B LoRA recipe the
    bf16 model (~47 GB) once more on every GPU, after every resume (estimated, not measured). Under PEFT the Trainer wraps each LoRA leaf as a
    unit of its own (transformers' update_fsdp_plugin_peft installs peft's fsdp_auto_wrap_policy), so this gathers
    the adapter and nothing else. A unit that mixes frozen and trainable weights (a custom wrap policy; the root
    when it keeps a modules_to_save output layer, peft_fsdp.py workaround 3) is still gathered whole, one unit at a
    time. Every rank walks the same units in the same order and decides from requires_grad, which the ranks share,
    so the collectives match. Checked on torch 2.13 (summon_full_params(recurse=False) on a nested unit)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    names = {id(module): name for name, module in model.named_modules()}
    for unit in fsdp1_units(model):
        if not any(p.requires_grad for _, p in own_parameters(unit)):
            continue
        prefix = f"{names[id(unit)]}." if names[id(unit)] else ""
        with FullyShardedDataParallel.summon_full_params(unit, recurse=False, writeback=False):
            for name, param in own_parameters(unit, prefix):
                if param.requires_grad:  # the names summon_full_params(root) gave: without FSDP1's wrapper names
                    yield name.replace(FSDP1_PREFIX, ""), param.data


@contextlib.contextmanager
def gathered_parameters(model, trainable_only: bool = False):
    """(name, full unsharded tensor) of every parameter, or of the trainable ones, as an iterator that every rank
    must run to the end: FSDP2 gathers each DTensor as it comes (`full_tensor()`); FSDP1 gathers its flat shards
    once for the block (`summon_full_params`), or with `trainable_only` only the units that hold a trainable
    parameter, one unit at a time (_fsdp1_trainable_tensors); without FSDP the tensors are the parameters
    themselves. A tensor yielded under FSDP1 is valid until the iterator moves on: copy what you keep. Under FSDP1
    pass the wrapped model (the Trainer's `model`), not accelerate's `unwrap_model` of it, which hides the root
    unit."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.tensor import DTensor

    def tensors():
        for name, param in model.named_parameters():
            if not trainable_only or param.requires_grad:
                yield name, (param.full_tensor() if isinstance(param, DTensor) else param.data)

    if trainable_only and fsdp1_units(model):
        yield _fsdp1_trainable_tensors(model)
    elif isinstance(model, FullyShardedDataParallel):
        with FullyShardedDataParallel.summon_full_params(model, writeback=False):
            yield tensors()
    else:
        yield tensors()
