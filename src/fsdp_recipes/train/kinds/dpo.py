"""DPO: TRL's DPOTrainer on preference pairs, on the same FSDP lifecycle as SFT (train/entry.py).

The reference model:
- LoRA: the policy with its adapter disabled (TRL's default when no ref_model is given): no second copy in memory,
  one extra forward without gradients per batch.
- Full fine-tuning: a second copy of the model, loaded by TRL and sharded by FSDP like the policy
  (`prepare_fsdp`): its share of memory is the weights divided by the shard group, no gradients, no optimizer
  state, which `make plan` counts (planning/memory_budget.py). The other choice, `precompute_ref_log_probs`,
  loads the reference *unsharded* on every rank before the policy is wrapped (TRL 1.16's DPOTrainer, and the
  early-wrap bug of trl PR 6527 under FSDP2): on an 8B model that is 16 GB per GPU at once, the peak that sharding
  avoids. So the pack refuses it under FSDP with full fine-tuning (check_reference).

Data: TRL's preference layouts, `prompt` / `chosen` / `rejected` (conversational or plain) or implicit-prompt
`chosen` / `rejected`. check_data stops bad pairs in the launcher with the file and the line (the checks are the
preference format's, data/formats/preference.py).
"""

from __future__ import annotations

from fsdp_recipes.data import formats, loading
from fsdp_recipes.errors import UserError

# DPOTrainer's own logs (averaged over the logging interval) kept in metrics.json's `dpo` section
REPORTED_LOGS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
                 "logps/rejected")
RESUME_SETTINGS = ("beta", "loss_type", "loss_weights")  # what a resume compares (checkpoint/resume_settings.py)
SEQUENCES_PER_ROW = 2  # a pair: chosen and rejected
ROWS = "preference pairs (2 sequences each)"
SMOKE_DATA = "preferences"  # tiny_assets' synthetic preference pairs, for make smoke
describe_tokens = ("non-padding tokens of the chosen and rejected sequences (prompt included), one policy "
                   "forward and backward each, plus one reference forward (2N FLOPs per token, counted in MFU)")


def trainer_class():
    from trl import DPOTrainer

    return DPOTrainer


def trainer_kwargs(cfg) -> dict:
    return {}


def sequence_length(training) -> int:
    """make plan's worst case: every sequence max_length long."""
    return training.max_length or 1024


def extra_forwards(training) -> dict[str, float]:
    """The run report's FLOPs count a reference forward per token (metrics/flops.py), and make plan a reference
    model (planning/memory_budget.py): none with LoRA, a sharded copy with full fine-tuning. A precomputed
    reference runs before training, outside the time tokens/s divides by."""
    return {} if training.precompute_ref_log_probs else {"reference": 1.0}


def load_datasets(cfg, want_eval: bool | None = None):
    """(train, eval or None) preference splits, with one-line errors for missing splits and columns."""
    want_eval = cfg.training.eval_strategy != "no" if want_eval is None else want_eval
    return loading.load_for(cfg, want_eval, check_columns)


def check_columns(ds, where: str) -> None:
    cols = set(ds.column_names or [])
    if not {"chosen", "rejected"} <= cols:
        other = ("a KTO recipe for these labelled answers (`label`: true or false)" if "label" in cols else
                 "an SFT recipe for this data")
        raise UserError(f"dataset {where} {loading.held_columns(ds, where)}, but DPO needs `prompt`, `chosen` and "
                        "`rejected` (or `chosen` and `rejected` with the prompt inside them). Fix: rename the columns, "
                        f"or use {other}.")


BETA_FREE = ("sft",)  # DPO loss types that beta neither scales nor divides (trl 1.16 DPOTrainer._compute_loss)


def check_trains_something(t) -> None:
    """Settings with which every step's gradient is zero, or points away from the chosen answers: TRL trains on
    without a word (a LoRA adapter stays zero, which only the final save's check notices, as an incomplete save).
    Every loss type but `sft` scales the chosen-over-rejected margin by beta (ipo and sppo_hard divide by it); KTO's
    losses scale theirs alike. Called for DPO and KTO (their configs' loss_type: a list, a string)."""
    kind = type(t).__name__.removesuffix("Config")
    types = list(t.loss_type) if isinstance(t.loss_type, (list, tuple)) else [t.loss_type]
    weights = getattr(t, "loss_weights", None) or [1.0] * len(types)
    live = [lt for lt, w in zip(types, weights) if w != 0]
    if not live:
        raise UserError(f"loss_weights {list(weights)} are all 0 for loss_type {types}: the loss is 0 at every step, "
                        "so nothing would be trained. Fix: give a loss type a weight above 0, or leave loss_weights "
                        "out (1.0 each).")
    scaled = [lt for lt in live if lt not in BETA_FREE]
    if scaled and t.beta <= 0:
        what = "its gradient is 0 and nothing would be trained" if t.beta == 0 else \
            "the rejected answers would be trained over the chosen ones"
        raise UserError(f"beta is {t.beta:g}: {kind}'s {'/'.join(scaled)} loss scales the preference margin by beta, "
                        f"so {what}. Fix: set beta above 0 (TRL's default 0.1; lower lets the model move further "
                        "from the reference).")


def check_config(cfg) -> None:
    """Settings, before any data or weight is loaded (run_checks.check_before_launch, in the launcher and every rank):
    precompute_ref_log_probs with full fine-tuning loads an unsharded reference on every rank (see the module's
    docstring), refused with the fix; it is allowed with LoRA."""
    check_trains_something(cfg.training)
    if cfg.training.precompute_ref_log_probs and not cfg.model.use_peft and not cfg.training.use_cpu:
        raise UserError("precompute_ref_log_probs with full fine-tuning loads the whole reference model unsharded on "
                        "every GPU before FSDP wraps the policy (TRL 1.16; trl PR 6527). Fix: leave it false (the "
                        "reference is then sharded like the policy; `make plan` counts it), or use LoRA.")


def check_data(cfg, splits, tokenizer) -> list[str]:
    where, warned = cfg.script.dataset_name, []
    if tokenizer is not None and getattr(tokenizer, "chat_template", None) is None:
        first = splits[0][0]
        if isinstance(first.get("chosen"), list):
            raise UserError(f"the dataset {where} is conversational but the tokenizer of "
                            f"{cfg.model.model_name_or_path} has no chat template. Fix: set chat_template_path, or "
                            "use a model whose tokenizer has one.")
    for split, ds in zip((cfg.script.dataset_train_split, cfg.script.dataset_test_split), splits):
        if ds is None:
            continue
        warned += formats.check_rows(ds, where, split)  # pairs (data/formats/preference.py); what max_length
        # cuts: data/lengths.py, in the launcher
    return warned
