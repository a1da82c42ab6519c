"""The chunked loss: the LM head and the loss computed tile by tile, never the full (tokens x vocabulary) logits.

TRL 1.16 already does it, for every kind the pack trains: SFTTrainer, DPOTrainer, KTOTrainer, GRPOTrainer and
RLOOTrainer each patch the model with `add_fused_lm_head` (trl/trainer/utils.py) and call it with
`fused_lm_head=True`: per-token log-probabilities from tiles of at most 4,096 tokens x 32,768 vocabulary entries
(trl/kernels/chunked_logprob.py), for SFT's `loss_type` nll (the default; `chunked_nll` is its deprecated alias) and
dft alike. So this option has nothing to switch on: what it owns is the one setting that takes a recipe off that
path, `label_smoothing_factor` above 0 with a kind whose trainer then computes the loss from the model's own full
logits (SFTTrainer's label smoother; config/kind_registry.py `full_logits_when_smoothed`; the others ignore the
setting for their loss). At 32,768 tokens and Llama 3's 128,256-entry vocabulary those logits are 7.8 GiB in bf16
and, with the fp32 log-softmax the smoother keeps and its gradient, 39 GiB in all: the planner counts them in place
of the tile (planning/memory_budget.py `logits`), and the run report records which path ran.

Checked before launch: label smoothing with SFT's `loss_type: dft`, which SFTTrainer silently ignores (its label
smoother runs for nll only: the run would train unsmoothed), is one line. With nll, TRL warns that the smoothed loss
costs an extra forward (the fused head's, under no_grad, for its metrics): the plan's line says so.
"""

from __future__ import annotations

from fsdp_recipes.config.kind_registry import TRAINERS
from fsdp_recipes.errors import UserError

FIELDS = ("label_smoothing_factor",)
SMOOTHED = ("nll", "chunked_nll")  # the SFT loss types TRL 1.16's label smoother replaces (not dft)


def enabled(cfg) -> bool:
    return True  # every kind's trainer computes through the fused head: the record says which path ran


def full_logits(cfg) -> bool:
    """Whether this recipe's loss is computed from the full logits instead of the tiles."""
    return smoothed(cfg) and getattr(cfg.training, "loss_type", "nll") in SMOOTHED


def smoothed(cfg) -> bool:
    smoothing = float(getattr(cfg.training, "label_smoothing_factor", 0) or 0)
    return smoothing > 0 and TRAINERS[cfg.trainer].full_logits_when_smoothed


def check_config(cfg) -> None:
    loss = getattr(cfg.training, "loss_type", "nll")
    if smoothed(cfg) and loss not in SMOOTHED:
        raise UserError(f"label_smoothing_factor {cfg.training.label_smoothing_factor:g} with loss_type {loss}: "
                        "SFTTrainer smooths the nll loss only and would train this one unsmoothed, silently. Fix: "
                        "label_smoothing_factor 0, or loss_type nll.")


def planner_settings(cfg) -> dict:
    return {"full_logits": full_logits(cfg)}


def planner_note(cfg, config) -> str | None:
    if full_logits(cfg):
        return (f"loss: full logits (label_smoothing_factor {cfg.training.label_smoothing_factor:g}: TRL's label "
                "smoother reads the model's logits, and TRL runs the fused head's forward again for its metrics), "
                "counted in activations instead of the chunked head's tile")
    return None


def prepare_trainer(trainer, cfg) -> dict:
    path = "full logits (label smoother)" if full_logits(cfg) else "chunked (TRL's fused LM head)"
    return {"loss_head": path}
