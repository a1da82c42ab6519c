"""Tensor parallel beside FSDP2 in a rank: a recipe's mesh with tp > 1 (config/mesh.py) trains a model that
transformers shards at load time, `from_pretrained(distributed_config=DistributedConfig(tp_size, fsdp_size))`:
its tp plan splits each layer's projections over the tp ranks (colwise q/k/v/gate/up, rowwise o/down), and FSDP2
shards the result over the dp_shard ranks, a 2-D mesh (dp_shard, tp). The Trainer then takes the mesh from the
model (a ParallelismConfig for accelerate) and neither wraps nor shards it again.

Why transformers' sharding and not accelerate's FSDP plugin: in the pinned versions (transformers 5.23, accelerate
1.15) the two do not meet. A model with a tp plan is one transformers sharded at load time; for such a model the
Trainer prepares the optimizer alone, which accelerate's FSDP2 refuses ("a model and optimizer must be passed
together"); and accelerate's own TP preparation imports `ReplicateParallel`, which transformers 5 removed. So the
rank turns accelerate's FSDP off before any accelerate state exists (`set_up_process`), and the accelerate YAML's
fsdp_config settings (wrap policy, resharding, state dict type, activation checkpointing, offload) do not apply to
a tp run: transformers' FSDP2 plan shards each decoder layer, and gradient checkpointing is the recipe's
`gradient_checkpointing`.

What upstream leaves to the pack: transformers 5.23 checkpoints no optimizer state for a model it sharded at load
time (the Trainer refuses unless `save_only_model`) and cannot load its own checkpoint back into the DTensors, so
the pack saves the weights, optimizer, scheduler and RNG states itself and loads them on resume
(checkpoint/tensor_parallel_state.py, wired in by `prepare_trainer`): a preempted tp run resumes exactly. Its final save is the Trainer's: the full state dict gathered from the DTensors onto rank 0
(a LoRA adapter: PEFT's gather), checked here against every live parameter gathered again (`save_and_check`).

Checked on CPU over gloo (tests/test_tensor_parallel.py, docs/training.md "Tensor parallel"); the 2 patches it
needs are patches/tensor_parallel.py.
"""

from __future__ import annotations

import os
from pathlib import Path

from transformers import TrainerCallback

from fsdp_recipes.checkpoint import tensor_parallel_state as tp_state
from fsdp_recipes.checkpoint.markers import CompletionMarkerCallback
from fsdp_recipes.checkpoint.resume_check import adapter_key
from fsdp_recipes.checkpoint.save_check import IncompleteSave, open_saved, without_tied_copies
from fsdp_recipes.config.mesh import Mesh, check_tensor_parallel_lora, launched_mesh
from fsdp_recipes.dist import all_reduce, barrier
from fsdp_recipes.errors import UserError
from fsdp_recipes.patches import tensor_parallel as patches

def mesh_from_env() -> Mesh | None:
    """The mesh `accelerate launch` passed to this rank (config/mesh.py launched_mesh), if it splits layers."""
    mesh = launched_mesh()
    return mesh if mesh is not None and mesh.tp > 1 else None


def set_up_process() -> Mesh | None:
    """Before any accelerate state: transformers shards a tp run's model, so accelerate's FSDP is off (the module
    docstring says why); on a machine without an accelerator, the CPU's gloo group and accelerate's validation of
    the mesh (patches/tensor_parallel.py). The mesh, or None for a run without tp."""
    mesh = mesh_from_env()
    if mesh is None:
        return None
    import torch

    os.environ["ACCELERATE_USE_FSDP"] = "false"
    patches.lora_widths_of_tensor_parallel_linears()
    if not torch.accelerator.is_available():
        os.environ["ACCELERATE_USE_CPU"] = "true"  # accelerate's MULTI_CPU state: a gloo process group
        patches.parallelism_config_on_cpu()
    return mesh


def distributed_config(mesh: Mesh) -> dict:
    """What from_pretrained takes (a dict: the run's resolved arguments stay JSON)."""
    return {"tp_size": mesh.tp, "fsdp_size": mesh.dp_shard}


def model_init_kwargs(cfg, resume) -> dict:
    """For the rank's from_pretrained, after `settle`; {} without tp. device_map None: TRL would pick "auto" on a
    GPU, which transformers refuses beside a tp plan (each rank holds its shard on its own device)."""
    mesh = mesh_from_env()
    if mesh is None:
        return {}
    # the launcher checked it already (config/mesh.py); a program that drives training itself has not
    check_tensor_parallel_lora(mesh, cfg.model.lora_modules_to_save if cfg.model.use_peft else None)
    settle(cfg.training, resume)
    return {"distributed_config": distributed_config(mesh), "device_map": None}


def settle(training, resume) -> None:
    """Checkpoints of a tp run: the Trainer's of the model (`save_only_model`, the only kind transformers 5.23 allows
    a model it sharded at load time) and the pack's of the rest (checkpoint/tensor_parallel_state.py). A checkpoint
    without the pack's part (saved before it existed) cannot be resumed: one line."""
    if resume and not tp_state.has_state(resume):
        raise UserError(f"{training.output_dir} has a checkpoint to resume ({resume}), but it holds no optimizer "
                        f"state ({tp_state.STATE_DIR}/ missing: saved before the pack checkpointed tensor-parallel "
                        "runs, and transformers 5.23 saves none for a model it sharded at load time). Fix: a new "
                        "output_dir, or model_name_or_path set to that checkpoint to start from its weights.")
    if str(getattr(training.save_strategy, "value", training.save_strategy)) != "no" and not training.save_only_model:
        training.save_only_model = True  # the Trainer refuses anything else; the rest is tensor_parallel_state's


def active(model) -> bool:
    """Whether `model` (the Trainer's) was sharded by transformers at load time with a tp plan."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return (getattr(base, "_tp_size", None) or 1) > 1


def prepare_trainer(trainer) -> None:
    """The built trainer of a tp run: a LoRA adapter kept equal over the dp ranks; checkpoints it can resume from.
    (Its tokens: the run report counts a row once per dp rank, dividing by the mesh's tp x cp, run_report.py.)"""
    if active(trainer.model):
        sync_adapter_over_dp(trainer)
        resumable_checkpoints(trainer)


class TensorParallelCheckpoints(TrainerCallback):
    """Writes the pack's part of each checkpoint (on_save) and loads it on resume (on_train_begin: the optimizer
    and scheduler exist, no step taken). Sits before the completion marker and the resume check."""

    def __init__(self, trainer):
        self.trainer, self.resume = trainer, None

    def on_save(self, args, state, control, **kwargs):
        tp_state.save(self.trainer, Path(args.output_dir) / f"checkpoint-{state.global_step}")

    def on_train_begin(self, args, state, control, **kwargs):
        if self.resume is not None:
            tp_state.load(self.trainer, self.resume)
            self.resume = None


def resumable_checkpoints(trainer) -> None:
    """The callback, placed before the marker's (a checkpoint is complete only with the optimizer state in it,
    checkpoint/markers.py) and the resume check's (which verifies what it loaded); and the Trainer's own weight
    load, which fails on DTensors, replaced (patches/tensor_parallel.py, point 3): the Trainer calls it with the
    checkpoint's path before preparing the model, and that path is what the callback loads, weights included."""
    callback = TensorParallelCheckpoints(trainer)
    callbacks = trainer.callback_handler.callbacks
    first_of_pack = next((i for i, c in enumerate(callbacks) if isinstance(c, CompletionMarkerCallback)),
                         len(callbacks))
    callbacks.insert(first_of_pack, callback)

    patches.resume_through(trainer, lambda checkpoint: setattr(callback, "resume", checkpoint))


def sync_adapter_over_dp(trainer) -> None:
    """A LoRA adapter on a tp x dp_shard mesh: keep its tp-sharded tensors equal over the dp ranks.

    Gap it fills (transformers 5.23): an adapter added after FSDP2 sharded the base is not FSDP's to reduce. The
    Trainer broadcasts and averages such tensors when they are plain (`_sync_replicated_trainable_parameters`), but
    skips every DTensor, and PEFT makes the adapter's half on a sharded projection a DTensor over the tp ranks
    (lora_B of a colwise layer, lora_A of a rowwise one). Unreduced, each dp group would train its own adapter.
    Here each such tensor's local shard is broadcast from the first rank of its dp group and its gradient averaged
    over that group once per optimizer step, as the Trainer does for the plain ones over all ranks."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    model = trainer.model
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if getattr(base, "_fsdp_size", 1) <= 1:
        return
    sharded = [p for p in model.parameters() if p.requires_grad and isinstance(p, DTensor)
               and "fsdp" not in (p.device_mesh.mesh_dim_names or ())]  # FSDP reduces its own
    if not sharded:
        return
    group = base._device_mesh["fsdp"].get_group()
    source = dist.get_global_rank(group, 0)

    def average(param):
        if trainer.accelerator.sync_gradients:  # once per optimizer step, after the last micro-batch
            dist.all_reduce(param.grad.to_local(), op=dist.ReduceOp.AVG, group=group)

    for param in sharded:
        with torch.no_grad():
            dist.broadcast(param.to_local(), src=source, group=group)
        param.register_post_accumulate_grad_hook(average)


def save_and_check(trainer, output_dir: str, peft: bool) -> dict:
    """The final save of a tp run (the Trainer's, on every rank: the gathers are collectives), then every live
    parameter gathered one at a time and compared on rank 0 with the files. Raises IncompleteSave on any difference;
    returns the check for the run report (rank 0; None on the others)."""
    import torch
    from torch.distributed.tensor import DTensor

    trainer.save_model(output_dir)
    barrier()  # rank 0 has written every file
    main = trainer.accelerator.is_main_process
    saved = open_saved(Path(output_dir)) if main else {}
    model = trainer.model
    live = ((adapter_key(n), p) for n, p in model.named_parameters() if p.requires_grad) if peft else \
        without_tied_copies(model, model.state_dict(keep_vars=True)).items()  # as save_pretrained writes it
    problems, seen = [], set()
    for key, tensor in live:
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor  # every rank: a collective
        if not main:
            continue
        seen.add(key)
        if key not in saved:
            problems.append(f"{key} missing from the files")
        elif tuple(saved[key].shape) != tuple(full.shape) or not torch.equal(full.detach().to(saved[key].dtype),
                                                                           saved[key]):
            problems.append(f"{key}: the saved tensor differs from the weights in memory")
    if main and (extra := sorted(set(saved) - seen)):
        problems.append(f"{len(extra)} unexpected tensors in the files (e.g. {extra[0]})")
    if all_reduce([len(problems)], "sum")[0]:
        raise IncompleteSave("final save of a tensor-parallel run failed its check against the weights in memory: "
                             + "; ".join(problems[:3]))
    return {"tensors": len(seen), "compared_with": "every live parameter, gathered from its DTensor shards"} \
        if main else None
