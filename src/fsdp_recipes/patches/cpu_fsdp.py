"""Run accelerate's real FSDP path on CPU processes over gloo.

Gap this fills: accelerate (1.15) enables FSDP only for accelerator devices. On a machine without one, an
FSDP config launched with `accelerate launch` silently becomes unsharded single-process training (or, with
`use_cpu`, plain multi-process data parallel) -- not what the recipe says. PyTorch's `fully_shard` (FSDP2)
works on CPU tensors over gloo, so the only missing piece is accelerate's own decision. This adapter:

1. sets ACCELERATE_USE_CPU so PartialState/TrainingArguments initialise a gloo process group on CPU, and
2. wraps `AcceleratorState.__init__` so that, when an FSDP plugin was given (from the launcher's
   ACCELERATE_USE_FSDP environment or explicitly) and the state came up as MULTI_CPU, the distributed type
   becomes FSDP with that plugin -- exactly what accelerate does for MULTI_GPU in the same place.

3. for FSDP1 with sync_module_states (which cpu_ram_efficient_loading forces), completes
   `FullyShardedDataParallelPlugin.__post_init__`: its last step looks up an accelerator device for the
   `param_init_fn` that materialises the meta-device weights of ranks > 0, and raises when there is none.
   On CPU that function is `to_empty(device="cpu")`, which torch's FSDP1 accepts with `device_id=cpu`;
   and lifts FSDP1's refusal to broadcast CPU tensors for sync_module_states (a guard against NCCL, which
   cannot; gloo, the CPU backend, can); and makes FSDP1's move of a gathered full parameter to the CPU a
   copy, as it is from a GPU: on CPU `.to("cpu")` returned the very storage FSDP then frees, and the
   process segfaulted; and likewise for FSDP1's gathered optimizer states: torch 2.13 gathers every
   state of a flat parameter into one reused buffer and keeps a copy through `.cpu()` when offloading, which
   on CPU is that buffer, so every checkpoint held exp_avg == exp_avg_sq (found by dumping AdamW's state
   before the first resumed step: step 12 of a resumed tiny run gave 3.045 instead of 3.016). There the
   patch passes `cpu_offload=False`, so torch clones instead: the same values a GPU's `.cpu()` copy gives.

From there on everything is accelerate's and transformers' unmodified FSDP code: `fsdp2_prepare_model` and
`fully_shard` per decoder layer (FSDP2), `FullyShardedDataParallel` with `device_id=cpu` (FSDP1), FSDP-aware
saving. Nothing here runs when any accelerator (CUDA, XPU, NPU, MPS) is present.
"""

from __future__ import annotations

import functools
import os

from fsdp_recipes.patches.guard import record, target
from fsdp_recipes.patches.versions import checked_on

_PATCHED = False


def fsdp_requested() -> bool:
    """True inside a process started by `accelerate launch` with an FSDP config."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" and "LOCAL_RANK" in os.environ


def needed() -> bool:
    """FSDP asked for on a machine with no accelerator at all. Not `not torch.cuda.is_available()`: on an XPU, NPU
    or MPS machine that would force CPU training instead of using the device accelerate supports there."""
    import torch

    return fsdp_requested() and not torch.accelerator.is_available()


def fsdp_version_from_env() -> int:
    return int(os.environ.get("FSDP_VERSION", "1"))


# the torch and accelerate releases these patches were checked on (versions.py, one table for every patch)
CHECKED_ON = checked_on("torch", "accelerate")


def enable() -> bool:
    """Install the adapter when FSDP is requested on a CPU-only machine. Returns whether it is active."""
    global _PATCHED
    if not needed():
        return False
    os.environ["ACCELERATE_USE_CPU"] = "true"
    if _PATCHED:
        return True
    fsdp_state_on_cpu()
    fsdp1_param_init_on_cpu()
    fsdp1_sync_module_states_over_gloo()
    fsdp1_offload_moves_copy_on_cpu()
    fsdp1_optimizer_states_without_offload()
    _PATCHED = True
    return True


def fsdp_state_on_cpu() -> None:
    """Point 2 above: a MULTI_CPU state given an FSDP plugin becomes FSDP, as accelerate does for MULTI_GPU."""
    import torch
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    original_init = target(AcceleratorState, "__init__", (
        "self", "mixed_precision", "cpu", "dynamo_plugin", "deepspeed_plugin", "fsdp_plugin", "torch_tp_plugin",
        "megatron_lm_plugin", "parallelism_config", "_from_accelerator", "kwargs"),
        patch="cpu_fsdp.fsdp_state_on_cpu", checked_on=CHECKED_ON)

    @functools.wraps(original_init)
    def init_with_cpu_fsdp(self, *args, fsdp_plugin=None, **kwargs):
        original_init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            if self._mixed_precision != "no":
                fsdp_plugin.set_mixed_precision(self._mixed_precision)
            self.fsdp_plugin = fsdp_plugin
            # accelerate mirrors the type into PartialState; later AcceleratorState() calls copy it back.
            PartialState._shared_state["distributed_type"] = self.distributed_type
            if fsdp_plugin.fsdp_version == 1:
                # MULTI_CPU names the device "cpu:0"; FSDP1 computes on "cpu" and rejects a device_id that differs.
                self.device = PartialState._shared_state["device"] = torch.device("cpu")

    AcceleratorState.__init__ = init_with_cpu_fsdp
    record("cpu_fsdp.fsdp_state_on_cpu", "accelerate.state.AcceleratorState.__init__",
           "accelerate enables FSDP for accelerator devices only")


def fsdp1_param_init_on_cpu() -> None:
    """Point 3: the sync_module_states device lookup raises without an accelerator; finish it for CPU."""
    import torch
    from accelerate.utils import FullyShardedDataParallelPlugin

    original_post_init = target(FullyShardedDataParallelPlugin, "__post_init__", ("self",),
                                patch="cpu_fsdp.fsdp1_param_init_on_cpu", checked_on=CHECKED_ON)

    @functools.wraps(original_post_init)
    def post_init_on_cpu(self):
        try:
            original_post_init(self)
        except RuntimeError as err:
            # Raised by the device lookup for sync_module_states, the last step that matters on torch >= 2.7;
            # every field has been resolved by then. Finish it the way accelerate does for a GPU.
            if not (self.sync_module_states and "no available devices" in str(err)):
                raise
            self.param_init_fn = lambda module: module.to_empty(device=torch.device("cpu"), recurse=False)

    FullyShardedDataParallelPlugin.__post_init__ = post_init_on_cpu
    record("cpu_fsdp.fsdp1_param_init_on_cpu", "accelerate.utils.FullyShardedDataParallelPlugin.__post_init__",
           "sync_module_states looks up an accelerator device for param_init_fn")


def fsdp1_sync_module_states_over_gloo() -> None:
    """Point 3: FSDP1 refuses to broadcast CPU tensors (a guard against NCCL, which cannot; gloo can)."""
    from torch.distributed.fsdp import _init_utils

    target(_init_utils, "_check_module_states_for_sync_module_states", ("module_states",),
           patch="cpu_fsdp.fsdp1_sync_module_states_over_gloo", checked_on=CHECKED_ON)
    _init_utils._check_module_states_for_sync_module_states = lambda module_states: None
    record("cpu_fsdp.fsdp1_sync_module_states_over_gloo",
           "torch.distributed.fsdp._init_utils._check_module_states_for_sync_module_states",
           "FSDP1 refuses CPU tensors for sync_module_states")


def fsdp1_offload_moves_copy_on_cpu() -> None:
    """Point 3: FSDP1 gathers a full state dict with `offload_to_cpu` (accelerate always asks for it) by moving the
    unsharded flat parameter to the CPU and then freeing the unsharded storage (`FlatParamHandle.to_cpu`). On a GPU
    the move makes new host memory; on CPU `.to("cpu")` returns the very storage FSDP then frees, and the process
    segfaults. Making the move a copy, as it is on a GPU, lets torch's own offload branch run unchanged on CPU.

    Every other caller of `flat_param_to` moves between different devices (parameter CPU offload), where `.to()`
    copies anyway; so `copy=True` changes nothing else. (Before, this patch turned `offload_to_cpu` off, and CPU
    runs took a branch of torch that no GPU run takes.)"""
    from torch.distributed.fsdp._flat_param import FlatParamHandle

    move = target(FlatParamHandle, "flat_param_to", ("self", "args", "kwargs"),
                  patch="cpu_fsdp.fsdp1_offload_moves_copy_on_cpu", checked_on=CHECKED_ON)

    @functools.wraps(move)
    def move_as_a_copy(self, *args, **kwargs):
        return move(self, *args, **{**kwargs, "copy": True})

    FlatParamHandle.flat_param_to = move_as_a_copy
    record("cpu_fsdp.fsdp1_offload_moves_copy_on_cpu", "torch.distributed.fsdp._flat_param.FlatParamHandle.flat_param_to",
           "FSDP1's offload to CPU frees the storage it moved; on CPU the move is no copy (segfault)")


def fsdp1_optimizer_states_without_offload() -> None:
    """Point 3: on CPU every gathered optimizer state aliased one reused buffer (exp_avg == exp_avg_sq)."""
    from torch.distributed.fsdp import _optim_utils

    unflatten = target(_optim_utils, "_unflatten_orig_param_states",
                       ("fsdp_param_info", "output_states", "state_name", "shard_state", "to_save", "cpu_offload"),
                       patch="cpu_fsdp.fsdp1_optimizer_states_without_offload", checked_on=CHECKED_ON)

    def unflatten_with_copies(fsdp_param_info, output_states, state_name, shard_state, to_save, cpu_offload):
        return unflatten(fsdp_param_info, output_states, state_name, shard_state, to_save, False)  # clones

    _optim_utils._unflatten_orig_param_states = unflatten_with_copies
    record("cpu_fsdp.fsdp1_optimizer_states_without_offload",
           "torch.distributed.fsdp._optim_utils._unflatten_orig_param_states",
           "offloaded optimizer states alias one reused buffer on CPU")
