"""The registry of speed and memory options: each option's name and its own argument dataclass (settings TRL's and
transformers' configs lack), or None where every setting it reads is one of theirs (attn_implementation,
load_in_4bit, use_liger_kernel, ...). Here, in the config layer, because the recipe's parse needs the dataclasses
before any training code loads, as config/kind_registry.py does for the trainer kinds; what each option does is its
module in speed/ (checked against its interface when speed/ builds its registry from these names).

Adding an option: a line in OPTIONS, its module in speed/ (docs/architecture.md)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Float8Arguments:
    """speed/float8.py's setting, parsed from the same recipe YAML."""

    float8: bool = field(
        default=False,
        metadata={"help": "torchao float8 training of the decoder's linear layers: full fine-tuning on a GPU of "
                          "compute capability 8.9+ (H100, H200); on CPU it runs, no faster (speed/float8.py)."},
    )


@dataclass
class ActivationCheckpointingArguments:
    """speed/activation_checkpointing.py's setting: which layers recompute their activations in the backward."""

    activation_checkpointing_policy: str | None = field(
        default=None,
        metadata={"help": "none, every_<k> (every k-th decoder layer checkpointed), ops (attention outputs saved, the "
                          "rest recomputed; SFT), full, or auto (the planner's pick for the GPUs the launcher finds: "
                          "the fastest that fits). Unset: activation_checkpointing and its kwargs as written "
                          "(speed/activation_checkpointing.py)."},
    )


@dataclass
class CheckpointOffloadArguments:
    """speed/checkpoint_offload.py's setting: where the checkpointed layers' saved inputs wait for the backward."""

    activation_checkpointing_offload: bool = field(
        default=False,
        metadata={"help": "hold the inputs activation checkpointing saves in pinned host memory instead of the GPU's "
                          "(transformers' activation_checkpointing_kwargs offload): layers x tokens x hidden bytes "
                          "freed on the GPU, two copies a layer per step (speed/checkpoint_offload.py)."},
    )


@dataclass
class YarnArguments:
    """speed/yarn.py's setting: rows longer than the model was trained on."""

    yarn_rope_scaling: bool = field(
        default=False,
        metadata={"help": "YaRN rope scaling to max_length: rope_parameters rope_type yarn, factor max_length / the "
                          "model's trained length (max_position_embeddings); only where max_length exceeds it, and "
                          "only for a model with rotary positions (speed/yarn.py)."},
    )


@dataclass
class ExpertsArguments:
    """speed/experts.py's setting."""

    experts_implementation: str = field(
        default="auto",
        metadata={"help": "how a mixture-of-experts model computes its experts (transformers' experts_implementation): "
                          "auto (grouped_mm on CUDA compute capability 8.0+, else what runs best there), eager, "
                          "grouped_mm, batched_mm, ... (speed/experts.py). Dense models ignore auto."},
    )
    expert_parallel_size: int = field(
        default=1,
        metadata={"help": "ranks that split each MoE layer's experts between them (expert parallelism); 1: FSDP2 "
                          "shards the experts with the rest of their layer. Above 1 is refused: no release this "
                          "pack allows trains it resumably (speed/experts.py says why)."},
    )


# In the order their hooks run: how the model loads first, then what wraps or converts it.
OPTIONS: dict[str, type | None] = {
    "four_bit": None,
    "attention": None,
    "experts": ExpertsArguments,
    "ram_efficient_loading": None,
    "activation_checkpointing": ActivationCheckpointingArguments,
    "checkpoint_offload": CheckpointOffloadArguments,  # after activation_checkpointing: it adds to its kwargs
    "chunked_loss": None,
    "yarn": YarnArguments,
    "liger": None,
    "compile": None,
    "float8": Float8Arguments,
}


def argument_classes() -> tuple[type, ...]:
    """The options' own dataclasses, parsed with the recipe (config/run_config.py) into RunConfig.options."""
    return tuple(arguments for arguments in OPTIONS.values() if arguments is not None)
