"""`fsdp_cpu_ram_efficient_loading: true` in a recipe's accelerate YAML: only each node's first rank reads the weights.
The model every other rank starts from is the architecture on the meta device, no weight read.

Gap it fills: transformers 5.x reads every weight of the checkpoint on every rank even with RAM-efficient loading
(transformers issue 43749, reported on 5.0, open; measured on 5.23 by tests/test_default_recipe.py: rank 1 read all
538 MB of SmolLM2-135M). accelerate then moves every rank's model to meta and broadcasts rank 0's weights while it
shards (FSDP2: `fsdp2_load_full_state_dict`; FSDP1: `sync_module_states` after `param_init_fn`), so what the other
ranks read is thrown away: N reads of the file, and each rank's host memory rising by the model's size at once.

How: `from_pretrained(None, config=..., state_dict={})`, transformers' documented way to build a pretrained
architecture from weights of one's own, here none. Its FSDP branch (`is_fsdp_enabled()`, not local rank 0) then leaves
every parameter on meta, ties the embeddings, and computes the non-persistent buffers (rotary frequencies) for real,
which accelerate keeps; the parameters then get storage that is never written (unallocated_parameters). No library
function is replaced. TRL receives the model object instead of the path; with
`config._name_or_path` set it loads the tokenizer from the same folder. Rank 0 still loads through TRL's own path.
"""

from __future__ import annotations

import os

from fsdp_recipes.config import accelerate_values
from fsdp_recipes.errors import UserError

FIELDS = ("fsdp_cpu_ram_efficient_loading",)  # accelerate's FSDP setting (the recipe's accelerate.yaml)


def enabled(cfg) -> bool:
    """In the ranks, from accelerate's environment (the launcher and the planner read the YAML itself)."""
    return os.environ.get("FSDP_CPU_RAM_EFFICIENT_LOADING", "").lower() in ("true", "1")


def check_accelerate(acc: dict, path) -> None:
    """FSDP1 with RAM-efficient loading needs the broadcast of rank 0's weights (the accelerate YAML alone)."""
    fsdp = acc.get("fsdp_config") or {}
    value = fsdp.get("fsdp_cpu_ram_efficient_loading")
    if value is not None and not accelerate_values.yes_no(value):  # the other FSDP yes/no keys: accelerate_values
        accelerate_values.bad(path, "fsdp_config.fsdp_cpu_ram_efficient_loading", value, ["true", "false"],
                              "true or false")
    if acc.get("distributed_type") == "FSDP" and int(fsdp.get("fsdp_version", 1)) == 1 and \
            fsdp.get("fsdp_cpu_ram_efficient_loading") and not fsdp.get("fsdp_sync_module_states"):
        raise UserError(
            f"{path}: fsdp_cpu_ram_efficient_loading needs fsdp_sync_module_states: true "
            "(the other ranks receive rank 0's weights by broadcast). Fix: set fsdp_sync_module_states: true."
        )


def check_model(model, acc: dict, acc_path) -> None:
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


def load_model(path: str, init_kwargs: dict):
    """The empty model on a rank where it applies, else None (TRL loads the path)."""
    return empty_model(path, init_kwargs) if applies(init_kwargs) else None


def applies(init_kwargs: dict) -> bool:
    """FSDP with RAM-efficient loading (accelerate's environment for the ranks), on a rank other than each node's
    first: transformers' own meta-device branch keys on the local rank (`is_local_dist_rank_0`), so a node's local
    rank 0 loads as before. Not with a pinned model revision or other model_init_kwargs than the pack's four: TRL
    applies those only to a path it loads itself. FSDP_RECIPES_EMPTY_REPLICAS=0 leaves the loading to transformers
    (make bench-loading compares the two)."""
    on = {"true", "1"}
    plain = set(init_kwargs) <= {"revision", "trust_remote_code", "attn_implementation", "dtype"} and \
        init_kwargs.get("revision") in (None, "main")
    return (os.environ.get("FSDP_RECIPES_EMPTY_REPLICAS", "1") != "0"
            and os.environ.get("ACCELERATE_USE_FSDP", "").lower() in on
            and os.environ.get("FSDP_CPU_RAM_EFFICIENT_LOADING", "").lower() in on
            and int(os.environ.get("WORLD_SIZE", "1")) > 1 and int(os.environ.get("LOCAL_RANK", "0")) != 0
            and plain)


def empty_model(path: str, init_kwargs: dict):
    """The architecture of `path`, its parameters' storage never written (accelerate's broadcast from rank 0 fills the
    shards); None for an architecture transformers does not ship, which TRL then loads from the path as usual."""
    import torch
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    config_kwargs = {k: init_kwargs[k] for k in ("revision", "trust_remote_code") if init_kwargs.get(k) is not None}
    config = AutoConfig.from_pretrained(path, **config_kwargs)
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:  # a remote-code architecture: TRL loads it as before
        return None
    dtype = init_kwargs.get("dtype")
    if isinstance(dtype, str) and dtype != "auto":  # as TRL's create_model_from_path reads it
        dtype = getattr(torch, dtype)
    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()  # every weight is missing by design: transformers' load report would say so
    try:
        model = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)].from_pretrained(
            None, config=config, state_dict={}, dtype=dtype,
            attn_implementation=init_kwargs.get("attn_implementation"))
    finally:
        logging.set_verbosity(level)
    model.config._name_or_path = path  # TRL's tokenizer lookup, and what a saved config records
    # Loaded from no weights, the model recorded that no weight conversion was used: without the record, transformers
    # takes the architecture's own (as for a model built from its config), so that this rank names a mixture of
    # experts' tensors as the files do when it checks its shards against them (checkpoint/save_check.py)
    model.__dict__.pop("_weight_conversions", None)
    return unallocated_parameters(model)


def unallocated_parameters(model):
    """Give each meta parameter CPU storage that is never written (so never resident: the kernel backs a large
    allocation with pages only when touched), ties kept, buffers untouched.

    Why not leave them on meta: with FSDP2 the Trainer builds the optimizer before accelerate shards the model, and
    accelerate maps the optimizer's parameters to the sharded ones by `data_ptr()` (accelerate 1.15,
    `Accelerator._prepare_fsdp2`), which is 0 for every meta tensor: all of them mapped to one, and rank 1's updates
    went wrong from the second step (the losses of a 2-rank tiny run left the unpatched run's at step 3)."""
    import torch

    new: dict[int, torch.nn.Parameter] = {}  # by the meta parameter's id: a tied weight stays one parameter
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and param.is_meta:
                if id(param) not in new:
                    new[id(param)] = torch.nn.Parameter(torch.empty_like(param, device="cpu"),
                                                        requires_grad=param.requires_grad)
                module._parameters[name] = new[id(param)]
    return model
