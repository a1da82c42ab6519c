"""Final saves that never hold the whole model on one rank (SHARDED_STATE_DICT runs).

Gap this fills: the Trainer's final save under FSDP gathers the full state dict on rank 0 (FULL_STATE_DICT), and
under SHARDED_STATE_DICT it writes no final model at all. For a large model the gather can exhaust rank 0's host
memory. Here:

- full fine-tuning: every rank writes its own shards through torch.distributed.checkpoint's
  `HuggingFaceStorageWriter`, which then consolidates them into ordinary Hugging Face safetensors files by
  memory-mapping, tensor by tensor; rank 0 adds config and tokenizer. Each rank then checks its own shard of every
  parameter against the matching slice of the written files, so the check gathers nothing either.
- LoRA: only the trainable tensors are gathered (the adapter, megabytes), one parameter at a time.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from transformers import TrainerCallback

from fsdp_recipes.checkpoint.save_check import LIVE_SHARDS, IncompleteSave, shard_mismatches
from fsdp_recipes.dist import all_reduce, gathered_parameters


def save_full_model_distributed(trainer, output_dir: str) -> dict:
    """Full fine-tuning: distributed write + per-rank verification. A collective: every rank calls it."""
    import torch.distributed.checkpoint as dcp

    model = trainer.accelerator.unwrap_model(trainer.model)
    state = {k: v for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    out = Path(output_dir)
    dcp.save(state, storage_writer=dcp.HuggingFaceStorageWriter(
        path=str(out), save_distributed=True, enable_consolidation=True))
    if trainer.accelerator.is_main_process:
        model.config.save_pretrained(out)
        if trainer.processing_class is not None:
            trainer.processing_class.save_pretrained(out)
    trainer.accelerator.wait_for_everyone()
    problems = shard_mismatches(state, out)
    bad = int(all_reduce([len(problems)], "sum")[0])
    if bad:
        raise IncompleteSave(f"distributed final save failed its check on {bad} tensor(s)"
                             + (f", e.g. rank {os.environ.get('RANK', 0)}: {problems[0]}" if problems else ""))
    if trainer.accelerator.is_main_process:  # the per-rank shards are now in the consolidated files
        shutil.rmtree(out / "sharded", ignore_errors=True)
        return {"tensors": len(state), "lora_b_checked": 0, "model_shapes_checked": len(state),
                "compared_with": LIVE_SHARDS}
    return None


def trainable_state_dict(trainer) -> dict | None:
    """LoRA: gather only the trainable parameters, one at a time (a collective). Full tensors on rank 0."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    out = {}
    with gathered_parameters(model, trainable_only=True) as params:
        for name, full in params:
            if trainer.accelerator.is_main_process:  # a copy: on CPU `.cpu()` is the same storage, maybe a view
                out[name] = full.detach().to("cpu", copy=True).contiguous()
    return out if trainer.accelerator.is_main_process else None


def reshard_fsdp2(model) -> int:
    """Put every FSDP2 module of `model` back to its sharded parameters; returns how many were modules of FSDP2.

    Why: FSDP2 keeps a module's parameters unsharded after its forward when reshard_after_forward is False (always
    for the root module, which holds the LM head, the embeddings and the final norm, and for every module under
    SHARD_GRAD_OP), and a backward reshards them; an evaluation has no backward. Under mixed precision the unsharded
    parameters are the bf16 copies, and named_parameters() then yields them (state_dict() does not: FSDP2's hook
    returns the shards). The LoRA save gathers the trainable parameters from named_parameters (trainable_state_dict):
    the LM head that tiny-cpu-lora trains (modules_to_save, in the root) was written in bf16 after the last step's
    evaluation, and the final-save check refused it (bf16 autocast on CPU, torch 2.13.0, accelerate 1.15.0). Under
    SHARD_GRAD_OP every LoRA matrix would have been. tests/test_sharded_checkpoints.py shows the mechanism."""
    from torch.distributed.fsdp import FSDPModule

    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for module in modules:
        module.reshard()
    return len(modules)


class ReshardAfterEvaluate(TrainerCallback):
    """Reshard after every evaluation, so that the save the Trainer may run next reads the float32 shards
    (reshard_fsdp2)."""

    def on_evaluate(self, args, state, control, model=None, **kwargs):
        if model is not None:
            reshard_fsdp2(model)
