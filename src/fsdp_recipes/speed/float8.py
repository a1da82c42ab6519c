"""`float8: true` in a recipe's sft.yaml: torchao float8 training of the decoder's linear layers.

Their matmuls (forward, input gradient, weight gradient) run in float8 with tensorwise dynamic scaling, torchao's
default recipe and the one torchtitan's published float8 figures use; weights, gradients and optimizer states keep
their dtypes, so checkpoints and the final model are the same files as without it.

Gap this fills: accelerate has an fp8 path (`mixed_precision: fp8` with torchao), but a Trainer never reaches it:
TrainingArguments' `bf16: true` (TRL's default) overwrites accelerate's mixed precision with bf16; and accelerate's
default torchao config leaves `pad_inner_dim` off, so with padding-free packing (any number of tokens per batch)
the weight gradient's matmul, which runs over the token count, would fail in the first backward on a GPU: CUDA's
torch._scaled_mm needs that dimension to be a multiple of 16 (CPU's reference matmul takes any).

Where it pays: NVIDIA GPUs of compute capability 8.9 or newer (H100, H200, L4, L40S). On CPU torch has a reference
float8 matmul, so the CPU smoke test runs this same path (no faster). Full fine-tuning only: under LoRA the base
layers sit frozen inside PEFT's wrappers and the adapters' rank-r matmuls are too small to gain; the pack has not
measured that combination, so it refuses it rather than guess.
"""

from __future__ import annotations

import importlib.util

from fsdp_recipes.config import hardware
from fsdp_recipes.config.argv import as_bool
from fsdp_recipes.errors import UserError

MIN_CAPABILITY = (8, 9)  # float8 tensor cores: Ada and Hopper (torch._scaled_mm refuses older GPUs)
FIELDS = ("float8",)  # its own setting (config/option_registry.py Float8Arguments)


def enabled(cfg) -> bool:
    return bool(cfg.option("float8").float8)


def check_config(cfg) -> None:
    """What can be checked without a device or a GPU query: in the launcher before any process starts, and again in
    each rank."""
    if not enabled(cfg):
        return
    if cfg.model.use_peft:
        raise UserError("float8: true is for full fine-tuning, and this recipe trains LoRA adapters (use_peft: true). "
                        "Fix: set float8: false, or use_peft: false.")


def check_installed(cfg) -> None:
    if enabled(cfg) and importlib.util.find_spec("torchao") is None:
        raise UserError("float8: true needs torchao, which is not installed. "
                        "Fix: `pip install -e .[gpu]` (or `pip install torchao`), or set float8: false.")


def check_launch(cfg, acc: dict, path) -> None:
    """In the launcher only, before any rank starts: the GPUs' capability from nvidia-smi (no torch import). The
    ranks check again with torch (check_device), so they need not run nvidia-smi each."""
    if not enabled(cfg):
        return
    old = [c for c in hardware.gpu_capabilities() or [] if c < MIN_CAPABILITY]
    if old:
        raise UserError(f"float8: true needs NVIDIA GPUs of compute capability 8.9 or newer (H100, H200, L4, L40S); "
                        f"nvidia-smi reports {old[0][0]}.{old[0][1]} here. Fix: set float8: false, or run on such GPUs.")


def check_device() -> None:
    """In each rank, once torch knows the device: float8 matmuls need compute capability 8.9+ on CUDA."""
    import torch

    if torch.cuda.is_available():
        cap = torch.cuda.get_device_capability()
        if cap < MIN_CAPABILITY:
            raise UserError(f"float8: true needs an NVIDIA GPU of compute capability 8.9 or newer (H100, H200, L4, "
                            f"L40S); this {torch.cuda.get_device_name()} has {cap[0]}.{cap[1]}. Fix: set float8: false.")


def smoke(field, gpus: int) -> tuple[list[str], str | None]:
    """float8 itself runs on CPU (torch's reference float8 matmul) when torchao is there: then it is kept."""
    if as_bool("float8", field("float8", False)) and importlib.util.find_spec("torchao") is None:
        return ["--float8", "false"], "float8: torchao is not installed here -> off (pip install torchao to " \
                                      "smoke-test that path too)"
    return [], None


def prepare_trainer(trainer, cfg) -> dict:
    """Before train() hands the model to accelerate, which wraps it with FSDP: the run report's record."""
    check_device()
    converted, linears = convert(trainer.model)
    trainer.accelerator.print(f"[train] float8: {converted} of {linears} linear layers converted "
                              f"(the LM head and layers with a dimension not a multiple of 16 are not)")
    return {"converted": converted, "linear": linears}


def convertible(module, fqn: str) -> bool:
    """Linear layers whose dimensions torch._scaled_mm takes (multiples of 16), except the LM head: TRL's fused LM
    head reads `lm_head.weight` and never calls its forward, so a converted head would compute nothing in float8
    (torchtitan leaves the output layer in bf16 too)."""
    import torch

    return (isinstance(module, torch.nn.Linear) and fqn.split(".")[-1] != "lm_head"
            and module.in_features % 16 == 0 and module.out_features % 16 == 0)


def convert(model) -> tuple[int, int]:
    """Swap the convertible nn.Linear layers for torchao's Float8Linear, in place, before accelerate wraps the model
    (FSDP then shards the same parameters). Returns (converted, linear layers in all)."""
    import torch
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    # pad_inner_dim: see the module docstring (token counts of packed batches are not multiples of 16)
    convert_to_float8_training(model, config=Float8LinearConfig(pad_inner_dim=True), module_filter_fn=convertible)
    from torchao.float8.float8_linear import Float8Linear

    return sum(isinstance(m, Float8Linear) for m in model.modules()), linears
