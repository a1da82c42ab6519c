"""Check, after a run resumes, that the checkpoint really was restored: the adapter (PEFT runs) and the
optimizer state (every run).

Why: a resume that loads no adapter is silent. The Trainer ignores the result of accelerate's
`load_fsdp_model(adapter_only=True)`, and PEFT loads with `strict=False`, so a key-name mismatch loads nothing
and training goes on from the freshly initialised adapter; only the loss shows it (FSDP1, peft 0.21 +
accelerate 1.15: step-11 loss 5.69 instead of 2.33; see peft_fsdp.py, workaround 1). This check makes any such
failure loud, whatever its cause.

How: when training begins (the checkpoint is loaded, no step taken), every rank gathers the trainable
parameters (FSDP1: `summon_full_params` of only the units that hold them; FSDP2: `DTensor.full_tensor()`, both
collectives; dist.gathered_parameters), and rank 0
compares each with `<checkpoint>/adapter_model.safetensors` (SHARDED_STATE_DICT checkpoints: the
sharded model folder, read whole on rank 0), by name and exactly. Every trainable parameter
must have its tensor in the file and every tensor in the file must have its parameter. Costs one gather of
the trainable weights (the adapter: small), once per resume.

The optimizer state: each rank checks its own (no collective) that every state entry's `step` equals the
checkpoint's global step. A fresh optimizer has no state, and one initialised but not loaded has step 1, so a
resume that restored nothing fails here (FSDP1 + SHARDED_STATE_DICT did, silently: optim_resume.py). Skipped
for fp16, where the gradient scaler may skip optimizer steps, and for optimizers without a `step` state.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import TrainerCallback

from fsdp_recipes.dist import gathered_parameters, rank
from fsdp_recipes.errors import UserError
from fsdp_recipes.patches.peft_fsdp import without_wrapper_names

ADAPTER_FILE = "adapter_model.safetensors"
SHARDED_MODEL_DIR = "pytorch_model_fsdp_0"  # accelerate's SHARDED_STATE_DICT model folder (model index 0)


def adapter_key(param_name: str, adapter_name: str = "default") -> str:
    """The key `save_pretrained` writes for a trainable parameter of a PeftModel (FSDP wrappers or not):
    `base_model.model.<m>.lora_A.default.weight` -> `base_model.model.<m>.lora_A.weight`;
    `<m>.modules_to_save.default.weight` -> `<m>.weight`."""
    name = without_wrapper_names(param_name).replace(f".modules_to_save.{adapter_name}.", ".")
    if name.endswith(f".{adapter_name}"):  # an nn.Parameter held directly in a ParameterDict
        return name.removesuffix(f".{adapter_name}")
    head, _, suffix = name.rpartition(".")
    return f"{head.removesuffix(f'.{adapter_name}')}.{suffix}"


def trainable_tensors(model) -> dict[str, torch.Tensor]:
    """Full (unsharded) copies of the trainable parameters, by their PEFT-saved key. Every rank must call it."""
    with gathered_parameters(model, trainable_only=True) as params:
        return {adapter_key(name): full.detach().cpu().clone() for name, full in params}


def saved_adapter(checkpoint: str | Path) -> tuple[dict[str, torch.Tensor], Path]:
    """The checkpoint's adapter: `adapter_model.safetensors` (FULL_STATE_DICT), else the sharded (DCP) model
    folder accelerate writes under SHARDED_STATE_DICT, read whole by this process alone (no collective)."""
    from safetensors.torch import load_file

    path = Path(checkpoint) / ADAPTER_FILE
    if path.is_file():
        return load_file(str(path)), path
    sharded = Path(checkpoint) / SHARDED_MODEL_DIR
    if sharded.is_dir():
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

        state: dict = {}
        _load_state_dict(state, storage_reader=dcp.FileSystemReader(str(sharded)),
                         planner=_EmptyStateDictLoadPlanner(), no_dist=True)
        return state.get("model", {}), sharded
    raise RuntimeError(f"resume check: neither {path} nor {sharded} exists, so the restored adapter cannot be "
                       "verified")


def compare_with_adapter(memory: dict[str, torch.Tensor], checkpoint: str | Path) -> dict:
    """Raise when the weights in memory are not the checkpoint's adapter; else a summary."""
    tensors, path = saved_adapter(checkpoint)
    problems, checked = [], 0
    saved = set(tensors)
    missing = sorted(set(memory) - saved)
    unused = sorted(saved - set(memory))
    for key in sorted(set(memory) & saved):
        expected, actual = tensors[key], memory[key]
        checked += 1
        if tuple(actual.shape) != tuple(expected.shape):
            problems.append(f"{key}: shape {tuple(actual.shape)} in memory, {tuple(expected.shape)} saved")
        elif not torch.equal(actual, expected.to(actual.dtype)):
            diff = (actual.float() - expected.float()).abs().max().item()
            problems.append(f"{key}: differs by up to {diff:.3g}")
    if missing or unused or problems or checked == 0:
        detail = "; ".join(
            ([f"{len(problems)} differ (e.g. {problems[0]})"] if problems else [])
            + ([f"{len(missing)} trainable parameters not in the file (e.g. {missing[0]})"] if missing else [])
            + ([f"{len(unused)} saved tensors match no trainable parameter (e.g. {unused[0]})"] if unused else [])
            + (["nothing to compare"] if checked == 0 else [])
        )
        raise RuntimeError(
            f"resume check failed: the trainable weights in memory are not the adapter saved in {path} "
            f"({detail}). The checkpoint was not restored; training would continue from other weights."
        )
    return {"tensors_checked": checked, "checkpoint": str(checkpoint), "source": path.name}


def verify_resumed_adapter(model, checkpoint: str | Path, is_main: bool) -> dict | None:
    """Every rank must call this (it gathers); rank 0 compares and raises."""
    memory = trainable_tensors(model)
    return compare_with_adapter(memory, checkpoint) if is_main else None


def checkpoint_step(checkpoint: str | Path) -> int:
    """The step the Trainer saved `checkpoint` at; a folder without its trainer_state.json is one line."""
    state = Path(checkpoint) / "trainer_state.json"
    if not state.is_file():
        raise UserError(f"{checkpoint} has no trainer_state.json, so the Trainer cannot resume from it (the step, "
                        "the schedule and the rows to skip are there). Fix: point resume_from_checkpoint at a "
                        "checkpoint-N folder that a run saved whole.")
    return int(json.loads(state.read_text())["global_step"])


def verify_optimizer_steps(optimizer, checkpoint: str | Path) -> dict | None:
    """Raise unless every state entry of this rank's optimizer has the checkpoint's step count."""
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps torch's
    expected = checkpoint_step(checkpoint)
    has_params = any(p.requires_grad and p.numel() > 0 for g in inner.param_groups for p in g["params"])
    steps = [float(s["step"]) for s in inner.state.values() if "step" in s]
    if not inner.state and has_params and expected > 0:
        raise RuntimeError(f"resume check failed: the optimizer has no state after resuming from {checkpoint} "
                           f"(step {expected}); it was not restored and training would restart AdamW from zero")
    if not steps:
        return None  # an optimizer without a step count (e.g. SGD without momentum)
    wrong = [s for s in steps if s != expected]
    if wrong:
        raise RuntimeError(f"resume check failed: {len(wrong)} of {len(steps)} optimizer states have step "
                           f"{wrong[0]:g} after resuming from {checkpoint}, which was saved at step {expected}; "
                           "the optimizer state was not restored")
    return {"optimizer_states_checked": len(steps), "step": expected}


class ResumeCheckCallback(TrainerCallback):
    """Run the checks once, when training begins after a resume (checkpoint loaded, no step taken)."""

    def __init__(self, checkpoint: str, report=None, peft: bool = True):
        self.checkpoint, self.report, self.peft = checkpoint, report, peft

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if optimizer is not None and not args.fp16:
            optim = verify_optimizer_steps(optimizer, self.checkpoint)
            if optim and self.report is not None:
                self.report.resume_check = {**(self.report.resume_check or {}), **optim}
        if not self.peft:
            return
        result = verify_resumed_adapter(model, self.checkpoint, rank() == 0)
        if result is not None:
            print(f"[train] resumed adapter verified: {result['tensors_checked']} trainable tensors equal "
                  f"{self.checkpoint}/{result['source']}", flush=True)
            if self.report is not None:
                self.report.resume_check = {**(self.report.resume_check or {}), **result}
