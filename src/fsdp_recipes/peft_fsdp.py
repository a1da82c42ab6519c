"""Workarounds for PEFT under FSDP, each a gap in the pinned versions (peft 0.21, accelerate 1.15).

1. An empty adapter under FSDP1 (`strip_fsdp1_wrapper_names`). PEFT picks the adapter's tensors out of the
   full state dict by module name, and removes FSDP's `_fsdp_wrapped_module.` only where it leads the name.
   FSDP1's auto-wrap puts it in the middle of every wrapped decoder layer's name
   (`...layers.0._fsdp_wrapped_module.self_attn.q_proj`), while the gathered state dict has it nowhere, so
   nothing matches: `save_pretrained` writes an adapter with no tensors, at every checkpoint and at the end.
   Found by the pack's final-save check on `make smoke RECIPE=mistral-small-lora`. The fix strips the wrapper
   names (and activation checkpointing's) from PEFT's prefixes wherever they occur.

2. PEFT `modules_to_save` on the output layer gets wrong gradients under accelerate's FSDP2.
   Gap this fills: accelerate 1.15's `fsdp2_prepare_model` puts `model.get_output_embeddings()` and the final norm
into one FSDP unit of their own (the "tail", `reshard_after_forward=False`). When the output layer is a PEFT
`ModulesToSaveWrapper` (e.g. `lora_modules_to_save: [lm_head]`), the trained copy's gradient comes out wrong
with more than one rank. Measured on the tiny recipe, one SGD step without clipping: the LM head's update
differs from a 1-process run of the same 16 samples by up to 5.1e-3 (a 2% change in its norm), while every LoRA
matrix agrees exactly. Left out of the tail unit, the wrapper falls into the root unit, and the update matches
the 1-process run exactly (difference 0.0). tests/test_grad_accumulation.py keeps that comparison.

The workaround hides the wrapper from the carve-out only while accelerate prepares the model: an instance
attribute shadows `get_output_embeddings` and is removed when training begins.
"""

from __future__ import annotations

from transformers import TrainerCallback

from fsdp_recipes import cpu_fsdp

WRAPPER_NAMES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


def strip_fsdp1_wrapper_names() -> None:
    """Patch PEFT's adapter-key prefixes to ignore FSDP1 / checkpoint wrapper names (workaround 1 above)."""
    from peft.tuners import tuners_utils

    original = tuners_utils._get_tuner_state_dict_key_prefixes
    if getattr(original, "_strips_wrappers", False):
        return

    def prefixes_without_wrappers(model, adapter_name=None):
        out = set()
        for prefix in original(model, adapter_name=adapter_name):
            for name in WRAPPER_NAMES:
                prefix = prefix.replace(name, "")
            out.add(prefix)
        return out

    prefixes_without_wrappers._strips_wrappers = True
    tuners_utils._get_tuner_state_dict_key_prefixes = prefixes_without_wrappers


def fsdp2_requested() -> bool:
    return cpu_fsdp.fsdp_requested() and cpu_fsdp.fsdp_version_from_env() == 2


def hide_wrapped_output_layer(model) -> bool:
    """Shadow get_output_embeddings on `model` when its output layer is a ModulesToSaveWrapper."""
    from peft.utils.other import ModulesToSaveWrapper

    get = getattr(model, "get_output_embeddings", None)
    if get is None or not isinstance(get(), ModulesToSaveWrapper):
        return False
    model.get_output_embeddings = lambda: None
    return True


class RestoreOutputEmbeddings(TrainerCallback):
    """Undo `hide_wrapped_output_layer` once accelerate has prepared (sharded) the model."""

    def __init__(self, model):
        self.model = model

    def on_train_begin(self, args, state, control, **kwargs):
        self.model.__dict__.pop("get_output_embeddings", None)
