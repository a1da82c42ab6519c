"""What a GPU ladder (bench/gpu.py) is judged by and called, shared by the ladder and its picture (bench/plot.py)."""

from __future__ import annotations

GOAL_SPEEDUP = 1.5  # the tuned rungs against rung 0's tokens/s per GPU
GOAL_MFU_1B_1GPU = 0.45  # a ~1B full fine-tune on one GPU


def method_of(lad: dict) -> str:
    """A ladder's method; files written before `--methods` existed hold full fine-tuning only."""
    return lad.get("method", "full")


def ladder_title(lad: dict) -> str:
    """'1b full fine-tuning (1,107,363,840 parameters)', '8b LoRA (8,063,455,232 parameters, 43,646,976 trained)'."""
    n = lad["parameters"]
    if method_of(lad) == "full":
        return f"{lad['size']} full fine-tuning ({n['total']:,} parameters)"
    return f"{lad['size']} LoRA ({n['total']:,} parameters, {n['trainable']:,} trained)"
