"""SFT: TRL's SFTTrainer on language-modeling or prompt-completion data, plain or chat."""

from __future__ import annotations

REPORTED_LOGS: tuple[str, ...] = ()  # the loss is in every run report already
RESUME_SETTINGS: tuple[str, ...] = ("packing", "completion_only_loss")  # what a resume compares (checkpoint/resume_settings.py)
SEQUENCES_PER_ROW = 1  # make plan: sequences a dataset row puts through the model
ROWS = "sequences"  # what make plan calls the rows of a batch
SMOKE_DATA = "data"  # tiny_assets' synthetic chat data, for make smoke
describe_tokens = "non-padding tokens of the training sequences, one forward and one backward each"


def trainer_class():
    from trl import SFTTrainer

    return SFTTrainer


def trainer_kwargs(cfg) -> dict:
    return {}


def sequence_length(training) -> int:
    """make plan's worst case: every sequence max_length long."""
    return training.max_length or 1024


def extra_forwards(training) -> dict[str, float]:
    return {}


def check_config(cfg) -> None:
    """Nothing beyond the shared checks (run_checks.check_before_launch)."""


def load_datasets(cfg, want_eval: bool | None = None):
    from fsdp_recipes.train.loading import check_columns, load_for

    want_eval = cfg.training.eval_strategy != "no" if want_eval is None else want_eval
    text_field = cfg.training.dataset_text_field
    return load_for(cfg, want_eval, lambda ds, where: check_columns(ds, where, text_field))


def check_data(cfg, splits, tokenizer) -> list[str]:
    from fsdp_recipes.train import data_checks

    where, warned = cfg.script.dataset_name, []
    names = (cfg.script.dataset_train_split, cfg.script.dataset_test_split)
    for split, ds in zip(names, splits):
        if ds is None:
            continue
        warned += data_checks.check_rows(ds, where, split)
        if tokenizer is not None and data_checks.conversational(ds):
            data_checks.check_chat_template(tokenizer, cfg.model.model_name_or_path, where)
    return warned  # what max_length cuts: train/data_lengths.py, in the launcher
