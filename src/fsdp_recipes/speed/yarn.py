"""`yarn_rope_scaling: true`: rows longer than the model was trained on, through YaRN rope scaling (Peng et al. 2023).

transformers 5 reads a model's rotary positions from its config's `rope_parameters`; `rope_type: yarn` with
`factor` and `original_max_position_embeddings` stretches them past the trained length (transformers'
_compute_yarn_parameters: the low frequencies interpolated by `factor`, the high ones kept, the attention scaled by
0.1 ln(factor) + 1). This option gives from_pretrained `rope_parameters` with factor = max_length / the trained
length, the model's `max_position_embeddings` (Qwen3-8B: 32,768, which its model card extends to 131,072 with YaRN
factor 4), keeping the config's own rope_theta. It changes no tensor's size: the planner's memory is the same, and
the plan's line says the factor.

Checked before launch (one line each), against the model's config (the model folder's, the hub cache's or the
recipe's shipped copy, in the launcher, every rank and `make plan`): a factor above 1 only, so max_length must
exceed the trained length (at or under it, the model's own positions already reach; YaRN would only blur them); a
model whose config has no rotary positions (GPT-2's learned positions) is refused; so is a model whose positions
are already scaled (Llama 3.1's `rope_type: llama3`, trained to 131,072): its own scaling reaches
max_position_embeddings.
"""

from __future__ import annotations

from fsdp_recipes.config import model_check, model_found
from fsdp_recipes.errors import UserError

FIELDS = ("yarn_rope_scaling",)  # its own setting (config/option_registry.py YarnArguments)


def enabled(cfg) -> bool:
    return bool(cfg.option("yarn").yarn_rope_scaling)


def beyond_context(cfg, limit: int | None, model: str) -> str | None:
    """The line where max_length passes the model's trained positions (`limit`, max_position_embeddings) without
    YaRN: rows that long, or packed to it, reach positions the model never saw. `make plan` and the launcher warn;
    neither refuses (only rows that long are affected)."""
    length = max_length_of(cfg)
    if not length or not limit or length <= limit or enabled(cfg):
        return None
    return (f"max_length {length:,} is beyond {model}'s context of {limit:,} tokens (max_position_embeddings): rows "
            f"that long, or packed to it, reach positions it was never trained on. Fix: --max_length {limit} or "
            f"less, or yarn_rope_scaling: true to stretch its positions")


def max_length_of(cfg) -> int | None:
    return getattr(cfg.training, "max_length", None)


def rope_parameters_for(config, max_length: int | None) -> dict:
    """The rope_parameters from_pretrained gets: the config's own, with yarn and its factor; one line where YaRN does
    not apply to this model or this length."""
    arch = (getattr(config, "architectures", None) or [type(config).__name__])[0]
    rope = getattr(config, "rope_parameters", None)
    if not isinstance(rope, dict) or "rope_theta" not in rope:
        raise UserError(f"yarn_rope_scaling: {arch} has no rotary position embedding (its config has no "
                        "rope_parameters), so there is nothing for YaRN to scale. Fix: yarn_rope_scaling: false, and "
                        "a max_length within its max_position_embeddings.")
    if rope.get("rope_type", "default") != "default":
        raise UserError(f"yarn_rope_scaling: {arch}'s positions are already scaled (rope_type {rope['rope_type']}, "
                        f"to {config.max_position_embeddings:,} tokens); YaRN would replace that scaling. Fix: "
                        "yarn_rope_scaling: false, with max_length up to max_position_embeddings.")
    trained = int(config.max_position_embeddings)
    if not max_length or max_length <= trained:
        raise UserError(f"yarn_rope_scaling: max_length {max_length} is within {arch}'s trained length "
                        f"({trained:,}, max_position_embeddings): the factor would be "
                        f"{(max_length or 0) / trained:.2f}, "
                        f"and YaRN only stretches positions past that length. Fix: yarn_rope_scaling: false, or a "
                        f"max_length above {trained:,}.")
    return {**rope, "rope_type": "yarn", "factor": max_length / trained, "original_max_position_embeddings": trained}


def model_config(cfg):
    """The model's config as found without the network (a local folder, the hub cache), else None."""
    source = model_found.model_config_json(cfg.model.model_name_or_path, cfg.model.model_revision)
    return model_check.load_config(source) if source else None


def check_config(cfg) -> None:
    if enabled(cfg):
        config = model_config(cfg)
        if config is not None:  # a hub model not in the cache: make plan checks the recipe's copy, the ranks theirs
            check_model_config(cfg, config)


def check_model_config(cfg, config) -> None:
    if enabled(cfg):
        rope_parameters_for(config, max_length_of(cfg))


def model_init_kwargs(cfg) -> dict:
    if not enabled(cfg):
        return {}
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(cfg.model.model_name_or_path, revision=cfg.model.model_revision,
                                        trust_remote_code=getattr(cfg.training, "trust_remote_code", False))
    return {"rope_parameters": rope_parameters_for(config, max_length_of(cfg))}


def planner_note(cfg, config) -> str | None:
    """`make plan`'s line: the factor, and that no memory changes."""
    if not enabled(cfg):
        return None
    rope = rope_parameters_for(config, max_length_of(cfg))
    return (f"rope: YaRN factor {rope['factor']:g} = max_length {max_length_of(cfg):,} / trained length "
            f"{rope['original_max_position_embeddings']:,} (no memory of its own)")


def prepare_trainer(trainer, cfg) -> dict:
    rope = getattr(trainer.model.config, "rope_parameters", None) or {}
    trainer.accelerator.print(f"[train] rope: {rope.get('rope_type')} factor {rope.get('factor')} from "
                              f"{rope.get('original_max_position_embeddings')} tokens")
    return {"rope_type": rope.get("rope_type"), "factor": rope.get("factor"),
            "original_max_position_embeddings": rope.get("original_max_position_embeddings")}
