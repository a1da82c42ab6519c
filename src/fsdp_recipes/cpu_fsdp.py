"""Run accelerate's real FSDP path on CPU processes over gloo.

Gap this fills: accelerate (1.15) enables FSDP only for accelerator devices. On a machine without one, an
FSDP config launched with `accelerate launch` silently becomes unsharded single-process training (or, with
`use_cpu`, plain multi-process data parallel) -- not what the recipe says. PyTorch's `fully_shard` (FSDP2)
works on CPU tensors over gloo, so the only missing piece is accelerate's own decision. This adapter:

1. sets ACCELERATE_USE_CPU so PartialState/TrainingArguments initialise a gloo process group on CPU, and
2. wraps `AcceleratorState.__init__` so that, when an FSDP plugin was given (from the launcher's
   ACCELERATE_USE_FSDP environment or explicitly) and the state came up as MULTI_CPU, the distributed type
   becomes FSDP with that plugin -- exactly what accelerate does for MULTI_GPU in the same place.

From there on everything is accelerate's and transformers' unmodified FSDP code: `fsdp2_prepare_model`,
`fully_shard` per decoder layer, FSDP-aware saving. Only FSDP2 is supported on CPU (FSDP1 needs CUDA
streams); FSDP1 recipes stop with a clear error on CPU. Nothing here runs when a GPU is present.
"""

from __future__ import annotations

import functools
import os

_PATCHED = False


def fsdp_requested() -> bool:
    """True inside a process started by `accelerate launch` with an FSDP config."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" and "LOCAL_RANK" in os.environ


def needed() -> bool:
    import torch

    return fsdp_requested() and not torch.cuda.is_available()


def fsdp_version_from_env() -> int:
    return int(os.environ.get("FSDP_VERSION", "1"))


def enable() -> bool:
    """Install the adapter when FSDP is requested on a CPU-only machine. Returns whether it is active."""
    global _PATCHED
    if not needed():
        return False
    from fsdp_recipes.config_check import check_fsdp_runs_on_cpu

    check_fsdp_runs_on_cpu(fsdp_version_from_env(), "the accelerate config (FSDP_VERSION)")
    os.environ["ACCELERATE_USE_CPU"] = "true"
    if _PATCHED:
        return True

    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    original_init = AcceleratorState.__init__

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

    AcceleratorState.__init__ = init_with_cpu_fsdp
    _PATCHED = True
    return True
