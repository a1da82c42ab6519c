"""Where a causal LM keeps its decoder layers, and its attention and MLP widths, whatever its family names them.

Llama, Mistral and Qwen keep their layers in `model.layers` and name their widths num_key_value_heads and
intermediate_size; GPT-NeoX keeps them in `gpt_neox.layers`, GPT-2, Falcon and Bloom in `transformer.h`, OPT in
`model.decoder.layers`, Mamba in `backbone.layers`, and GPT-NeoX, GPT-2 and OPT have no num_key_value_heads (one
key/value head per query head), GPT-2 calls its MLP's width n_inner (None: 4 x hidden), OPT ffn_dim. The planner
(memory_budget.shape_of) and the 4-bit option's planner terms (speed/four_bit.py) read them here.

The layers are found as accelerate finds what FSDP wraps: by the model's `_no_split_modules` (the decoder layer
classes; config/model_check.py checks the recipe's wrap classes against them): the module list holding such layers,
the one with the most parameters where there are several (a vision tower's blocks beside the language model's
layers). A model that lists none: its module list with the most parameters.
"""

from __future__ import annotations

from fsdp_recipes.errors import UserError


def layers(model) -> tuple[str, list]:
    """(the module list's name in `model`, e.g. "model.layers" or "gpt_neox.layers", its layers)."""
    import torch

    own = set(getattr(model, "_no_split_modules", None) or ())
    lists = [(name, module) for name, module in model.named_modules()
             if isinstance(module, torch.nn.ModuleList) and len(module)]
    wrapped = [(name, module) for name, module in lists if any(type(m).__name__ in own for m in module)]

    def size(item) -> int:
        return sum(p.numel() for p in item[1].parameters())

    found = max(wrapped or lists, key=size, default=None)  # the first of equals: the outermost list
    if found is None:
        raise UserError(f"{type(model).__name__} has no list of decoder layers (no torch ModuleList), so the planner "
                        "cannot count its layers. Fix: plan a causal LM whose layers are a ModuleList (transformers' "
                        "decoder models all are).")
    return found[0], list(found[1])


def heads(config) -> int:
    """Query heads; 0 for a model without attention (Mamba)."""
    return getattr(config, "num_attention_heads", None) or 0


def kv_heads(config) -> int:
    """Key/value heads: num_key_value_heads where the family has it (Llama's GQA); Falcon's num_kv_heads with its new
    decoder architecture, one with its multi-query attention (Falcon 7B's), as GPT-BigCode's; else one per query
    head (GPT-NeoX, GPT-2, OPT)."""
    n = getattr(config, "num_key_value_heads", None)
    if n:
        return n
    if getattr(config, "new_decoder_architecture", False) and getattr(config, "num_kv_heads", None):
        return config.num_kv_heads
    if getattr(config, "multi_query", False):
        return 1
    return heads(config)


def head_dim(config) -> int:
    """Each head's width: the config's head_dim, else hidden / heads (0 without attention)."""
    n = heads(config)
    return getattr(config, "head_dim", None) or (config.hidden_size // n if n else 0)


# The MLP width's names, Llama's first: GPT-2's and GPT-J's n_inner, OPT's ffn_dim, Falcon's ffn_hidden_size
MLP_WIDTHS = ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size")


def intermediate(config) -> int:
    """The MLP's width: intermediate_size (Llama, GPT-NeoX), n_inner (GPT-2, GPT-J), ffn_dim (OPT), ffn_hidden_size
    (Falcon), expansion_ratio x hidden (MPT); else, or where it is None, 4 x hidden (GPT-2's and Bloom's)."""
    for key in MLP_WIDTHS:
        value = getattr(config, key, None)
        if value:
            return value
    return int(getattr(config, "expansion_ratio", None) or 4) * config.hidden_size
