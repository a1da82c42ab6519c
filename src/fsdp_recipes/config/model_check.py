"""Does the recipe fit the model's architecture? Checked on a meta-device copy, before anything is launched.

Gap it fills: the mistakes below surface on the cluster only after every rank has loaded the weights --
accelerate raises for an FSDP wrap class the model does not have, and PEFT silently skips a LoRA target
module that matches nothing as long as another target matches. Building the model from its config on
the meta device (no memory, a second or two even for 123B) lets us name the problem up front.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

from fsdp_recipes.errors import UserError


def model_config_source(model_name_or_path: str, recipe: Path | None) -> Path | None:
    """Where the model's config.json is known without the hub: a local model directory, else the recipe's
    shipped copy of the hub config (`model_config.json`) when it is for the same model."""
    local = Path(model_name_or_path) / "config.json"
    if local.is_file():
        return local
    shipped = recipe / "model_config.json" if recipe else None
    if shipped and shipped.is_file() and json.loads(shipped.read_text()).get("_name_or_path") == model_name_or_path:
        return shipped
    return None


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


def wrap_classes(acc: dict) -> list[str]:
    fsdp = acc.get("fsdp_config") or {}
    if acc.get("distributed_type") != "FSDP" or fsdp.get("fsdp_auto_wrap_policy") != "TRANSFORMER_BASED_WRAP":
        return []
    return [c.strip() for c in str(fsdp.get("fsdp_transformer_layer_cls_to_wrap") or "").split(",") if c.strip()]


def check_recipe_fits_model(model, acc: dict, acc_path, model_args) -> None:
    """The FSDP wrap class and the LoRA target modules / modules_to_save exist in `model`."""
    import torch

    arch = type(model).__name__
    classes = {type(m).__name__ for m in model.modules()}
    layer = ", ".join(sorted(getattr(model, "_no_split_modules", None) or ["?"]))
    for cls in wrap_classes(acc):
        if cls not in classes:
            raise UserError(
                f"{acc_path}: fsdp_transformer_layer_cls_to_wrap is {cls}, which {arch} does not have, so FSDP "
                f"could not wrap its layers. Fix: set fsdp_transformer_layer_cls_to_wrap: {layer}."
            )
    if not model_args.use_peft:
        return
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules() if name}
    linear = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
    targets = model_args.lora_target_modules
    if isinstance(targets, str) and targets != "all-linear":
        # One string is a regular expression PEFT matches against full module names (`--lora_target_modules
        # '[q_proj, v_proj]'` on the command line arrives as such a string, not a list).
        import re

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
                f"{', '.join(linear)}."
            )
    if isinstance(targets, list):
        missing = [t for t in targets if t not in names]
        if missing:
            raise UserError(
                f"lora_target_modules {missing} match no module of {arch} (its linear layers: {', '.join(linear)}). "
                "Fix: use names from that list."
            )
    missing = [m for m in (model_args.lora_modules_to_save or []) if m not in names]
    if missing:
        raise UserError(f"lora_modules_to_save {missing} match no module of {arch}. Fix: remove them or correct the names.")
    check_tied_modules_to_save(model, model_args.lora_modules_to_save or [])


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
                        "kept), or leave the embedding out, or train a model without tied embeddings.")


def check(model_name_or_path: str, recipe: Path | None, acc: dict, acc_path, model_args) -> bool:
    """Run the checks when the model's config is available offline; returns whether they ran."""
    source = model_config_source(model_name_or_path, recipe)
    if source is None:
        return False
    model = meta_model(load_config(source))
    check_recipe_fits_model(model, acc, acc_path, model_args)
    check_buffers_under_ram_efficient_loading(model, acc, acc_path)
    if source == Path(model_name_or_path) / "config.json":
        check_stored_tie(source.parent, model)
    return True


def check_buffers_under_ram_efficient_loading(model, acc: dict, acc_path) -> None:
    """FSDP2 with fsdp_cpu_ram_efficient_loading and a model whose state dict holds a buffer (DeepSeek-V3's and
    GLM-4.5's routers keep `e_score_correction_bias` as one): accelerate 1.15 broadcasts every state-dict entry as a
    sharded parameter, and every rank failed at setup with "'Tensor' object has no attribute 'device_mesh'"
    (accelerate issue 3898; scripts/arch_matrix.py found it)."""
    fsdp = acc.get("fsdp_config") or {}
    if acc.get("distributed_type") != "FSDP" or str(fsdp.get("fsdp_version")) != "2" or \
            str(fsdp.get("fsdp_cpu_ram_efficient_loading")).lower() != "true":
        return
    parameters = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    buffers = [name for name in model.state_dict() if name not in parameters]
    if buffers:
        raise UserError(f"{acc_path}: fsdp_cpu_ram_efficient_loading fails under FSDP2 for {type(model).__name__}, "
                        f"whose weights include {len(buffers)} buffer(s) ({buffers[0]}): accelerate 1.15 loads every "
                        "entry as a sharded parameter (accelerate issue 3898). Fix: set "
                        f"fsdp_cpu_ram_efficient_loading: false in {acc_path}.")


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


def check_attn_implementation(attn: str | None) -> None:
    if attn and attn.startswith("flash_attention") and importlib.util.find_spec("flash_attn") is None:
        raise UserError(
            f"attn_implementation: {attn} needs the flash-attn package, which is not installed. "
            "Fix: `pip install -e .[gpu]` on a CUDA machine, or use attn_implementation: sdpa."
        )


def looks_local(path: str) -> bool:
    """A hub id is `org/name`; anything absolute, relative-explicit, home- or file-like is a local path."""
    return path.startswith(("/", "./", "../", "~", "$")) or path.endswith(
        (".json", ".jsonl", ".parquet", ".csv")
    ) or os.path.exists(path)


def check_local_model(path: str, continues_from: str | None = None) -> None:
    """A local model folder must hold config.json. `continues_from`: the recipe whose output `path` is (a DPO run
    on the SFT run's merged model): then the fix is to run that recipe first."""
    check_not_an_adapter(path)
    # a hub id is `org/name`: a path with more parts (runs/<recipe>/merged) is the other run's output
    if continues_from and (looks_local(path) or path.count("/") > 1) and not (Path(path) / "config.json").is_file():
        raise UserError(
            f"model not found: {path} is the output of recipe {continues_from}, which has not run here yet. "
            f"Fix: run `make finetune RECIPE={continues_from}` first (or point model_name_or_path at another model)."
        )
    if looks_local(path) and not (Path(path) / "config.json").is_file():
        raise UserError(
            f"model not found: {path} has no config.json. "
            "Fix: point model_name_or_path at a model directory or a hub id "
            "(the tiny default is built by `python -m fsdp_recipes.assets.tiny_assets`)."
        )


def check_not_an_adapter(path: str) -> None:
    """A LoRA run's output folder (or one of its checkpoints) holds the adapter, not a model: adapter_config.json
    and no config.json. A recipe that trains on that run's model (DPO, GRPO after SFT) wants its `merged/`, which
    save_merged_model writes: named, with the path, instead of "has not run here yet"."""
    p = Path(os.path.expandvars(os.path.expanduser(path)))
    if not (p / "adapter_config.json").is_file() or (p / "config.json").is_file():
        return
    run = p.parent if p.name.startswith("checkpoint-") else p
    merged = run / "merged"
    try:
        base = json.loads((p / "adapter_config.json").read_text()).get("base_model_name_or_path")
    except (OSError, ValueError):
        base = None
    of = f" of {base}" if base else ""
    if (merged / "config.json").is_file():
        fix = f"set model_name_or_path to {merged} (the run's base model with this adapter merged into it)"
    else:
        fix = (f"rerun that recipe with --save_merged_model true, which writes {merged} (the base model with the "
               "adapter merged), and point model_name_or_path there")
    raise UserError(f"model_name_or_path {p} is a LoRA adapter{of} (adapter_config.json, no config.json), the output "
                    f"of a LoRA run, not a model to train. Fix: {fix}.")
