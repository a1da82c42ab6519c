"""Workarounds for PEFT under FSDP, each a gap found on peft 0.21 and accelerate 1.15 (checked on the ranges in
versions.py; each patch refuses, with one line, to apply outside them).

1. An empty adapter under FSDP1 (`strip_fsdp1_wrapper_names`). PEFT picks the adapter's tensors out of the
   full state dict by module name, and removes FSDP's `_fsdp_wrapped_module.` only where it leads the name.
   FSDP1's auto-wrap puts it in the middle of every wrapped decoder layer's name
   (`...layers.0._fsdp_wrapped_module.self_attn.q_proj`), while the gathered state dict has it nowhere, so
   nothing matches: `save_pretrained` writes an adapter with no tensors, at every checkpoint and at the end.
   Found by the pack's final-save check on `make smoke RECIPE=mistral-small-lora`. The fix strips the wrapper
   names (and activation checkpointing's) from PEFT's prefixes wherever they occur.

   Loading has the same gap, and it was silent (`load_adapter_through_fsdp1_root`). On resume, accelerate 1.15's
   `load_fsdp_model(adapter_only=True)` hands the FSDP1 root to peft 0.21's `set_peft_model_state_dict`, which
   (a) decides whether keys keep `base_model.model.` from `model.named_parameters()`, whose names here begin
   with `_fsdp_wrapped_module.`, so it strips the prefix from every key; and (b) builds the key map from
   `model.state_dict()`, which under FULL_STATE_DICT (rank0_only) is empty on every rank but 0, so those ranks
   do not even insert the adapter name. Its `load_state_dict(strict=False)` then loads none of the 56 LoRA
   tensors (56 unexpected keys), the Trainer ignores the result, and training resumes from the untrained
   adapter (tests/test_preemption.py, FULL and SHARDED: step-22 loss 5.69 instead of 2.33). Found by
   tests/test_preemption.py's FSDP1 LoRA resume; the keys were seen by printing that load's result. The fix
   runs PEFT's own loader on a view of the FSDP1 root with wrapper-free names and a key list every rank has,
   loads through the root (so FSDP's state-dict hooks still apply), and raises if a saved key matches nothing.
   resume_check.py verifies the result independently after every PEFT resume.

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

With tied embeddings (SmolLM2, Llama 3.2 1B/3B, Qwen3 0.6B-4B, Gemma) the wrapper's frozen original head holds the
input embedding's very Parameter. Hiding only the output layer made accelerate see no tie and carve the input
embedding into a unit of its own, while the same Parameter stayed in the root unit through the wrapper, and
torch 2.13's `fully_shard` refuses that ("Parameter ... embed_tokens.weight is shared with a parameter already
managed by another FSDP group"). So for a tied head the input embedding is hidden too: embedding, frozen head
and trained copy all stay in the root unit, the Parameter in one group (tests/test_tied_embeddings.py).

3. PEFT `modules_to_save` on the output layer cannot train under FSDP1 with TRL 1.16 (`keep_fsdp1_output_layer_in_root`).
   transformers 5.23 gives FSDP1 PEFT's auto-wrap policy, which makes every leaf module with a trainable weight
   an FSDP unit of its own, the LM head's trainable copy included. FSDP1 unshards a unit's parameters only
   around that unit's forward, and TRL's fused LM head never calls the head's forward: it multiplies by
   `lm_head.weight` directly, which is then the flat local shard ("mat2 must be a matrix" at the first step).
   The fix leaves the output layer out of the auto-wrap, so its parameters belong to the root unit, which is
   unsharded for the whole forward (use_orig_params keeps the frozen and the trainable copy apart).
   tests/test_fsdp1.py compares the trained adapter, LM head included, with a 1-process run of the same samples.
   Saving a checkpoint then failed on rank 1 (`KeyError: 'modules_to_save.default.weight'`): under
   FULL_STATE_DICT (rank0_only) the other ranks' state dict is empty, and PEFT's
   `ModulesToSaveWrapper.adapter_state_dict` indexes it. The wrapper now gives nothing from an empty state dict;
   a state dict that has entries but lacks the key still raises.

4. A tied LM head or input embedding that PEFT wraps cannot be re-tied by accelerate's FSDP2 RAM-efficient loading
   (`tie_through_peft_wrappers`). With `fsdp_cpu_ram_efficient_loading` (every recipe's FSDP2 YAML), accelerate 1.15's
   `fsdp2_prepare_model` moves the model to meta and calls `model.tie_weights()`, before sharding and again after
   loading rank 0's weights. transformers 5's `tie_weights` does `setattr(lm_head, "weight", embedding.weight)`; when
   PEFT has replaced `lm_head` by a wrapper (`lora_modules_to_save: [lm_head]`: ModulesToSaveWrapper; `lm_head` as a
   LoRA target: lora.Linear), `weight` is the wrapper's read-only property and torch raises `KeyError: "attribute
   'weight' already exists"` on every rank before the first step (issue 61, the default with lm_head to save). The
   workaround shadows `tie_weights` on the PEFT model while accelerate prepares it, with one that ties the wrapped
   layers' base weights (the frozen head the wrapper keeps) to the embedding's, the tie transformers would make.
   tests/test_tied_embeddings.py prepares each tied option with RAM-efficient loading.
"""

from __future__ import annotations

from transformers import TrainerCallback

from fsdp_recipes.patches import cpu_fsdp
from fsdp_recipes.patches.guard import record, target
from fsdp_recipes.patches.versions import checked_on

WRAPPER_NAMES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


def strip_fsdp1_wrapper_names() -> None:
    """Patch PEFT's adapter-key prefixes to ignore FSDP1 / checkpoint wrapper names (workaround 1 above)."""
    from peft.tuners import tuners_utils

    if getattr(tuners_utils._get_tuner_state_dict_key_prefixes, "_strips_wrappers", False):
        return
    original = target(tuners_utils, "_get_tuner_state_dict_key_prefixes", ("model", "adapter_name"),
                      patch="peft_fsdp.strip_fsdp1_wrapper_names", checked_on=checked_on("peft", "accelerate"))

    def prefixes_without_wrappers(model, adapter_name=None):
        return {without_wrapper_names(prefix) for prefix in original(model, adapter_name=adapter_name)}

    prefixes_without_wrappers._strips_wrappers = True
    prefixes_without_wrappers.__wrapped__ = original  # inspect.unwrap finds the library's function (tests restore it)
    tuners_utils._get_tuner_state_dict_key_prefixes = prefixes_without_wrappers
    record("peft_fsdp.strip_fsdp1_wrapper_names", "peft.tuners.tuners_utils._get_tuner_state_dict_key_prefixes",
           "FSDP1's wrapper names in the middle of module names: PEFT saves an empty adapter")


def without_wrapper_names(name: str) -> str:
    """`a._fsdp_wrapped_module.b` -> `a.b` (also a trailing or leading wrapper name, and checkpoint wrappers)."""
    return ".".join(part for part in name.split(".") if part + "." not in WRAPPER_NAMES)


class _Fsdp1RootView:
    """The FSDP1 root as `set_peft_model_state_dict` must see it (workaround 1, loading): the names of the
    gathered state dict, known on every rank, and `load_state_dict` through the root. Everything else is the root's.
    """

    def __init__(self, root):
        self._root = root

    def __getattr__(self, name):
        return getattr(self._root, name)

    def named_parameters(self, *args, **kwargs):
        return [(without_wrapper_names(n), p) for n, p in self._root.named_parameters(*args, **kwargs)]

    def named_modules(self, *args, **kwargs):
        return [(without_wrapper_names(n), m) for n, m in self._root.named_modules(*args, **kwargs)]

    def state_dict(self, *args, **kwargs):  # PEFT uses only its keys (and shapes when ignoring mismatched sizes)
        tensors = list(self._root.named_parameters()) + list(self._root.named_buffers())
        return {without_wrapper_names(n): t for n, t in tensors}

    def load_state_dict(self, state_dict, strict=True, assign=False):
        return self._root.load_state_dict(state_dict, strict=strict, assign=assign)


def load_adapter_through_fsdp1_root() -> None:
    """Patch `peft.set_peft_model_state_dict` (accelerate imports it at call time) for FSDP1 roots (workaround 1)."""
    import peft
    from torch.distributed.fsdp import FullyShardedDataParallel

    if getattr(peft.set_peft_model_state_dict, "_fsdp1_view", False):
        return
    original = target(peft, "set_peft_model_state_dict",
                      ("model", "peft_model_state_dict", "adapter_name", "ignore_mismatched_sizes", "low_cpu_mem_usage"),
                      patch="peft_fsdp.load_adapter_through_fsdp1_root", checked_on=checked_on("peft", "accelerate"))

    def set_peft_model_state_dict(model, peft_model_state_dict, adapter_name="default", **kwargs):
        if not isinstance(model, FullyShardedDataParallel):  # FSDP2, or no FSDP: PEFT as it is
            return original(model, peft_model_state_dict, adapter_name=adapter_name, **kwargs)
        result = original(_Fsdp1RootView(model), peft_model_state_dict, adapter_name=adapter_name, **kwargs)
        if result.unexpected_keys:  # a saved adapter tensor that matched no parameter: never resume silently
            raise RuntimeError(
                f"FSDP1: {len(result.unexpected_keys)} saved adapter tensors matched no parameter when loading "
                f"(e.g. {result.unexpected_keys[0]}); the adapter was not restored"
            )
        return result

    set_peft_model_state_dict._fsdp1_view = True
    set_peft_model_state_dict.__wrapped__ = original  # inspect.unwrap finds the library's function (tests restore it)
    peft.set_peft_model_state_dict = set_peft_model_state_dict
    record("peft_fsdp.load_adapter_through_fsdp1_root", "peft.set_peft_model_state_dict",
           "an FSDP1 resume loads none of the adapter's tensors")


def fsdp2_requested() -> bool:
    return cpu_fsdp.fsdp_requested() and cpu_fsdp.fsdp_version_from_env() == 2


def hide_wrapped_output_layer(model) -> bool:
    """Shadow get_output_embeddings on `model` when its output layer is a ModulesToSaveWrapper, and
    get_input_embeddings too when that layer's frozen original is tied to the input embedding (workaround 2)."""
    from peft.utils.other import ModulesToSaveWrapper

    get = getattr(model, "get_output_embeddings", None)
    head = get() if get is not None else None
    if not isinstance(head, ModulesToSaveWrapper):
        return False
    embed = getattr(model, "get_input_embeddings", lambda: None)()
    tied = embed is not None and getattr(head.original_module, "weight", None) is getattr(embed, "weight", None)
    model.get_output_embeddings = lambda: None
    if tied:
        model.get_input_embeddings = lambda: None
    return True


def prepare_wrapped_embeddings_for_fsdp2(model) -> bool:
    """Workarounds 2 and 4 on the model the Trainer will hand to accelerate's FSDP2 preparation; whether either
    applied (then RestoreOutputEmbeddings must undo them when training begins)."""
    hidden = hide_wrapped_output_layer(model)
    tied = tie_through_peft_wrappers(model)  # both on a trained copy of a tied head: no short-circuit
    return hidden or tied


def tie_through_peft_wrappers(model) -> bool:
    """Shadow `tie_weights` on a PEFT model of a tied model whose LM head or input embedding PEFT wrapped, with one
    that ties the wrapped layers' base weights (workaround 4). Whether it did."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else None
    if inner is None or not getattr(getattr(inner, "config", None), "tie_word_embeddings", False):
        return False
    head, embedding = inner.get_output_embeddings(), inner.get_input_embeddings()
    if head is None or embedding is None or (head is unwrapped(head) and embedding is unwrapped(embedding)):
        return False

    def tie_weights(*args, **kwargs):  # what transformers' tie_weights does for an unwrapped model
        unwrapped(head).weight = unwrapped(embedding).weight

    model.tie_weights = tie_weights
    return True


def unwrapped(module):
    """The layer PEFT wrapped: a LoRA layer's base layer, a modules_to_save wrapper's frozen original."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import ModulesToSaveWrapper

    while True:
        if isinstance(module, ModulesToSaveWrapper):
            module = module.original_module
        elif isinstance(module, BaseTunerLayer):
            module = module.get_base_layer()
        else:
            return module


class RestoreOutputEmbeddings(TrainerCallback):
    """Undo `hide_wrapped_output_layer` and `tie_through_peft_wrappers` once accelerate has prepared (sharded) the
    model."""

    def __init__(self, model):
        self.model = model

    def on_train_begin(self, args, state, control, **kwargs):
        for name in ("get_output_embeddings", "get_input_embeddings", "tie_weights"):
            self.model.__dict__.pop(name, None)


def keep_fsdp1_output_layer_in_root() -> None:
    """Workaround 3: wrap transformers' `update_fsdp_plugin_peft` (it installs PEFT's auto-wrap policy when the
    Trainer prepares the model) so that, under FSDP1, the policy skips a ModulesToSaveWrapper output layer."""
    import transformers.trainer
    from peft.utils.other import ModulesToSaveWrapper

    if getattr(transformers.trainer.update_fsdp_plugin_peft, "_keeps_output_layer", False):
        return
    versions = checked_on("transformers", "trl", "peft", "accelerate")
    original = target(transformers.trainer, "update_fsdp_plugin_peft", ("model", "accelerator"),
                      patch="peft_fsdp.keep_fsdp1_output_layer_in_root", checked_on=versions)
    adapter_state_dict = target(ModulesToSaveWrapper, "adapter_state_dict", ("self", "adapter_name", "state_dict"),
                                patch="peft_fsdp.keep_fsdp1_output_layer_in_root", checked_on=versions)

    def update_fsdp_plugin_peft(model, accelerator):
        original(model, accelerator)
        plugin = accelerator.state.fsdp_plugin
        get = getattr(model, "get_output_embeddings", None)
        head = get() if get is not None else None
        if plugin.fsdp_version != 1 or plugin.auto_wrap_policy is None or not isinstance(head, ModulesToSaveWrapper):
            return
        policy, in_head = plugin.auto_wrap_policy, set(head.modules())

        def policy_without_output_layer(module, recurse, nonwrapped_numel):
            if not recurse and module in in_head:
                return False  # not a unit of its own: its parameters stay in the root unit
            return policy(module=module, recurse=recurse, nonwrapped_numel=nonwrapped_numel)

        plugin.auto_wrap_policy = policy_without_output_layer

    update_fsdp_plugin_peft._keeps_output_layer = True
    update_fsdp_plugin_peft.__wrapped__ = original  # inspect.unwrap finds the library's function (tests restore it)
    transformers.trainer.update_fsdp_plugin_peft = update_fsdp_plugin_peft

    def adapter_state_dict_of_any_rank(self, adapter_name, state_dict):
        if not state_dict:  # a rank > 0 under a rank0_only full state dict holds nothing to select from
            return {}
        return adapter_state_dict(self, adapter_name, state_dict)

    adapter_state_dict_of_any_rank.__wrapped__ = adapter_state_dict
    ModulesToSaveWrapper.adapter_state_dict = adapter_state_dict_of_any_rank
    record("peft_fsdp.keep_fsdp1_output_layer_in_root",
           "transformers.trainer.update_fsdp_plugin_peft, peft.utils.other.ModulesToSaveWrapper.adapter_state_dict",
           "FSDP1 shards a trained LM head that TRL's fused loss reads unsharded")
