"""Check that every rank trains on the weights in the checkpoint file, after loading and sharding.

With `fsdp_cpu_ram_efficient_loading` only rank 0 reads the file; the other ranks start from empty (meta)
tensors and receive rank 0's weights by broadcast while accelerate shards the model. If that step is
skipped or broken the other ranks train on garbage without an error. This check gathers each parameter
at the start of training (a collective) and compares it on rank 0 with the file, by name.

It costs one all-gather of the model, so it is opt-in (`verify_loaded_weights: true`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import TrainerCallback

from fsdp_recipes.checkpoint.save_check import safetensors_index
from fsdp_recipes.dist import gather_objects, gathered_parameters, rank
from fsdp_recipes.patches.peft_fsdp import without_wrapper_names


def file_key(param_name: str) -> str | None:
    """The checkpoint-file name of a (possibly PEFT-wrapped) parameter; None for adapter weights."""
    if "lora_" in param_name:
        return None
    name = without_wrapper_names(param_name).removeprefix("base_model.model.")
    for wrapper in (".base_layer", ".original_module", ".modules_to_save.default"):
        name = name.replace(wrapper, "")
    return name


def verify_loaded_weights(model, model_dir: str | Path, is_main: bool) -> dict | None:
    """Every rank must call this (it gathers). Raises on rank 0 when a weight differs."""
    where = safetensors_index(model_dir) if is_main else {}
    checked, problems = 0, []
    with gathered_parameters(model) as params:
        for name, full in params:
            key = file_key(name)
            if not is_main or key is None or key not in where:
                continue
            expected = where[key].get_tensor(key)
            checked += 1
            full = full.detach().cpu()
            if tuple(full.shape) != tuple(expected.shape) or not torch.equal(full, expected.to(full.dtype)):
                problems.append(name)
    if is_main and checked == 0:
        raise RuntimeError(f"no parameter of the model matched a tensor in {model_dir}: cannot verify the load")
    if is_main and problems:
        raise RuntimeError(
            f"{len(problems)} parameters differ from {model_dir} after loading and sharding (e.g. {problems[0]}): "
            "the ranks did not all receive the checkpoint's weights"
        )
    return {"parameters_checked": checked} if is_main else None


class LoadCheckCallback(TrainerCallback):
    """Run the check once, when training begins (weights loaded and sharded, no step taken)."""

    def __init__(self, model_dir: str, report=None):
        self.model_dir, self.report = model_dir, report

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        result = verify_loaded_weights(model, self.model_dir, rank() == 0)
        if result is not None:
            print(f"[train] loaded weights verified: {result['parameters_checked']} parameters equal "
                  f"{self.model_dir} on every rank", flush=True)
            if self.report is not None:
                self.report.load_check = result


def embeddings_shared(model) -> bool | None:
    """Whether this rank's output layer still uses the input embedding's storage; None for an untied model.

    Gap it guards: RAM-efficient loading has untied tied embeddings before (verl issue 7834: the ranks that load on
    the meta device got a separate, never-loaded LM head). A PEFT `modules_to_save` head is a trained copy by
    design, so only the head's base weight is compared."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(inner, "config", None)
    if not getattr(config, "tie_word_embeddings", False):
        return None
    head = inner.get_output_embeddings()
    head = getattr(head, "original_module", head)  # PEFT's ModulesToSaveWrapper keeps the tied one there
    a, b = inner.get_input_embeddings().weight, head.weight
    local = [getattr(w, "_local_tensor", w) for w in (a, b)]  # FSDP2: each rank's shard of the DTensor
    return a is b or local[0].untyped_storage().data_ptr() == local[1].untyped_storage().data_ptr()


class TiedEmbeddingsCheck(TrainerCallback):
    """When training begins, every rank's LM head of a tied model must share the input embedding's storage
    (metrics.json `tied_embeddings`); one that does not stops the run before its first step."""

    def __init__(self, report=None):
        self.report = report

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        shared = gather_objects(embeddings_shared(model))
        if shared[0] is None:
            return
        if self.report is not None:
            self.report.tied_embeddings = {"shared_on_ranks": shared}
        if not all(shared):
            raise RuntimeError(f"the model ties its input and output embeddings, but on rank(s) "
                               f"{[r for r, s in enumerate(shared) if not s]} the LM head no longer shares the "
                               f"embedding's storage after loading and sharding: those ranks would train an untied, "
                               f"unloaded head")
