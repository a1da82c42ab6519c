"""Does the recipe fit the model's architecture? Checked on a meta-device copy, before anything is launched.

Gap it fills: the mistakes below surface on the cluster only after every rank has loaded the weights --
accelerate raises for an FSDP wrap class the model does not have, and PEFT silently skips a LoRA target
module that matches nothing as long as another target matches. Building the model from its config on
the meta device (no memory, a second or two even for 123B) lets us name the problem up front.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from fsdp_recipes import decoder
from fsdp_recipes.config import expert_lora
from fsdp_recipes.config.model_found import model_config_source
from fsdp_recipes.errors import UserError


def load_config(config_json: Path):
    """The real loading code (AutoConfig.from_pretrained) on a directory holding just this config.json."""
    import tempfile

    from transformers import AutoConfig

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(config_json.read_text())
        return AutoConfig.from_pretrained(tmp)


def meta_model(config):
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


WRAP_KEY = "fsdp_transformer_layer_cls_to_wrap"


def wraps_by_class(acc: dict) -> bool:
    fsdp = acc.get("fsdp_config") or {}
    return acc.get("distributed_type") == "FSDP" and fsdp.get("fsdp_auto_wrap_policy") == "TRANSFORMER_BASED_WRAP"


def wrap_classes(acc: dict) -> list[str]:
    if not wraps_by_class(acc):
        return []
    return [c.strip() for c in str(acc["fsdp_config"].get(WRAP_KEY) or "").split(",") if c.strip()]


def fsdp_wrapped(model, acc: dict) -> dict[str, int] | None:
    """Class name -> how many of `model`'s modules FSDP gives a unit of their own, decided by accelerate's own code as
    the ranks will run it (without fsdp_transformer_layer_cls_to_wrap accelerate takes the model's
    `_no_split_modules`); None where the config does not wrap by layer class. Raises accelerate's ValueError for a
    class the model lacks."""
    if not wraps_by_class(acc):
        return None
    import functools
    from collections import Counter

    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy

    plugin = FullyShardedDataParallelPlugin(fsdp_version=int(acc["fsdp_config"].get("fsdp_version", 1)),
                                            auto_wrap_policy="TRANSFORMER_BASED_WRAP",
                                            transformer_cls_names_to_wrap=wrap_classes(acc) or None)
    if plugin.fsdp_version == 2:  # as accelerate's fsdp2_prepare_model, and FSDP1's prepare below
        policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
    else:
        plugin.set_auto_wrap_policy(model)
        policy = functools.partial(plugin.auto_wrap_policy, recurse=False, nonwrapped_numel=0)
    return dict(Counter(type(m).__name__ for m in model.modules() if policy(m)))


class Wrap(NamedTuple):
    """check_wrap_classes' answer: the line that says which classes FSDP wraps, whether it is a warning, and the
    classes the pack chose instead of the config's (empty: the config's, or accelerate's own choice, stand)."""

    line: str
    warning: bool
    chosen: tuple[str, ...] = ()


def decoder_layer_class(model) -> str:
    """The class of the layers in the model's decoder layer list (decoder.py), for a model that names none in its
    _no_split_modules (BioGPT): what the fix names."""
    try:
        return ",".join(sorted({type(m).__name__ for m in decoder.layers(model)[1]}))
    except UserError:
        return "<its decoder layer class>"


def check_wrap_classes(model, acc: dict, acc_path, on_command_line: bool = False,
                       model_named: bool = False) -> Wrap | None:
    """The wrap classes exist in `model`; returns the line that says which classes FSDP wraps (and whether it is a
    warning), None where the config does not wrap by layer class. `on_command_line`: the classes came from
    --fsdp_transformer_layer_cls_to_wrap, not from `acc_path`. `model_named`: the command line names the model,
    not the recipe's own: a class `acc_path` names for the recipe's model and this one lacks gives way to the
    model's own layer classes (its _no_split_modules, what accelerate takes where no class is named), which `chosen`
    carries for `accelerate launch`; a class the user wrote on the command line, or one the recipe's own model lacks,
    stays a mistake."""
    arch = type(model).__name__
    classes = {type(m).__name__ for m in model.modules()}
    own = sorted(getattr(model, "_no_split_modules", None) or [])  # a set in many models: in a stable order
    present = [c for c in own if c in classes]
    layer = ",".join(present) or decoder_layer_class(model)  # as accelerate reads it: split at commas, not stripped
    named = wrap_classes(acc)
    where = f"--{WRAP_KEY} on the command line" if on_command_line else f"{WRAP_KEY} in {acc_path}"
    written = str((acc.get("fsdp_config") or {}).get(WRAP_KEY) or "")
    if named and written != ",".join(named):
        raise UserError(f"{where} is {written!r}: accelerate splits it at the commas and keeps the spaces, so it "
                        f"would look for classes named {written.split(',')}. Fix: write it as {','.join(named)}.")
    missing = [cls for cls in named if cls not in classes]
    if missing and model_named and not on_command_line and present:
        chosen = dict(acc, fsdp_config=dict(acc["fsdp_config"], **{WRAP_KEY: ",".join(present)}))
        each = " and each ".join(f"{cls} ({n} of them)" for cls, n in fsdp_wrapped(model, chosen).items())
        return Wrap(f"FSDP wraps each {each} in {arch}, the model on the command line: its own layer classes (its "
                    f"_no_split_modules), since {acc_path} names {','.join(missing)}, written for the recipe's model, "
                    f"which {arch} does not have (accelerate launch gets --{WRAP_KEY} {layer})", False, tuple(present))
    if missing:
        cls, cli = missing[0], f"--{WRAP_KEY} {layer}"
        own_fix = f"the pack then wraps {arch}'s own layer classes ({layer}, its _no_split_modules)"
        if on_command_line:
            fix = f"pass {cli} instead" + (f", or leave the option out (where {acc_path} sets no {WRAP_KEY} "
                                           f"either, {own_fix})" if present else "")
        else:
            fix = f"set it to {layer} (for one run: {cli} on the command line)" + (
                f", or remove the key: {own_fix}" if present else "")
        raise UserError(f"{where} is {cls}, which {arch} does not have, so FSDP could not wrap its layers. "
                        f"Fix: {fix}.")
    if not wraps_by_class(acc):
        return None
    if not named and len(present) < len(own):  # accelerate would raise at its prepare, in every rank
        raise UserError(f"{acc_path} sets no {WRAP_KEY}, so accelerate takes {arch}'s _no_split_modules "
                        f"({', '.join(own)}), and {arch} has no {', '.join(c for c in own if c not in classes)} "
                        f"module: FSDP could not wrap its layers. Fix: set {WRAP_KEY}: {layer} in {acc_path}.")
    wrapped = fsdp_wrapped(model, acc)
    if not wrapped:
        return Wrap(f"FSDP wraps no layer of {arch} on its own: {arch} lists no _no_split_modules, so the whole model "
                    f"is one FSDP unit, gathered whole on every rank. Fix: set {WRAP_KEY}: {layer} in {acc_path}",
                    True)
    each = " and each ".join(f"{cls} ({n} of them)" for cls, n in wrapped.items())
    if named:
        return Wrap(f"FSDP wraps each {each} in {arch}, as {where} says", False)
    return Wrap(f"FSDP wraps each {each} in {arch}: its own layer classes (its _no_split_modules), which accelerate "
                f"takes where {acc_path} sets no {WRAP_KEY}", False)


def check_recipe_fits_model(model, acc: dict, acc_path, model_args, wrap_on_command_line: bool = False,
                            model_named: bool = False) -> Wrap | None:
    """The FSDP wrap class and the LoRA target modules / parameters / modules_to_save exist in `model`. Returns
    check_wrap_classes' answer."""
    import torch
    from transformers.pytorch_utils import Conv1D

    arch = type(model).__name__
    wrap = check_wrap_classes(model, acc, acc_path, wrap_on_command_line, model_named)
    if not model_args.use_peft:
        return wrap
    expert_lora.check(model, acc, acc_path, model_args)  # LoRA on fused MoE experts: before "matches no module"
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules() if name}
    # what PEFT's all-linear targets: Linear and transformers' Conv1D (GPT-2's c_attn ...), not the LM head, whose
    # LoRA check_lora_on_output_layer refuses
    head = model.get_output_embeddings()
    linear = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                     if isinstance(m, (torch.nn.Linear, Conv1D)) and m is not head})
    targets = model_args.lora_target_modules
    if isinstance(targets, str) and targets != "all-linear":
        # One string is a regular expression PEFT matches against full module names (`--lora_target_modules
        # '[q_proj, v_proj]'` on the command line arrives as such a string, not a list).
        full = [name for name, _ in model.named_modules() if name]
        try:
            matched = any(re.fullmatch(targets, name) for name in full)
        except re.error:
            matched = False
        if not matched:
            raise UserError(
                f"lora_target_modules {targets!r} is one string, which PEFT reads as a regular expression over full "
                f"module names, and it matches no module of {arch}. Fix: give names separated by spaces on the "
                f"command line (--lora_target_modules q_proj v_proj) or a YAML list; {arch}'s linear layers: "
                f"{', '.join(linear)}.")
    if isinstance(targets, list):
        missing = [t for t in targets if t not in names]
        if missing:
            raise UserError(
                f"lora_target_modules {missing} match no module of {arch} (its linear layers: {', '.join(linear)}). "
                "Fix: use names from that list.")
    missing = [m for m in (model_args.lora_modules_to_save or []) if m not in names]
    if missing:
        raise UserError(f"lora_modules_to_save {missing} match no module of {arch}. Fix: remove them or correct the names.")
    check_tied_modules_to_save(model, model_args.lora_modules_to_save or [])
    check_lora_on_output_layer(model, targets, getattr(model_args, "lora_target_parameters", None))
    return wrap


def check_lora_on_output_layer(model, targets, target_parameters) -> None:
    """A LoRA adapter on the LM head (`lm_head` in lora_target_modules, or its weight in lora_target_parameters):
    TRL 1.16's trainers (SFT, DPO, KTO, GRPO, RLOO) compute the log-probabilities from the head's weight directly, so
    the adapter would never train, and each refuses it in every rank's setup ("Applying a PEFT adapter to `lm_head`
    is not supported"; measured on the default, issue 61). Named here before any rank starts, with the way that
    works: the whole head trained (modules_to_save; on a tied model an untied copy, patches/peft_fsdp.py)."""
    head = model.get_output_embeddings()
    named = [name for name, m in model.named_modules() if m is head and name]
    if not named:
        return
    name, leaf = named[0], named[0].rsplit(".", 1)[-1]
    if isinstance(targets, str):
        try:
            hit = targets != "all-linear" and re.fullmatch(targets, name) is not None  # PEFT's own matching
        except re.error:
            hit = False
        setting = f"lora_target_modules {targets!r}"
    else:
        hit = any(name == t or name.endswith("." + t) for t in targets or [])
        setting = f"lora_target_modules {list(targets or [])}"
    if not hit:
        weight = f"{name}.weight"
        hit = any(weight == p or weight.endswith("." + p) for p in target_parameters or [])
        setting = f"lora_target_parameters {list(target_parameters or [])}"
    if hit:
        tied = " (an untied trained copy; the embedding stays as it is)" if \
            getattr(model.config, "tie_word_embeddings", False) else ""
        raise UserError(f"{setting} puts a LoRA adapter on {name}, the LM head of {type(model).__name__}: TRL's "
                        f"trainers compute the log-probabilities from {name}.weight directly, so that adapter would "
                        f"never train (TRL 1.16 refuses it on every rank). Fix: train the whole head instead "
                        f"(lora_modules_to_save: [{leaf}]{tied}), or leave {leaf} out of the LoRA targets.")


def check_tied_modules_to_save(model, modules_to_save: list[str]) -> None:
    """A model whose LM head is its input embedding (tie_word_embeddings: SmolLM2, Llama 3.2 1B/3B, Qwen3 0.6B-4B,
    Gemma) cannot train a copy of the input embedding: PEFT's ModulesToSaveWrapper gives the embedding a trained copy
    while the head keeps the original, so the tie breaks in training (the merged model, whose config still ties them,
    would load the trained embedding as its head), and under FSDP2 the one tied Parameter lands in two groups
    (torch: "is shared with a parameter already managed by another FSDP group", at the first step on every rank).
    The head alone works: its trained copy is the untied head the merge writes (patches/peft_fsdp.py, workaround 2)."""
    if not modules_to_save or not getattr(model.config, "tie_word_embeddings", False):
        return
    embedding = model.get_input_embeddings()
    named = [name for name, m in model.named_modules() if m is embedding]
    leaf = named[0].rsplit(".", 1)[-1] if named else None
    hit = [m for m in modules_to_save if leaf and (m == leaf or m == named[0] or named[0].endswith("." + m))]
    if hit:
        head = [name for name, m in model.named_modules() if m is model.get_output_embeddings()]
        head_name = head[0].rsplit(".", 1)[-1] if head else "lm_head"
        way = f"lora_modules_to_save: {[head_name, *[m for m in modules_to_save if m not in hit + [head_name]]]}"
        raise UserError(f"lora_modules_to_save names {hit[0]}, the input embedding of {type(model).__name__}, whose "
                        f"LM head {head_name} is tied to it (tie_word_embeddings): PEFT would train a copy of the "
                        "embedding the head no longer shares, and FSDP cannot shard the tied weight in two groups. "
                        f"Fix: train the head instead ({way}: an untied trained copy of the head, the embedding "
                        f"kept), or a LoRA on the embedding ({hit[0]} in lora_target_modules: the head keeps the "
                        "base weights), or leave the embedding out, or train a model without tied embeddings.")


def check(model_name_or_path: str, recipe: Path | None, acc: dict, acc_path, model_args,
          wrap_on_command_line: bool = False, more: Callable | None = None, model_named: bool = False) -> Wrap | None:
    """Run the checks when the model's config is available offline (its own, or the recipe's copy); returns which
    layers FSDP wraps (check_wrap_classes), None where the checks did not run or FSDP does not wrap by class.
    `more(model, acc, acc_path)`: the caller's own checks of the meta-device model (the speed options', speed/)."""
    source = model_config_source(model_name_or_path, recipe, getattr(model_args, "model_revision", None))
    if source is None or getattr(model_args, "trust_remote_code", False):  # its code, not transformers', builds it
        return None
    model = meta_model(load_config(source))
    wrap = check_recipe_fits_model(model, acc, acc_path, model_args, wrap_on_command_line, model_named)
    if more is not None:
        more(model, acc, acc_path)
    if source == Path(model_name_or_path) / "config.json":
        check_stored_tie(source.parent, model)
    return wrap


def check_stored_tie(folder: Path, model) -> None:
    """A config that ties the LM head to the input embedding (tie_word_embeddings) over weights that store a
    different head: transformers then loads the head untied ("both are present in the checkpoints with different
    values, so we will NOT tie them"), and the ranks disagree on the model's shape -- FSDP2's setup failed with
    `KeyError: "attribute 'weight' already exists"`, FSDP1's with a gloo size mismatch, and without RAM-efficient
    loading the pack's own tie check stopped every rank (measured on the tiny model, its config set to tie). Compared
    here on a few rows of the two stored tensors, read lazily from the safetensors files."""
    if not getattr(model.config, "tie_word_embeddings", False):
        return
    names = {m: n for n, m in model.named_modules()}
    head, embedding = (names.get(model.get_output_embeddings()), names.get(model.get_input_embeddings()))
    if not head or not embedding:
        return
    head_key, embedding_key = f"{head}.weight", f"{embedding}.weight"
    index = folder / "model.safetensors.index.json"
    try:
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map", {})
            files = {k: folder / weight_map[k] for k in (head_key, embedding_key) if k in weight_map}
        else:
            files = {k: folder / "model.safetensors" for k in (head_key, embedding_key)}
        if head_key not in files or not all(f.is_file() for f in files.values()):
            return
        from safetensors import safe_open

        rows = []
        for key in (head_key, embedding_key):
            with safe_open(str(files[key]), framework="pt") as f:
                if key not in f.keys():
                    return  # the usual tied checkpoint: the head is not stored
                tensor = f.get_slice(key)
                n = tensor.get_shape()[0]
                rows.append((tensor[:8], tensor[max(n - 8, 0):]))
    except (OSError, ValueError):
        return  # not ours to judge a file the loader will name
    import torch

    if all(torch.equal(a, b) for a, b in zip(*rows)):
        return  # stored twice but equal: transformers ties them
    raise UserError(f"{folder}/config.json ties the LM head to the input embedding (tie_word_embeddings: true), but "
                    f"the weights store a {head_key} that differs from {embedding_key}: transformers loads it untied, "
                    "and the ranks disagree on the model's shape (FSDP's setup fails). Fix: set "
                    f"tie_word_embeddings to false in {folder}/config.json (the stored weights are untied), or save "
                    "the model again with its head tied.")
