"""Check the final save: complete, unsharded, equal to the weights in memory, and actually trained.

Gap this fills: a save under FSDP can be silently incomplete -- a LoRA adapter holding only rank 0's slice
(accelerate PR 4206, axolotl issue 3772), or B matrices still at their zero init. Nothing in the ecosystem
checks the written files. After every final save the pack checks them twice:

1. on rank 0 (`verify_final_save`), against the state dict the save wrote: every tensor present, unsharded (the
   model's global shapes, under FSDP2), equal (this part is a round trip: it proves the write, not the gather),
   as many adapter tensors as the model trains, LoRA B no longer zero;
2. against the weights in memory, independently of that dict (`verify_against_memory`): under FSDP2 each rank
   compares its own shard of every live parameter with the same region of the files; under FSDP1 a LoRA adapter
   is gathered again, unit by unit, from the live parameters; without FSDP the state dict of step 1 is the live
   one already. Under FSDP1 full fine-tuning nothing independent is compared (a second gather would hold the
   model twice); the log line and `compared_with` in the run report say so.

A mismatch fails the run.
"""

from __future__ import annotations

import copy
import json
import os
import pickle
from pathlib import Path

import torch
from safetensors.torch import load_file

from fsdp_recipes.checkpoint.resume_check import adapter_key, trainable_tensors
from fsdp_recipes.dist import all_reduce, barrier, fsdp1_units, gather_objects, initialized, rank


class IncompleteSave(RuntimeError):
    pass


# What the files were compared with, besides the state dict that was written (`compared_with` in the run report).
LIVE = "the weights in memory"
LIVE_SHARDS = "each rank's shards of the weights in memory"
REGATHERED = "the trainable weights in memory, gathered again"
SAVED_COPY = "the state dict gathered for the save (FSDP1 full fine-tuning: the live shards were not compared)"


def verified_line(check: dict) -> str:
    """The log line of a passed check, saying what was compared."""
    return (f"final save verified: {check['tensors']} tensors complete and unsharded; the files equal "
            f"{check['compared_with']}")


def save_state_dict(trainer, output_dir: str, state_dict: dict | None) -> None:
    """`trainer._save` (what save_model does with a gathered state dict) with a shallow copy of `state_dict`, on
    the writing process only, as save_model calls it (`if self.args.should_save: self._save(...)`).

    Why only there: `_save` is written for the writing process. transformers 5.23 returns at once on the others
    (unless transformers itself sharded the model at load time, which the pack never asks for); 5.17 does not
    ("If we are executing this function, we are the process zero"): given no state dict on rank 1, it saved the
    live model there, and PEFT's save_pretrained failed on the FSDP2-sharded DTensor parameters ("Attempted to
    access the data pointer on an invalid python storage"), or would have written into rank 0's files.

    Why a copy: transformers 5.23's `save_pretrained` empties the dict it is given (it pops each tensor as it writes
    the shard, and deletes tied and ignored keys), at least where the model has no weight conversions to revert;
    the check after the save reuses the dict. The tensors are shared, not copied: save_pretrained replaces entries
    (clones for shared storage), it does not write into tensors."""
    if trainer.args.should_save:
        trainer._save(output_dir, state_dict=None if state_dict is None else dict(state_dict))


def safetensors_index(directory: str | Path, pattern: str = "*.safetensors") -> dict:
    """Tensor name -> open safetensors handle, over the files in `directory`; tensors are read on demand."""
    from safetensors import safe_open

    handles = [safe_open(str(f), framework="pt") for f in sorted(Path(directory).glob(pattern))]
    return {key: h for h in handles for key in h.keys()}


class LazyTensors(dict):
    """name -> tensor, read from the safetensors files only when asked for, one at a time.

    Why: the check runs right after the save, on the rank that holds the gathered model; reading the files
    whole would hold the model a second time there."""

    def __getitem__(self, key):
        return super().__getitem__(key).get_tensor(key)

    def items(self):
        return ((k, self[k]) for k in self.keys())


def saved_files(directory: Path) -> list[Path]:
    """The safetensors files of a saved PEFT adapter or (possibly sharded) model directory."""
    directory = Path(directory)
    if (directory / "adapter_model.safetensors").is_file():
        return [directory / "adapter_model.safetensors"]
    index = directory / "model.safetensors.index.json"
    names = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else \
        ["model.safetensors"]
    for name in names:
        if not (directory / name).is_file():
            raise IncompleteSave(f"{directory / name} is missing")
    return [directory / name for name in names]


def open_saved(directory: Path) -> LazyTensors:
    from safetensors import safe_open

    handles = [safe_open(str(f), framework="pt") for f in saved_files(directory)]
    return LazyTensors({key: h for h in handles for key in h.keys()})


def read_saved(directory: Path) -> dict[str, torch.Tensor]:
    """All tensors of a saved PEFT adapter or (possibly sharded) safetensors model directory, in memory."""
    out = {}
    for f in saved_files(directory):
        out.update(load_file(f))
    return out


def compare(expected: dict[str, torch.Tensor], saved: dict[str, torch.Tensor], check_lora_b: bool,
            model_shapes: dict[str, tuple] | None = None, layout=None) -> dict:
    """Raise IncompleteSave on any missing/extra key, shape or value difference, or an untrained LoRA B.
    `model_shapes`: the model's own (global) shape of each key, where known. The files are compared with what the
    save gathered; this checks the gather too, so a gather that kept only a shard (accelerate PR 4206) fails.
    `layout`: `expected` under the names the files use (checkpoint_layout), after its shapes are checked."""
    problems = []
    shaped = [key for key in (model_shapes or {}) if key in expected]
    for key in shaped:
        if tuple(expected[key].shape) != tuple(model_shapes[key]):
            problems.append(f"{key}: gathered shape {tuple(expected[key].shape)}, the model's {tuple(model_shapes[key])}")
    expected = layout(expected) if layout is not None else expected
    missing, extra = sorted(set(expected) - set(saved)), sorted(set(saved) - set(expected))
    if missing:
        problems.append(f"{len(missing)} tensors missing from the files (e.g. {missing[0]})")
    if extra:
        problems.append(f"{len(extra)} unexpected tensors in the files (e.g. {extra[0]})")
    for key in sorted(set(expected) & set(saved)):
        want, got = expected[key], saved[key]
        if tuple(want.shape) != tuple(got.shape):
            problems.append(f"{key}: saved shape {tuple(got.shape)}, full shape {tuple(want.shape)}")
        elif not torch.equal(want.to(got.dtype).cpu(), got):
            diff = (want.float().cpu() - got.float()).abs().max().item()
            problems.append(f"{key}: saved values differ from the weights in memory (max abs diff {diff:.3g})")
    lora_b = [k for k in saved if "lora_B" in k]
    if check_lora_b:
        zero = [k for k in lora_b if not saved[k].any()]
        if zero:
            problems.append(f"{len(zero)} of {len(lora_b)} LoRA B matrices are still all zeros (e.g. {zero[0]})")
    if problems:
        raise IncompleteSave("final save failed its completeness check: " + "; ".join(problems[:5]))
    return {"tensors": len(saved), "lora_b_checked": len(lora_b) if check_lora_b else 0,
            "model_shapes_checked": len(shaped)}


def expected_state_dict(trainer, full: dict | None = None, gathered: bool = False) -> dict[str, torch.Tensor] | None:
    """The full (unsharded) state dict, as the files should hold it. A collective unless `gathered` (then `full`
    holds what rank 0 gathered already): call on every rank. Returns None on ranks other than the main one."""
    if not gathered:
        full = trainer.accelerator.get_state_dict(trainer.model)
    if not trainer.accelerator.is_main_process:
        return None
    model = trainer.accelerator.unwrap_model(trainer.model)
    if hasattr(model, "peft_config"):
        from peft import get_peft_model_state_dict

        adapter = get_peft_model_state_dict(model, state_dict=full)
        # PEFT selects the adapter's tensors by name; when that selection goes wrong it is empty or short, in
        # the files and here alike, so also count against what the model actually trains.
        trainable = sum(1 for p in model.parameters() if p.requires_grad)
        if len(adapter) != trainable:
            raise IncompleteSave(
                f"final save failed its completeness check: the adapter has {len(adapter)} tensors but the model "
                f"trains {trainable} parameters"
            )
        return adapter
    return without_tied_copies(model, full)


def without_tied_copies(model, state_dict: dict | None) -> dict | None:
    """Drop the second name of each tied weight (transformers 5: `all_tied_weights_keys`, {"lm_head.weight":
    "model.embed_tokens.weight"}), as save_pretrained does for a live model.

    Why here: a state dict gathered from FSDP holds two separate full copies of a tied weight (each name is gathered
    on its own), and save_pretrained dedupes by shared storage only: it wrote both (a tied SmolLM2-135M's
    model.safetensors gained a 113 MB lm_head.weight equal to the embedding; make compare, 2026-11-25). Loading
    ties them again, so the second copy is only disk."""
    if state_dict is None:
        return None
    for target, source in (getattr(model, "all_tied_weights_keys", None) or {}).items():
        if target in state_dict and source in state_dict:
            state_dict.pop(target)
    return state_dict


def model_shapes(model) -> dict[str, tuple]:
    """Saved key -> global shape, from the model's DTensor parameters (FSDP2; a DTensor's shape is the global one)
    and from plain parameters when nothing is sharded. FSDP1's flat shards carry no such shape and are left out."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.tensor import DTensor

    peft = hasattr(model, "peft_config")
    flat = any(isinstance(m, FullyShardedDataParallel) for m in model.modules())
    shapes = {}
    for name, param in model.named_parameters():
        if (peft and not param.requires_grad) or (flat and not isinstance(param, DTensor)):
            continue
        shapes[adapter_key(name) if peft else name] = tuple(param.shape)
    return shapes


def verify_final_save(trainer, output_dir: str, full: dict | None = None, gathered: bool = False) -> dict | None:
    expected = expected_state_dict(trainer, full, gathered)
    if expected is None:
        return None
    # Warmup schedules start at learning rate 0: the first step leaves LoRA B at zero by design.
    steps, args = trainer.state.global_step, trainer.args
    trained = args.learning_rate > 0 and (steps >= 2 or (steps == 1 and not args.warmup_steps))
    model = trainer.accelerator.unwrap_model(trainer.model)
    layout = None if hasattr(model, "peft_config") else (lambda state: checkpoint_layout(model, state))
    return compare(expected, open_saved(Path(output_dir)), check_lora_b=trained, model_shapes=model_shapes(model),
                   layout=layout)


OWN = object()  # checkpoint_layout's default: the conversions `model` itself holds


def checkpoint_layout(model, state: dict, conversions=OWN) -> dict:
    """`state` (the model's names) under the names and shapes save_pretrained writes, with the function it uses.
    `conversions`: the weight conversions the writing rank's save reverted (writer_conversions), where this rank's
    own record may differ; by default the model's own.

    Why: transformers 5 converts some checkpoints' weights at load and reverts the conversion at save: a
    mixture-of-experts layer's experts, one fused tensor in memory (model.layers.0.mlp.experts.gate_up_proj), are
    written one tensor per expert and projection (...experts.0.gate_proj.weight, ...); GPT-NeoX's LM head, lm_head
    in memory, is written as embed_out. Compared by the model's names, the save of every Qwen3-MoE and Mixtral full
    fine-tune failed its check (scripts/arch_matrix.py found it). A model without conversions comes back as it is."""
    from transformers.core_model_loading import revert_weight_conversion

    if conversions is OWN:
        return revert_weight_conversion(model, state)
    had, held = "_weight_conversions" in model.__dict__, model.__dict__.get("_weight_conversions")
    model.__dict__["_weight_conversions"] = copy.deepcopy(conversions)
    try:
        return revert_weight_conversion(model, state)
    finally:
        if had:
            model.__dict__["_weight_conversions"] = held
        else:
            model.__dict__.pop("_weight_conversions", None)


def writer_conversions(model):
    """The weight conversions that rank 0's save reverted (transformers' `_weight_conversions`, which from_pretrained
    records: those its checkpoint used; None: the architecture's own, looked up again at save), on every rank. A
    collective.

    Why: rank 0 wrote the files, but every rank checks its shards against them under its own record. Under
    fsdp_cpu_ram_efficient_loading the other ranks loaded no weights (speed/ram_efficient_loading.py) and hold no
    record, so transformers looks the architecture's own up again, by class name first; FSDP2's fully_shard had
    renamed the class (GPTNeoXForCausalLM -> FSDPGPTNeoXForCausalLM), so GPT-NeoX's rename (embed_out, lm_head in
    memory), the one causal LM mapping keyed by class (transformers 5.23), was not found there: rank 1 looked for
    lm_head.weight in files that hold embed_out.weight, and every GPT-NeoX full fine-tune with 2 ranks failed its
    final save (`tests/test_save_check.py`)."""
    if not initialized():
        return OWN
    data = gather_objects(conversions_record(model) if rank() == 0 else None)[0]
    return OWN if data is None else pickle.loads(data)


def conversions_record(model) -> bytes | None:
    """What rank 0 sends in writer_conversions: its record, pickled (a record of None too), or None where it cannot
    be pickled (a quantizer's operations): then each rank keeps its own, as before."""
    try:
        return pickle.dumps(model.__dict__.get("_weight_conversions"))
    except Exception:  # noqa: BLE001 - whatever pickling raises
        return None


def _local_slice(param):
    """(local tensor, slices into the full tensor) for a DTensor sharded on dim 0, else the whole tensor."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return param.data, None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return param.to_local(), tuple(slice(o, o + s) for o, s in zip(offset, shape))


def shard_mismatches(state: dict, directory: Path, pattern: str = "model*.safetensors", model=None,
                     conversions=OWN) -> list[str]:
    """This rank's part of every tensor against the same region of the safetensors files in `directory`. `model`:
    the model whose save wrote some tensors under other names (checkpoint_layout), where the files may do so;
    `conversions`: the ones that save reverted (writer_conversions)."""
    where = safetensors_index(directory, pattern)
    problems = []
    for name, tensor in state.items():
        local, region = _local_slice(tensor)
        if name not in where and model is not None:
            problems.extend(converted_mismatches(model, name, tensor, local, region, where, conversions))
            continue
        if name not in where:
            problems.append(f"{name} missing")
            continue
        written = where[name].get_slice(name)
        if tuple(written.get_shape()) != tuple(tensor.shape):  # a DTensor's shape is the model's global one
            problems.append(f"{name} saved with shape {tuple(written.get_shape())}, the model's is {tuple(tensor.shape)}")
            continue
        expected = written[region] if region is not None else written[:]
        if tuple(expected.shape) != tuple(local.shape) or not torch.equal(local.detach().cpu(), expected.to(local.dtype)):
            problems.append(f"{name} differs")
    return problems


def converted_mismatches(model, name: str, tensor, local, region, where: dict, conversions=OWN) -> list[str]:
    """This rank's part of a tensor that the save wrote under other names (a MoE layer's fused experts, one tensor per
    expert in the files): the part placed in a zero tensor of the full shape, and a mask of it, both through the save's
    conversion (checkpoint_layout); each file tensor compared where the mask is set. Allocates the one full tensor,
    never gathers it."""
    full, mask = torch.zeros(tuple(tensor.shape), dtype=local.dtype), torch.zeros(tuple(tensor.shape), dtype=torch.bool)
    full[region or ...], mask[region or ...] = local.detach().cpu(), True
    values = checkpoint_layout(model, {name: full}, conversions)
    masks = checkpoint_layout(model, {name: mask}, conversions)
    problems = [f"{key} missing" for key in values if key not in where]
    for key in [k for k in values if k in where]:
        written = where[key].get_tensor(key)
        if tuple(written.shape) != tuple(values[key].shape) or \
                not torch.equal(written[masks[key]], values[key][masks[key]].to(written.dtype)):
            problems.append(f"{key} ({name} in memory) differs")
    return problems


def verify_live_shards(model, output_dir: str | Path) -> int:
    """FSDP2, after a save from a gathered state dict (FULL_STATE_DICT, or a LoRA adapter): each rank compares its
    own shard of every saved parameter, read from the live DTensor, with the same region of the written files. A
    collective: every rank calls it, and every rank raises when any rank found a difference. Returns how many
    tensors this rank compared.

    Why: the rank-0 check (compare) compares the files with the very dict that was written, so a gather
    that returned wrong values would pass it. This compares with the weights in memory, without gathering them.
    Every rank reads the files rank 0 wrote: output_dir must be shared between nodes (shared_dir.py checks it)."""
    peft = hasattr(model, "peft_config")
    state = {adapter_key(name) if peft else name: param for name, param in model.named_parameters()
             if param.requires_grad or not peft}  # named_parameters lists a tied LM head once, as save_pretrained
    conversions = OWN if peft else writer_conversions(model)  # on every rank: a collective
    problems = shard_mismatches(state, Path(output_dir), "adapter_model.safetensors" if peft else "model*.safetensors",
                                model=None if peft else model, conversions=conversions)
    bad = int(all_reduce([len(problems)], "sum")[0])
    if bad:
        raise IncompleteSave(f"final save failed its check against the weights in memory on {bad} tensor shard(s)"
                             + (f", e.g. rank {os.environ.get('RANK', 0)}: {problems[0]}" if problems else ""))
    return len(state)


def verify_against_memory(model, output_dir: str | Path, is_main: bool) -> str:
    """Step 2 of the module docstring; returns what the files were compared with. A collective under FSDP: every
    rank calls it, after the save. `model`: the Trainer's model (under FSDP1 the wrapped root, which the gather
    needs; accelerate's `unwrap_model` would hide the root unit)."""
    from torch.distributed.tensor import DTensor

    fsdp2 = any(isinstance(p, DTensor) for p in model.parameters())
    fsdp1 = not fsdp2 and bool(fsdp1_units(model))
    if not (fsdp1 or fsdp2):
        return LIVE  # verify_final_save(gathered=False) took the state dict from the live model
    barrier()  # rank 0 has written every file before any rank reads them
    if fsdp2:
        verify_live_shards(model, output_dir)
        return LIVE_SHARDS
    if not any(hasattr(m, "peft_config") for m in model.modules()):
        return SAVED_COPY

    memory = trainable_tensors(model)  # the adapter, gathered one unit at a time (dist.gathered_parameters)
    if is_main:
        compare(memory, open_saved(Path(output_dir)), check_lora_b=False)
    return REGATHERED
