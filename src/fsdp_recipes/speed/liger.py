"""Liger's fused Triton kernels (TrainingArguments' `use_liger_kernel`, `liger_kernel_config`): RMSNorm, RoPE,
SwiGLU and the fused linear cross-entropy, patched into the model by transformers' Trainer. Triton kernels: CUDA
only. What the pack adds: the missing package is one line before any rank starts, and `make smoke` on a machine
without GPUs turns it off and says so.
"""

from __future__ import annotations

import importlib.util

from fsdp_recipes.config.argv import as_bool
from fsdp_recipes.errors import UserError

FIELDS = ("use_liger_kernel", "liger_kernel_config")


def enabled(cfg) -> bool:
    return bool(getattr(cfg.training, "use_liger_kernel", False))


def check_installed(cfg) -> None:
    if enabled(cfg) and importlib.util.find_spec("liger_kernel") is None:
        raise UserError("use_liger_kernel: true needs the liger-kernel package, which is not installed. "
                        "Fix: pip install liger-kernel (CUDA machines), or set use_liger_kernel: false.")


def smoke(field, gpus: int) -> tuple[list[str], str | None]:
    on = as_bool("use_liger_kernel", field("use_liger_kernel", False))
    if on and not (gpus and importlib.util.find_spec("liger_kernel")):
        return ["--use_liger_kernel", "false"], "liger: its Triton kernels need CUDA and liger-kernel -> off"
    return [], None


def prepare_trainer(trainer, cfg) -> dict:
    return {"config": getattr(cfg.training, "liger_kernel_config", None)}
