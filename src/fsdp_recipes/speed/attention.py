"""`attn_implementation` (TRL's ModelConfig): the attention kernel transformers runs, passed to from_pretrained.

Today the recipe's choice as written: sdpa (torch's fused kernels), eager, or a flash-attention build that must be
installed. What the pack checks: a flash-attention choice without its package is one line before any rank starts, and
`make smoke` on a machine without CUDA or the package runs sdpa instead.
"""

from __future__ import annotations

import importlib.util

from fsdp_recipes.errors import UserError

FIELDS = ("attn_implementation",)


def enabled(cfg) -> bool:
    return bool(cfg.model.attn_implementation)


def check_installed(cfg) -> None:
    attn = cfg.model.attn_implementation
    if attn and attn.startswith("flash_attention") and importlib.util.find_spec("flash_attn") is None:
        raise UserError(
            f"attn_implementation: {attn} needs the flash-attn package, which is not installed. "
            "Fix: `pip install -e .[gpu]` on a CUDA machine, or use attn_implementation: sdpa."
        )


def smoke(field, gpus: int) -> tuple[list[str], str | None]:
    flash = str(field("attn_implementation", "")).startswith("flash_attention")
    if flash and not (gpus and importlib.util.find_spec("flash_attn")):
        return ["--attn_implementation", "sdpa"], "attention: flash-attn needs CUDA and the flash_attn package -> sdpa"
    return [], None


def model_init_kwargs(cfg) -> dict:
    """The recipe's kernel; none named, transformers' default (and whatever model_init_kwargs says)."""
    attn = cfg.model.attn_implementation
    return {"attn_implementation": attn} if attn else {}
