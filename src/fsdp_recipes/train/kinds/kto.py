"""KTO: TRL's KTOTrainer on answers labelled good or bad one at a time, the feedback products collect (a thumbs up
or down), not pairs; on the same FSDP lifecycle as the other kinds (train/entry.py).

Data: TRL's unpaired preference layout, `prompt` / `completion` / `label` (true: desirable), conversational or
plain; or preference pairs (`prompt` / `chosen` / `rejected`), one desirable and one undesirable row each. TRL would
unpair pairs itself (`unpair_preference_dataset`), but in blocks: a thousand pairs' chosen answers, then their
rejected ones, which KTO's sequential sampler turns into hundreds of steps of one label only. So load_datasets
unpairs them alternately (pair i's chosen answer, then pair i+2's rejected one: every micro-batch holds both labels,
and no row's neighbour answers its own prompt, which would spoil the KL term's mismatched pairs). check_data stops
bad rows in the launcher with the file and the line.

The reference model is DPO's (kinds/dpo.py): with LoRA the policy with its adapter disabled, with full fine-tuning a
sharded copy. The KL term (every loss but `apo_zero_unpaired`) compares each prompt with another row's completion,
the rows of a micro-batch rotated by one, so it needs per_device_train_batch_size above 1 and the sequential
sampler (TRL's default for KTO): both checked before any rank starts. Each trained sequence then costs one policy
forward without gradients (the mismatched pair) and two reference forwards (matched and mismatched).
"""

from __future__ import annotations

from fsdp_recipes.data import formats, loading, row_checks, rows
from fsdp_recipes.errors import UserError
from fsdp_recipes.train.kinds import dpo

# KTOTrainer's own logs (averaged over the logging interval) kept in metrics.json's `kto` section
REPORTED_LOGS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected", "kl")
RESUME_SETTINGS = ("beta", "loss_type", "desirable_weight", "undesirable_weight")  # checkpoint/resume_settings.py
SEQUENCES_PER_ROW = 1  # a labelled answer (a pair is unpaired into two rows)
ROWS = "labelled answers"
SMOKE_DATA = "preferences"  # tiny_assets' synthetic preference pairs, read as labelled rows (unpaired), for make smoke
describe_tokens = ("non-padding tokens of the labelled sequences (prompt + answer), one policy forward and backward "
                   "each; with the KL term one more policy forward and two reference forwards per token (matched and "
                   "mismatched answers), without it one reference forward (2N FLOPs each, counted in MFU)")
SMOKE_SETTINGS = {"per_device_train_batch_size": 2}  # the KL term needs two rows per micro-batch
LABELS = {"prompt", "completion", "label"}
MIN_PAIRS = 3  # unpaired() sets pair i's rejected answer beside pair i-2's chosen one: 3 pairs make them differ


def trainer_class():
    from trl import KTOTrainer

    return KTOTrainer


def trainer_kwargs(cfg) -> dict:
    return {}


def sequence_length(training) -> int:
    """make plan's worst case: every sequence max_length long."""
    return training.max_length or 1024


def uses_kl(training) -> bool:
    return training.loss_type != "apo_zero_unpaired"


def extra_forwards(training) -> dict[str, float]:
    """Per trained token (trl 1.16 KTOTrainer._compute_loss): the reference's forward over the answer, and with the
    KL term its forward and the policy's (no gradients) over the mismatched answer. A precomputed reference runs
    before training, outside the time tokens/s divides by."""
    kl = uses_kl(training)
    forwards = {} if training.precompute_ref_log_probs else {"reference": 2.0 if kl else 1.0}
    return {**forwards, "kl_policy": 1.0} if kl else forwards


def load_datasets(cfg, want_eval: bool | None = None):
    """(train, eval or None) labelled or paired splits, with one-line errors for missing splits and columns."""
    want_eval = cfg.training.eval_strategy != "no" if want_eval is None else want_eval
    splits = loading.load_for(cfg, want_eval, check_columns)
    return tuple(unpaired(ds) if ds is not None and paired(ds) else ds for ds in splits)


def unpaired(ds, offset: int = 2):
    """Pairs -> labelled rows, alternating: chosen of pair i, rejected of pair i + offset (see the docstring)."""
    from datasets import interleave_datasets
    from trl.data_utils import maybe_extract_prompt

    if "prompt" not in ds.column_names:  # implicit-prompt pairs: the prompt is the turns chosen and rejected share
        ds = ds.map(maybe_extract_prompt)
    n = len(ds)
    others = [c for c in ds.column_names if c not in ("chosen", "rejected")]
    good = ds.map(lambda r: {"completion": r["chosen"], "label": True}, remove_columns=["chosen", "rejected"])
    bad = ds.select([(i + offset) % n for i in range(n)]).map(lambda r: {"completion": r["rejected"], "label": False},
                                                              remove_columns=["chosen", "rejected"])
    return interleave_datasets([good, bad]).select_columns([*others, "completion", "label"])


def paired(ds) -> bool:
    return {"chosen", "rejected"} <= set(ds.column_names or [])


def check_columns(ds, where: str) -> None:
    cols = set(ds.column_names or [])
    if not (LABELS <= cols or paired(ds)):
        raise UserError(f"dataset {where} {loading.held_columns(ds, where)}, but KTO needs `prompt`, `completion` and "
                        "`label` (true for a good answer, false for a bad one), or preference pairs (`prompt`, "
                        "`chosen`, `rejected`). Fix: rename the columns, or use an SFT recipe for this data.")


def check_config(cfg) -> None:
    """Settings TRL would refuse inside every rank, refused before any starts (trl 1.16 KTOTrainer.__init__)."""
    t = cfg.training
    if uses_kl(t) and t.per_device_train_batch_size <= 1:
        raise UserError(f"per_device_train_batch_size {t.per_device_train_batch_size} with KTO's KL term (loss_type "
                        f"{t.loss_type}): the term pairs each prompt with another row's answer in the same "
                        "micro-batch, so it needs two rows or more. Fix: per_device_train_batch_size 2 or more, or "
                        "loss_type apo_zero_unpaired (no KL term).")
    if uses_kl(t) and t.train_sampling_strategy != "sequential":
        raise UserError(f"train_sampling_strategy {t.train_sampling_strategy} with KTO's KL term: its mismatched "
                        "answers are fixed against their neighbours in a sequential batch. Fix: leave "
                        "train_sampling_strategy sequential (KTO's default; shuffle the data file instead).")
    if t.desirable_weight < 0 or t.undesirable_weight < 0 or t.desirable_weight == t.undesirable_weight == 0:
        raise UserError(f"desirable_weight {t.desirable_weight:g} and undesirable_weight {t.undesirable_weight:g}: "
                        + ("both 0 weigh every answer's loss 0, so nothing would be trained" if
                           min(t.desirable_weight, t.undesirable_weight) >= 0 else
                           "a negative weight trains towards the answers it should train away from")
                        + ". Fix: set both above 0 (1.0 each by default; raise the rarer label's to balance them).")
    dpo.check_config(cfg)  # beta; precompute_ref_log_probs with full fine-tuning: the same unsharded reference


def check_data(cfg, splits, tokenizer) -> list[str]:
    where, warned = cfg.script.dataset_name, []
    for split, ds in zip((cfg.script.dataset_train_split, cfg.script.dataset_test_split), splits):
        if ds is None:
            continue
        written = list(rows.written_rows(ds, where, split))
        warned += formats.check_rows(ds, where, split)  # pairs or labelled answers, as the file holds them
        if written and "chosen" in written[0]:  # pairs, as written (unpaired on loading)
            if len(written) < MIN_PAIRS:
                raise UserError(f"the `{split}` split of {where} has {len(written)} preference pair(s): read as "
                                f"labelled answers for KTO, its KL term needs {MIN_PAIRS} or more, so that no answer "
                                "sits beside its own prompt. Fix: add pairs, or give labelled rows (prompt, "
                                "completion, label).")
        if tokenizer is not None and row_checks.conversational(ds):
            row_checks.check_chat_template(tokenizer, cfg.model.model_name_or_path, where)
    return warned  # what max_length cuts: data/lengths.py, in the launcher
