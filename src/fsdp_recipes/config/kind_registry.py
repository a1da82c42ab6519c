"""The registry of trainer kinds: each kind's name, the TRL config class whose fields its recipes' <kind>.yaml holds,
the kind's own argument dataclass (settings TRL's config lacks), and the default. Here, in the config layer, because
recipe finding and argument parsing need them before any training code loads; the kinds' behaviour is in
train/kinds/ (one module each, checked against its interface when train/kinds builds its registry from these
names). Adding a kind: a line in TRAINERS and its module there."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from fsdp_recipes.config.argv import override
from fsdp_recipes.errors import UserError


@dataclass
class SamplingArguments:
    """The sampling kinds' own settings (train/kinds/sampling.py), parsed from the same <kind>.yaml."""

    reward_funcs: list[str] = field(
        default_factory=list,
        metadata={"help": "The reward functions, by import path (fsdp_recipes.rewards.exact_answer); checked for "
                          "their signature before any rank starts (train/kinds/sampling.py)."},
    )
    generation_backend: str = field(
        default="auto",
        metadata={"help": "How completions are sampled: auto (vLLM in colocate mode where it is installed and the "
                          "run is on GPUs, else the policy's own generate), vllm, or transformers."},
    )


@dataclass(frozen=True)
class Registration:
    config_class: str  # the name of TRL's config class for the kind: every training setting
    arguments: type | None = None  # the kind's own argument dataclass, or None
    # whether its TRL trainer applies selective activation checkpointing (`gradient_checkpointing_kwargs`
    # {selective: true}, TRL 1.16: SFTTrainer only): speed/activation_checkpointing.py's `ops` policy
    selective_checkpointing: bool = False
    # whether its TRL trainer computes the loss from the model's full logits when label_smoothing_factor > 0 (TRL
    # 1.16: SFTTrainer's label smoother; every other loss of every kind goes through the fused, chunked LM head):
    # speed/chunked_loss.py, the planner's logits term
    full_logits_when_smoothed: bool = False
    # whether its loss is split-aware under context parallel (TRL 1.16: SFT only; the Trainer reduces its loss and
    # token counts over the cp ranks): config/mesh.py's cp check
    splits_rows: bool = False


TRAINERS: dict[str, Registration] = {
    "sft": Registration("SFTConfig", selective_checkpointing=True, full_logits_when_smoothed=True, splits_rows=True),
    "dpo": Registration("DPOConfig"),
    "grpo": Registration("GRPOConfig", SamplingArguments),
    "kto": Registration("KTOConfig"),
    "rloo": Registration("RLOOConfig", SamplingArguments),
}
DEFAULT_TRAINER = "sft"


def trainer_kind(raw: dict, path: Path | str, overrides: list[str] = ()) -> str:
    """The `trainer` a recipe YAML names (default DEFAULT_TRAINER); it must be a known kind and match the file's
    name."""
    written = raw.get("trainer", DEFAULT_TRAINER)
    kind = str(override(list(overrides), "trainer", written))
    named = f"{path}" if str(kind) == str(written) else f"--trainer {kind} on the command line"
    if kind not in TRAINERS:
        raise UserError(f"unknown trainer `{kind}` in {named}. Fix: one of {', '.join(TRAINERS)}.")
    stem = Path(path).stem
    if stem in TRAINERS and stem != kind:
        if named != f"{path}":  # the recipe's file is another kind's: the flag cannot turn it into this one
            raise UserError(f"{named} asks for a {kind} run of {path}, whose settings are {stem}'s. Fix: drop "
                            f"--trainer, or run a {kind} recipe (its settings live in {kind}.yaml).")
        raise UserError(f"{path} names trainer `{kind}`, but a recipe's {kind} settings live in {kind}.yaml. "
                        f"Fix: rename the file to {kind}.yaml, or set `trainer: {stem}`.")
    return kind
