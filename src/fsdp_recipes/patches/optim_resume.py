"""Restore the optimizer state of an FSDP1 run from a SHARDED_STATE_DICT checkpoint.

Gap this fills (accelerate 1.15, torch 2.13; GPU and CPU alike): accelerate's `load_fsdp_optimizer` builds the
template that `torch.distributed.checkpoint.load` fills in place from `FSDP.optim_state_dict(model, optimizer)`.
On resume that optimizer has not stepped yet, so it has no state: the template holds only the param groups,
DCP loads no `exp_avg`, `exp_avg_sq` or `step`, and training silently goes on with a fresh AdamW. The resumed
run's first step still matches (its loss depends only on the restored weights); the second does not (tiny
FSDP1 LoRA run, 2 -> 2 and 2 -> 4 ranks: step-12 loss off). Found by dumping the loaded optimizer state: 0
of 56 entries. FSDP2 is not affected: its `get_optimizer_state_dict` initialises the state first.

The fix does what torch's `get_optimizer_state_dict` does for FSDP2: one `step()` with zero gradients and a
zero learning rate (`torch.distributed.checkpoint.state_dict._init_optim_state`), so the template has every
entry with its shape; DCP then overwrites all of them. resume_check.py verifies the restored step counts.
"""

from __future__ import annotations

import functools

from fsdp_recipes.patches.guard import record, target
from fsdp_recipes.patches.versions import checked_on

_PATCHED = False


def _needs_state(fsdp_plugin, use_dcp: bool) -> bool:
    from torch.distributed.fsdp import StateDictType

    return fsdp_plugin.fsdp_version == 1 and use_dcp and fsdp_plugin.state_dict_type != StateDictType.FULL_STATE_DICT


def init_state_before_fsdp1_sharded_load() -> None:
    """Patch accelerate's `load_fsdp_optimizer`, where accelerate and transformers look it up."""
    global _PATCHED
    if _PATCHED:
        return
    import accelerate.accelerator
    import accelerate.utils
    import accelerate.utils.fsdp_utils
    import transformers.trainer
    import torch.distributed.checkpoint.state_dict as dcp_state_dict

    versions = checked_on("torch", "accelerate")
    original = target(accelerate.utils.fsdp_utils, "load_fsdp_optimizer",
                      ("fsdp_plugin", "accelerator", "optimizer", "model", "input_dir", "optimizer_index",
                       "adapter_only", "use_dcp"), patch="optim_resume.init_state_before_fsdp1_sharded_load",
                      checked_on=versions)
    _init_optim_state = target(dcp_state_dict, "_init_optim_state", ("optim",),
                               patch="optim_resume.init_state_before_fsdp1_sharded_load", checked_on=versions)

    @functools.wraps(original)
    def load_fsdp_optimizer(fsdp_plugin, accelerator, optimizer, model, input_dir, optimizer_index=0,
                            adapter_only=False, use_dcp=True):
        if _needs_state(fsdp_plugin, use_dcp):
            _init_optim_state(getattr(optimizer, "optimizer", optimizer))  # the torch optimizer inside accelerate's
        return original(fsdp_plugin, accelerator, optimizer, model, input_dir, optimizer_index=optimizer_index,
                        adapter_only=adapter_only, use_dcp=use_dcp)

    for module in (accelerate.utils.fsdp_utils, accelerate.utils, accelerate.accelerator, transformers.trainer):
        if getattr(module, "load_fsdp_optimizer", None) is original:
            module.load_fsdp_optimizer = load_fsdp_optimizer
    record("optim_resume.init_state_before_fsdp1_sharded_load", "accelerate.utils.fsdp_utils.load_fsdp_optimizer",
           "an FSDP1 sharded resume loads no optimizer state")
    _PATCHED = True
