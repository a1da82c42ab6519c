"""Two gaps between transformers 5.23's tensor parallel (`from_pretrained(distributed_config=...)`, DTensor
parameters) and the libraries around it, found training the tiny Mistral with tp 2 and tp 2 x dp_shard 2 on CPU
over gloo (train/tensor_parallel.py; docs/training.md, "Tensor parallel").

1. LoRA widths (peft 0.21). PEFT sizes a LoRA layer on a DTensor-sharded Linear to the weight's *local* shard
   whenever the mesh has a dimension other than "fsdp" (`tuners_utils._get_in_out_features`), as the older TP API
   computed on local tensors. transformers 5.23 computes a training forward on DTensors with global shapes, and
   its RowwiseParallel builds the input DTensor from `module.in_features` taken as the global width. So a rowwise
   layer's lora_A (o_proj, down_proj) failed its first forward: "shape '[128, 64]' is invalid for input of size
   16384" (tp 2); under tp x dp_shard the local shard is split by both dimensions and every colwise lora_B failed
   too. Sized to the global widths, PEFT's own TP code (`add_lora_tp_hooks_dtensor`) shards the adapter as the base
   layer is sharded, and the loss and every adapter gradient equal a one-process run's (tests/test_tensor_parallel.py).

2. accelerate's ParallelismConfig on CPU (accelerate 1.15). `_validate_accelerator` accepts a mesh under FSDP2,
   DeepSpeed or a multi-*device* state only; a CPU job's state is MULTI_CPU, so the transformers-sharded model's
   mesh (tp x dp_shard, which the Trainer hands accelerate) is refused there, though nothing else differs: the
   gloo process group and DTensors run on CPU. The patch validates a MULTI_CPU state as a multi-device one, on a
   machine without an accelerator only (like cpu_fsdp.py, the pack's other CPU adapter).

3. The Trainer's resume of a model sharded at load time (transformers 5.23). `Trainer._load_from_checkpoint` copies
   the checkpoint's full tensors into the DTensor parameters, which fails on each ("aten.copy_.default got mixed
   torch.Tensor and DTensor"). On a tp run's trainer (that instance only) it records the checkpoint's path instead,
   and the pack loads its own sharded state at train begin (checkpoint/tensor_parallel_state.py).
"""

from __future__ import annotations

import functools

from fsdp_recipes.patches.guard import record, target
from fsdp_recipes.patches.versions import checked_on

_PATCHED: set[str] = set()


def lora_widths_of_tensor_parallel_linears() -> None:
    """Point 1: a LoRA layer on a DTensor-sharded nn.Linear gets the module's global widths."""
    import torch
    from peft.tuners.lora.layer import LoraLayer
    from torch.distributed.tensor import DTensor

    if "lora_widths" in _PATCHED:
        return
    original = target(LoraLayer, "_get_in_out_features", ("self", "module"),
                      patch="tensor_parallel.lora_widths_of_tensor_parallel_linears",
                      checked_on=checked_on("peft", "transformers"))

    @functools.wraps(original)
    def global_widths(self, module):
        if isinstance(module, torch.nn.Linear) and isinstance(module.weight, DTensor):
            return module.in_features, module.out_features  # nn.Linear keeps the global widths under TP and FSDP2
        return original(self, module)

    LoraLayer._get_in_out_features = global_widths
    _PATCHED.add("lora_widths")
    record("tensor_parallel.lora_widths_of_tensor_parallel_linears",
           "peft.tuners.lora.layer.LoraLayer._get_in_out_features",
           "PEFT sizes LoRA on a tensor-parallel Linear to its local shard; transformers computes with global widths")


class _AsMultiDevice:
    """The Accelerator as `_validate_accelerator` reads it, with a MULTI_CPU state counted as multi-device."""

    def __init__(self, accelerator):
        self._accelerator = accelerator

    multi_device = True

    def __getattr__(self, name):
        return getattr(self._accelerator, name)


def parallelism_config_on_cpu() -> None:
    """Point 2: a MULTI_CPU state passes ParallelismConfig's validation as a multi-GPU one does."""
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DistributedType

    if "cpu_validation" in _PATCHED:
        return
    original = target(ParallelismConfig, "_validate_accelerator", ("self", "accelerator"),
                      patch="tensor_parallel.parallelism_config_on_cpu", checked_on=checked_on("accelerate"))

    @functools.wraps(original)
    def validate(self, accelerator):
        if accelerator.distributed_type == DistributedType.MULTI_CPU:
            return original(self, _AsMultiDevice(accelerator))
        return original(self, accelerator)

    ParallelismConfig._validate_accelerator = validate
    _PATCHED.add("cpu_validation")
    record("tensor_parallel.parallelism_config_on_cpu", "accelerate.ParallelismConfig._validate_accelerator",
           "accelerate validates a mesh on accelerator devices only")


def resume_through(trainer, remember) -> None:
    """Point 3: `trainer`'s own weight load at resume hands the checkpoint's path to `remember` instead."""
    patch = "tensor_parallel.resume_through_the_packs_state"
    target(type(trainer), "_load_from_checkpoint", ("self", "resume_from_checkpoint", "model"), patch=patch,
           checked_on=checked_on("transformers"))

    def load_at_train_begin(resume_from_checkpoint, model=None):
        remember(resume_from_checkpoint)

    trainer._load_from_checkpoint = load_at_train_begin
    record(patch, "transformers.Trainer._load_from_checkpoint (a tp run's trainer)",
           "transformers copies a checkpoint's full tensors into DTensor parameters, which fails; the pack loads "
           "its sharded state instead")
