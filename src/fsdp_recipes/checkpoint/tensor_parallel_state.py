"""What a tensor-parallel run's checkpoint needs beyond the Trainer's, so that a preempted tp run resumes exactly.

Gap this fills (transformers 5.23, torch 2.13): for a model transformers sharded at load time
(`from_pretrained(distributed_config=...)`, DTensor parameters) the Trainer refuses to checkpoint the optimizer
("Resuming is not supported for models sharded at load time") unless `save_only_model`, so its checkpoints hold the
model gathered to rank 0 and trainer_state.json, and nothing else; and on resume its `_load_from_checkpoint` copies
that full state dict into the DTensors, which fails on every parameter ("aten.copy_.default got mixed torch.Tensor
and DTensor"). So this module writes, in every checkpoint-N folder, with the ranks' collectives:
- `tp_state/`: the trainable weights and the optimizer state as a distributed checkpoint (torch DCP over the
  DTensors: `get_state_dict`/`set_state_dict`, each rank its shards);
- `scheduler.pt` (rank 0) and `rng_state_<rank>.pth` (the Trainer's own format, which its resume reloads at the
  right batch); trainer_state.json (global step, the data to skip) is the Trainer's already.
The callback writing them runs before the completion marker's (train/tensor_parallel.py puts it there), so a
checkpoint is marked complete only with all of it (markers.py); a resume loads it before the first step, before
resume_check.py verifies the optimizer's step counts.
"""

from __future__ import annotations

from pathlib import Path

STATE_DIR = "tp_state"  # no "optimizer" in the name: the Trainer's own loader would take it for its file
SCHEDULER = "scheduler.pt"


def has_state(checkpoint: str | Path) -> bool:
    return (Path(checkpoint) / STATE_DIR / ".metadata").is_file()


def _options(model):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # a LoRA run: the adapter only (the base stays the model files'); strict off for the frozen keys left out
    frozen = any(not p.requires_grad for p in model.parameters())
    return StateDictOptions(ignore_frozen_params=frozen, strict=not frozen)


def _torch_optimizer(optimizer):
    return getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps torch's


def save(trainer, checkpoint: str | Path) -> None:
    """Every rank: its shards of the weights and the optimizer state, its RNG states; rank 0 the scheduler."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    checkpoint = Path(checkpoint)
    model = trainer.model
    weights, optim = get_state_dict(model, _torch_optimizer(trainer.optimizer), options=_options(model))
    dcp.save({"model": weights, "optimizer": optim}, checkpoint_id=str(checkpoint / STATE_DIR))
    trainer._save_rng_state(str(checkpoint))  # rng_state_<rank>.pth, as the Trainer writes and reads them
    if trainer.accelerator.is_main_process:
        torch.save(trainer.lr_scheduler.state_dict(), checkpoint / SCHEDULER)


def load(trainer, checkpoint: str | Path) -> None:
    """Every rank, after the optimizer and scheduler exist and before the first step: weights, optimizer state
    and scheduler from `checkpoint` (the RNG states are the Trainer's to reload, at the batch it skips to)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    checkpoint = Path(checkpoint)
    model, optimizer = trainer.model, _torch_optimizer(trainer.optimizer)
    options = _options(model)
    # the templates DCP fills in place: get_state_dict initialises the optimizer's state first (one zero step)
    weights, optim = get_state_dict(model, optimizer, options=options)
    state = {"model": weights, "optimizer": optim}
    dcp.load(state, checkpoint_id=str(checkpoint / STATE_DIR))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=options)
    trainer.lr_scheduler.load_state_dict(torch.load(checkpoint / SCHEDULER, weights_only=True))
