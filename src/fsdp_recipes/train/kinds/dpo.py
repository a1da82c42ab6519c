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
`chosen` / `rejected`. check_data stops bad pairs in the launcher with the file and the line.
"""

from __future__ import annotations

from fsdp_recipes.errors import UserError
from fsdp_recipes.train import data_checks

# DPOTrainer's own logs (averaged over the logging interval) kept in metrics.json's `dpo` section
REPORTED_LOGS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
                 "logps/rejected")
RESUME_SETTINGS = ("beta", "loss_type", "loss_weights")  # what a resume compares (checkpoint/resume_settings.py)
SEQUENCES_PER_ROW = 2  # a pair: chosen and rejected
ROWS = "preference pairs (2 sequences each)"
SMOKE_DATA = "preferences"  # tiny_assets' synthetic preference pairs, for make smoke
describe_tokens = ("non-padding tokens of the chosen and rejected sequences (prompt included), one policy "
                   "forward and backward each, plus one reference forward (2N FLOPs per token, counted in MFU)")
ROLES = {"system", "user", "assistant", "tool"}


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
    from fsdp_recipes.train.loading import load_for

    want_eval = cfg.training.eval_strategy != "no" if want_eval is None else want_eval
    return load_for(cfg, want_eval, check_columns)


def check_columns(ds, where: str) -> None:
    cols = set(ds.column_names or [])
    if not {"chosen", "rejected"} <= cols:
        raise UserError(f"dataset {where} has columns {sorted(cols)}, but DPO needs `prompt`, `chosen` and "
                        "`rejected` (or `chosen` and `rejected` with the prompt inside them). Fix: rename the columns, "
                        "or use an SFT recipe for this data.")


def _text(value, what: str, at: str) -> str:
    """The text of a completion or prompt, plain or conversational; one line when it is neither."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value:
        for turn in value:
            role = turn.get("role") if isinstance(turn, dict) else None
            if role not in ROLES:
                raise UserError(f"{at}: a `{what}` turn has role {role!r}, not one of {sorted(ROLES)}. Fix: rename "
                                "the role (chat templates know only these).")
            if not isinstance(turn.get("content"), str):
                raise UserError(f"{at}: the {role} turn of `{what}` has content of type "
                                f"{type(turn.get('content')).__name__}, not text. Fix: make every content a string.")
        return "\x00".join(f"{t['role']}:{t['content']}" for t in value)
    if value is None or value == []:
        raise UserError(f"{at}: `{what}` is missing or empty. Fix: give every pair a {what} answer, or remove "
                        "the row.")
    raise UserError(f"{at}: `{what}` is {type(value).__name__}, not text or a list of chat turns. Fix: make it a "
                    "string or [{\"role\": ..., \"content\": ...}].")


def as_written(ds, where: str, split: str):
    """data_checks.written_rows: the rows as the file holds them (Arrow gives a column one type)."""
    return data_checks.written_rows(ds, where, split)


def check_rows(ds, where: str, split: str) -> None:
    """Every pair: a chosen and a rejected answer that differ, a non-empty prompt where there is a prompt column,
    text contents and known roles."""
    if len(ds) == 0:
        raise UserError(f"the `{split}` split of the dataset {where} has no preference pairs. Fix: point "
                        "dataset_name at data with rows (or the split at another file).")
    has_prompt = "prompt" in ds.column_names
    for i, row in enumerate(as_written(ds, where, split)):
        at = data_checks.row_at(where, split, i)
        if has_prompt:
            prompt = row.get("prompt")
            if prompt is None or (isinstance(prompt, (str, list)) and not (prompt.strip() if isinstance(prompt, str)
                                                                           else prompt)):
                raise UserError(f"{at}: the prompt is empty. Fix: give the pair its prompt, or remove the row.")
            _text(prompt, "prompt", at)
        chosen, rejected = _text(row.get("chosen"), "chosen", at), _text(row.get("rejected"), "rejected", at)
        kinds = {k: isinstance(row.get(k), list) for k in ("prompt", "chosen", "rejected") if k in row}
        if len(set(kinds.values())) > 1:
            chat = ", ".join(k for k, v in kinds.items() if v)
            raise UserError(f"{at}: {chat} are chat turns but {', '.join(k for k, v in kinds.items() if not v)} "
                            "plain text; TRL reads a pair as one or the other. Fix: make them all lists of chat "
                            "turns (or all text), or drop `prompt` and keep it inside `chosen` and `rejected`.")
        if chosen == rejected:
            raise UserError(f"{at}: `chosen` and `rejected` are the same answer, so the pair prefers nothing. Fix: "
                            "remove the row, or give it a different rejected answer.")


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
        check_rows(ds, where, split)  # what max_length cuts: train/data_lengths.py, in the launcher
    return warned
