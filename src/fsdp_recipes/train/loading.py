"""Dataset loading for the entry point: local JSON/JSONL/Parquet files and directories, or hub ids.

All roads go through `datasets.load_dataset` (or TRL's `get_dataset` for a `datasets:` mixture), the same
calls a user with hub access makes; only the error messages are ours.
"""

from __future__ import annotations

from pathlib import Path

from fsdp_recipes.config.model_check import looks_local
from fsdp_recipes.errors import UserError
from fsdp_recipes.paths import expand

FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}

# The dataset layouts TRL's SFTTrainer accepts (language modeling or prompt-completion, plain or chat).
SFT_FORMATS = ({"messages"}, {"prompt", "completion"}, {"text"})


def load_raw(script_args, dataset_args):
    import datasets

    if dataset_args.datasets:
        from trl import get_dataset

        return get_dataset(dataset_args)
    name = expand(script_args.dataset_name)
    if not name:
        raise UserError("no dataset configured. Fix: set dataset_name (a file, directory or hub id) in the recipe.")
    if looks_local(name):
        path = Path(name)
        if not path.exists():
            raise UserError(
                f"dataset not found: {path}. Fix: check dataset_name, or build the tiny default's data with "
                "`python -m fsdp_recipes.assets.tiny_assets`."
            )
        if path.is_file() and FILE_BUILDERS.get(path.suffix) is None:
            raise UserError(f"cannot read {path}: use a .json, .jsonl, .parquet or .csv file.")
        try:
            if path.is_file():
                return datasets.load_dataset(FILE_BUILDERS[path.suffix], data_files=str(path))
            return datasets.load_dataset(str(path), name=script_args.dataset_config)
        except Exception as err:  # datasets names neither the file nor the line of a bad JSON line
            from fsdp_recipes.train.data_checks import explain_load_failure

            raise explain_load_failure(path, err) from None
    return datasets.load_dataset(name, name=script_args.dataset_config, streaming=script_args.dataset_streaming)


def check_columns(ds, where: str, text_field: str = "text") -> None:
    cols = set(ds.column_names or [])
    formats = [f if f != {"text"} else {text_field} for f in SFT_FORMATS]
    if not any(f <= cols for f in formats):
        raise UserError(
            f"dataset {where} has columns {sorted(cols)}, but SFT needs `messages`, `prompt` + `completion`, "
            f"or `{text_field}`. Fix: rename the columns, or set dataset_text_field."
        )


def load_splits(script_args, dataset_args, want_eval: bool, check):
    """(train, eval or None), with one-line errors for missing splits; `check(split, where)` is the trainer kind's
    column check (SFT's check_columns, DPO's)."""
    ds = load_raw(script_args, dataset_args)
    where = script_args.dataset_name or "mixture"
    splits = list(ds.keys())
    train_split, test_split = script_args.dataset_train_split, script_args.dataset_test_split
    if train_split not in ds:
        raise UserError(f"dataset {where} has no `{train_split}` split (it has {splits}). Fix: set dataset_train_split.")
    train = ds[train_split]
    check(train, where)
    if not want_eval:
        return train, None
    if test_split not in ds:
        raise UserError(
            f"eval is on but dataset {where} has no `{test_split}` split (it has {splits}). "
            "Fix: set dataset_test_split, or eval_strategy: \"no\"."
        )
    check(ds[test_split], where)
    return train, ds[test_split]


def load_sft_datasets(script_args, dataset_args, want_eval: bool, text_field: str = "text"):
    """(train, eval or None) for SFT, with one-line errors for missing splits and wrong columns."""
    return load_splits(script_args, dataset_args, want_eval, lambda ds, where: check_columns(ds, where, text_field))
