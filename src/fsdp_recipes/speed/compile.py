"""torch.compile of the model (TrainingArguments' `torch_compile`, `torch_compile_backend`, `torch_compile_mode`),
applied by transformers' Trainer. The run report records the backend and mode it ran with.
"""

from __future__ import annotations

FIELDS = ("torch_compile", "torch_compile_backend", "torch_compile_mode")


def enabled(cfg) -> bool:
    return bool(getattr(cfg.training, "torch_compile", False))


def prepare_trainer(trainer, cfg) -> dict:
    return {"backend": getattr(cfg.training, "torch_compile_backend", None),
            "mode": getattr(cfg.training, "torch_compile_mode", None)}
