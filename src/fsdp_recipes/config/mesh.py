"""A recipe's device mesh as its accelerate YAML gives it: accelerate 1.15's `parallelism_config` keys
(`parallelism_config_dp_replicate_size`, `_dp_shard_size`, `_tp_size`, `_cp_size`; each 1 when absent, as
accelerate's ParallelismConfig reads them), checked before any rank starts, one line a mistake.

    structure (check_mesh, the launcher's light checks): sizes of at least 1; their product the job's processes;
        replication only over shard groups (accelerate refuses dp_replicate > 1 with dp_shard 1)
    against the model and the rows (check_mesh_fits, once the recipe is parsed): tp divides the attention heads and
        the key/value heads (each rank holds whole heads); cp divides the rows into 2 x cp chunks (torch's load-
        balanced context parallel gives each rank one early and one late chunk)
    context parallel (cp above 1, speed/context_parallel.py): SFT only, unpacked (TRL refuses packing under cp; a
        padding-free batch has no rows to split), padded to a multiple of 2 x cp (every batch splits as the rows do);
        without a GPU the ranks run the all-to-all form, which gives each rank whole heads, so cp divides the heads
    tensor parallel (tp above 1, train/tensor_parallel.py): beside FSDP2 (dp_shard x tp); refused in one line
        beside cp or dp_replicate (unchecked), with LoRA's lora_modules_to_save (PEFT copies them, which FSDP2
        refuses), and with fsdp_config settings transformers' sharding would leave unapplied (activation
        checkpointing, offload) (docs/training.md, "Tensor parallel")
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from fsdp_recipes.config import hardware
from fsdp_recipes.config.kind_registry import TRAINERS
from fsdp_recipes.errors import UserError

PREFIX = "parallelism_config_"
ENV = "PARALLELISM_CONFIG_"  # what `accelerate launch` passes each rank of the YAML's parallelism_config


@dataclass(frozen=True)
class Mesh:
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    cp: int = 1

    @property
    def total(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.cp

    def describe(self) -> str:
        return " x ".join(f"{name} {size}" for name, size in vars(self).items())

    def data_parallel_size(self, world: int) -> int:
        """data_parallel_size below, for a layer that may not import this module (checkpoint/resume_settings.py)."""
        return data_parallel_size(world, self)


def mesh_of(acc: dict, path) -> Mesh | None:
    """The mesh an FSDP accelerate YAML names in `parallelism_config`, else None (the pack's plain FSDP: the world
    is one shard group)."""
    par = acc.get("parallelism_config") or {}
    if acc.get("distributed_type") != "FSDP" or not par:
        return None
    sizes = {}
    for name in Mesh.__dataclass_fields__:
        value = par.get(f"{PREFIX}{name}_size", 1)
        try:
            sizes[name] = int(value)
        except (TypeError, ValueError):
            raise UserError(f"{path}: {PREFIX}{name}_size is {value!r}, not a whole number. Fix: a size of 1 or "
                            "more.") from None
        if sizes[name] < 1:
            raise UserError(f"{path}: {PREFIX}{name}_size is {sizes[name]}; a mesh dimension has at least 1 rank. "
                            f"Fix: 1 turns the dimension off.")
    return Mesh(**sizes)


def launched_mesh() -> Mesh | None:
    """The mesh `accelerate launch` passed to this rank (PARALLELISM_CONFIG_<NAME>_SIZE, from the YAML's
    parallelism_config, as accelerate's ParallelismConfig reads them), else None: the same Mesh mesh_of gives the
    launcher from the YAML."""
    if os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() != "true":
        return None
    return Mesh(**{name: int(os.environ.get(f"{ENV}{name.upper()}_SIZE", "1")) for name in Mesh.__dataclass_fields__})


def data_parallel_size(world: int, mesh=None) -> int:
    """The ranks that read rows of their own, of `world`: a tp group's ranks share their rows, and so do a cp
    group's (each holds a share of every row's tokens; accelerate's data loader shards over dp_replicate x dp_shard),
    so world / (tp x cp). A step reads per_device_train_batch_size x gradient_accumulation_steps x this many rows:
    the global batch a resume compares (checkpoint/resume_settings.py) and the planner reports. `mesh`: a Mesh, the
    planner's Setup (anything with tp and cp), or None (no mesh: every rank its own rows)."""
    return world if mesh is None else world // (mesh.tp * mesh.cp)


def check_mesh(acc: dict, path, processes: int) -> Mesh | None:
    """The structure, before any heavy import."""
    mesh = mesh_of(acc, path)
    if mesh is None:
        return None
    if mesh.total != processes:
        raise UserError(f"{path}: the mesh {mesh.describe()} has {mesh.total} ranks, but the job has {processes} "
                        "processes. Fix: make the sizes' product the world size (nodes x GPUs per node).")
    if mesh.dp_replicate > 1 and mesh.dp_shard == 1:
        raise UserError(f"{path}: dp_replicate {mesh.dp_replicate} with dp_shard 1 replicates unsharded copies, "
                        "which accelerate's ParallelismConfig refuses. Fix: shard within each replica "
                        f"({PREFIX}dp_shard_size above 1), or plain DDP (distributed_type: MULTI_GPU).")
    if mesh.tp > 1:
        check_fsdp_settings_under_tp(acc.get("fsdp_config") or {}, path)
    return mesh


# fsdp_config settings that change what is trained or held, and that a tp mesh would leave unapplied: its FSDP2 is
# transformers' (train/tensor_parallel.py), which reads nothing of accelerate's fsdp_config
IGNORED_UNDER_TP = {
    "fsdp_activation_checkpointing": "the recipe's activation_checkpointing instead",
    "fsdp_offload_params": "no offload (a mesh without tp offloads)",
}


def check_fsdp_settings_under_tp(fsdp: dict, path) -> None:
    for key, instead in IGNORED_UNDER_TP.items():
        if str(fsdp.get(key, False)).lower() == "true":
            raise UserError(f"{path}: fsdp_config.{key} is true, but a tensor-parallel mesh is sharded by transformers "
                            "at load time, which applies none of accelerate's fsdp_config. Fix: "
                            f"{key}: false, and {instead}.")


def check_mesh_fits(mesh: Mesh | None, path, heads: int | None, kv_heads: int | None, max_length: int | None,
                    cfg=None, on_gpus: bool | None = None) -> None:
    """Against the model's heads and the rows' length, then what the pack trains today. `cfg`: the parsed recipe
    (RunConfig), for what context parallel needs of the trainer and its batches. `on_gpus`: whether the ranks run
    on GPUs (None: whether this machine has one; the planner plans a named GPU from any machine)."""
    if mesh is None:
        return
    for what, count in (("attention heads", heads), ("key/value heads", kv_heads)):
        if mesh.tp > 1 and count and count % mesh.tp:
            raise UserError(f"{path}: tp {mesh.tp} does not divide the model's {count} {what}: tensor parallel gives "
                            f"each rank whole heads. Fix: {PREFIX}tp_size a divisor of {count}.")
    if mesh.cp > 1 and max_length and max_length % (2 * mesh.cp):
        raise UserError(f"{path}: cp {mesh.cp} cannot split rows of max_length {max_length} into {2 * mesh.cp} equal "
                        f"chunks (context parallel's load balancing gives each rank two). Fix: max_length a multiple "
                        f"of {2 * mesh.cp}, or another {PREFIX}cp_size.")
    if mesh.tp > 1 and mesh.cp > 1:
        raise UserError(f"{path}: the mesh {mesh.describe()} splits both layers (tp) and rows (cp), which the pack has "
                        "not checked together: each was checked beside FSDP2 alone. Fix: "
                        f"{PREFIX}tp_size 1 or {PREFIX}cp_size 1.")
    if mesh.tp > 1 and mesh.dp_replicate > 1:
        raise UserError(f"{path}: the mesh {mesh.describe()} replicates a tensor-parallel model (HSDP beside tp), "
                        "which the pack has not checked: tp was checked beside FSDP2 (dp_shard) only. Fix: "
                        f"{PREFIX}dp_replicate_size 1 with dp_shard x tp the world size.")
    model = getattr(cfg, "model", None)  # the recipe's ModelConfig (absent from a test's stand-in)
    if model is not None and model.use_peft:
        check_tensor_parallel_lora(mesh, model.lora_modules_to_save)
    if model is not None and mesh.tp > 1 and not model.use_peft:
        check_tensor_parallel_precision(mesh, path, getattr(model, "dtype", None))
    if mesh.cp > 1 and cfg is not None:
        check_context_parallel(mesh.cp, path, heads, cfg, on_gpus)


def check_context_parallel(cp: int, path, heads: int | None, cfg, on_gpus: bool | None = None) -> None:
    """What splitting each row over `cp` ranks needs of the recipe (speed/context_parallel.py)."""
    training, where = cfg.training, f"{path}: cp {cp}"
    if not TRAINERS[cfg.trainer].splits_rows:
        kinds = ", ".join(k for k, r in TRAINERS.items() if r.splits_rows)
        raise UserError(f"{where} splits rows for the trainer kinds whose loss is split-aware in TRL 1.16 ({kinds}), "
                        f"not {cfg.trainer}. Fix: {PREFIX}cp_size 1, or a recipe of {kinds}.")
    if getattr(training, "packing", False) or getattr(training, "padding_free", False):
        what = "packing" if getattr(training, "packing", False) else "padding_free"
        raise UserError(f"{where} needs whole padded rows to split, and {what} is on (TRL refuses packing under "
                        f"context parallel). Fix: {what}: false in the recipe.")
    multiple = getattr(training, "pad_to_multiple_of", None)
    if not multiple or multiple % (2 * cp):
        raise UserError(f"{where} splits each batch into {2 * cp} equal chunks, so its length must be a multiple of "
                        f"{2 * cp}, and pad_to_multiple_of is {multiple}. Fix: pad_to_multiple_of: {2 * cp} in the "
                        "recipe.")
    if on_gpus is None:
        on_gpus = bool(hardware.gpu_count())
    if heads and heads % cp and not on_gpus:
        raise UserError(f"{where} does not divide the model's {heads} attention heads: without a GPU the ranks run "
                        "context parallel's all-to-all form, which gives each rank whole heads. Fix: "
                        f"{PREFIX}cp_size a divisor of {heads}.")


def check_tensor_parallel_precision(mesh: Mesh, path, dtype) -> None:
    """Full fine-tuning beside tp keeps the weights in the dtype they were loaded in: accelerate's FSDP2, which
    upcasts a half-precision load to fp32 master weights, is off for a tp model (train/tensor_parallel.py), so a
    bfloat16 load would train bf16 weights and AdamW states, whose updates at a fine-tuning learning rate fall below
    bf16's resolution (and the planner counts fp32 states)."""
    name = str(dtype or "").removeprefix("torch.")
    if name in ("bfloat16", "float16"):
        raise UserError(f"{path}: tp {mesh.tp} with full fine-tuning trains the weights in the dtype they load in, "
                        f"{name}: under tp accelerate's FSDP2 and its fp32 master weights are off. Fix: dtype: "
                        "float32 with bf16: true (bf16 compute, fp32 weights and optimizer states).")


def check_tensor_parallel_lora(mesh: Mesh | None, modules_to_save: list | None) -> None:
    """LoRA's fully trained modules beside tp: PEFT copies them (train/tensor_parallel.py found it failing)."""
    if mesh is not None and mesh.tp > 1 and modules_to_save:
        raise UserError(f"lora_modules_to_save {list(modules_to_save)} with a tensor-parallel mesh "
                        f"({mesh.describe()}): PEFT deep-copies those modules, and torch 2.13's FSDP2 refuses to "
                        "copy a module that transformers 5.23 sharded at load time ('FSDP does not support "
                        "deepcopy'). Fix: no lora_modules_to_save, or a mesh without tp.")
