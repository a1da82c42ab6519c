"""Dataset loading for the entry point: local JSON/JSONL/Parquet files and directories, hub ids, and `datasets:`
mixtures; each converted from its format (data/formats/) to the layout TRL takes; the eval split found or
carved off.

All roads go through `datasets.load_dataset`, the call a user with hub access makes (a mixture's sources one by one,
as TRL's `get_dataset` loads them, so that each is converted from its own format); only the error messages, the
conversion and the split rules are ours:

- the eval split is `dataset_test_split`; when that is `test` (the default) and the data has none, the first of
  `validation`, `valid`, `eval`, `dev` it has (dataset_test_split is set to it, so run_args.json says which); a name
  other than `test` that the data lacks while it has a split besides the training one is refused, naming them;
- else, with `eval_split_size` (a fraction below 1, or a number of rows), that many training rows are held out,
  chosen with the run's seed: the same rows in every rank, and in the summary, which scores them; a size that leaves
  a rank of the job without a training row is refused, not capped;
- else there is no eval split: one line says so, and nothing is scored as held out.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from fsdp_recipes.config.model_found import looks_local
from fsdp_recipes.data import declaration, formats, rows
from fsdp_recipes.data.files import (check_file_bytes, check_found, check_not_a_model, explain_load_failure,
                                     file_builder, local_files)
from fsdp_recipes.data.spec import DOCS, names_shown
from fsdp_recipes.errors import UserError
from fsdp_recipes.paths import expand

EVAL_NAMES = ("test", "validation", "valid", "eval", "dev")  # the names an eval split goes by, searched in order

# The dataset layouts TRL's SFTTrainer accepts (language modeling or prompt-completion, plain or chat).
SFT_FORMATS = ({"messages"}, {"prompt", "completion"}, {"text"})

# What the last load found, for the launcher to print (one line each): the formats and how they map, the eval
# split, the eval rows that are training rows too. Reset by every load_splits.
NOTES: list[str] = []
WARNINGS: list[str] = []
IF_ANY = "if any"  # load_splits' want_eval for `make data`: the eval split where there is one, no error without
# The refusal a run with eval on would make of the last load (no eval split), where want_eval did not ask for one:
# `make data` says it and exits as the launch would (launch/data_preview.py)
NO_EVAL: list[UserError] = []


def load_local(path: Path, config_name: str | None = None):
    import datasets

    if path.is_file() and file_builder(path) is None:
        raise UserError(f"cannot read {path}: use a .json, .jsonl, .parquet or .csv file (or a .json, .jsonl or "
                        f".csv file compressed: .gz, .bz2, .xz, .zst).")
    check_not_a_model(path)
    files = local_files(path)
    for f in files:
        check_file_bytes(f)  # a byte that is not UTF-8, a file of blank lines: one line, file and line
    text = csv_as_text(files)
    try:
        if path.is_file():
            ds = datasets.load_dataset(file_builder(path), data_files=str(path), **text)
        else:
            ds = datasets.load_dataset(str(path), name=config_name, **text)
    except Exception as err:  # datasets names neither the file nor the line of a bad JSON line
        raise explain_load_failure(path, err) from None
    return datasets.DatasetDict({split: csv_booleans(part) for split, part in ds.items()}) if text else ds


def csv_as_text(files: list[Path]) -> dict:
    """load_dataset's arguments that read every cell of CSV files as the text it is: a CSV has no types, and pandas'
    guess made an answer column of digits integers (`2`, `007` -> 7), which no prompt or completion takes. Where every
    file is CSV; {} otherwise."""
    import csv

    import datasets

    if not files or any(f.suffix != ".csv" for f in files):
        return {}
    header: list[str] = []
    for f in files:
        with open(f, newline="", encoding="utf-8-sig") as fh:
            header += [c for c in next(csv.reader(fh), []) if c not in header]
    return {"features": datasets.Features({c: datasets.Value("string") for c in header})}


def csv_booleans(ds):
    """CSV columns that hold only true and false (any case; empty cells aside) as booleans, as pandas reads them: a
    labelled answer's `label`."""
    bools = [c for c in ds.column_names
             if len(ds) and all(v is None or v.strip().lower() in ("true", "false") for v in ds[c])
             and any(v is not None for v in ds[c])]
    if not bools:
        return ds
    return ds.map(lambda row: {c: None if row[c] is None else row[c].strip().lower() == "true" for c in bools})


def load_raw(script_args, dataset_args, pack=None, text_field: str = "text", seed: int = 42):
    """The dataset as a DatasetDict, each split converted to the layout TRL takes (pack.dataset_format, else the
    format detected from its columns and first row); NOTES says what was found."""
    import datasets

    # An earlier load's rows (the launcher's checks before the summary's load, in one process) would name this
    # load's rows by that load's carved-off split: its lines, and an index past its end for the rows it held out.
    rows.clear()
    declared = getattr(pack, "dataset_format", None)
    if dataset_args.datasets:
        return load_mixture(dataset_args, declared, text_field, seed)
    name = expand(script_args.dataset_name)
    if not name:
        raise UserError("no dataset configured. Fix: set dataset_name (a file, directory or hub id) in the recipe.")
    if looks_local(name):
        path = check_found(name)
        ds = load_local(path, script_args.dataset_config)
    else:
        ds = datasets.load_dataset(name, name=script_args.dataset_config, streaming=script_args.dataset_streaming)
    if script_args.dataset_streaming and not looks_local(name):
        return ds
    return datasets.DatasetDict({split: convert(part, name, split, declared, text_field)
                                 for split, part in ds.items()})


def convert(ds, where: str, split: str, declared: str | None, text_field: str, at=None):
    """One split (or mixture source) converted from its format, and its format's line in NOTES (once per source)."""
    spec = declaration.resolve(ds, where, declared, text_field)
    if spec is not None:
        line = declaration.describe(spec, where, declared is not None, list(ds.column_names))
        if line not in NOTES:
            NOTES.append(line)
        rows.READ_AS[(where, split)] = spec.name
    at = at or (lambda i: rows.row_at(where, split, i))
    converted = declaration.convert(ds, spec, at, text_field)
    if converted is not ds:
        rows.CONVERTED.add((where, split))
    return converted


def load_mixture(mixture, declared: str | None, text_field: str, seed: int):
    """TRL's get_dataset (trl/scripts/utils.py), with each source converted from its own format before the sources
    are joined, and test_split_size seeded."""
    import datasets

    if mixture.streaming:
        from trl import get_dataset

        return get_dataset(mixture)
    parts = []
    for source in mixture.datasets:
        files = source.data_files
        local = [Path(f) for f in ([files] if isinstance(files, str) else (files or [])) if Path(f).is_file()]
        for f in local:
            check_file_bytes(f)
        where = str(local[0]) if len(local) == 1 else source.path
        text = csv_as_text(local) if local and len(local) == len([files] if isinstance(files, str) else files) \
            else {}
        ds = datasets.load_dataset(path=source.path, name=source.name, data_dir=source.data_dir,
                                   data_files=source.data_files, split=source.split, **text)
        ds = csv_booleans(ds) if text else ds
        if source.columns is not None:
            ds = ds.select_columns(source.columns)
        at = (lambda i, f=local[0]: rows.place_of(f, i)) if len(local) == 1 else None
        parts.append(convert(ds, where, source.split, declared, text_field, at))
    fractions = [source.fraction for source in mixture.datasets]
    if any(f is not None for f in fractions):
        if any(f is None for f in fractions):
            raise UserError("`fraction` is set for some sources of the `datasets:` mixture but not all. Fix: set it "
                            "for every source, or for none.")
        weights = [f / sum(fractions) for f in fractions]
        total = min(len(ds) / w for ds, w in zip(parts, weights) if w > 0)
        parts = [ds.select(range(round(w * total))) for ds, w in zip(parts, weights)]
    layouts = {tuple(sorted(ds.column_names)) for ds in parts}
    if ("messages",) in layouts and len(layouts) > 1:  # chat sources of both layouts: all become whole conversations
        parts = [as_messages(ds) for ds in parts]
        layouts = {tuple(sorted(ds.column_names)) for ds in parts}
    try:
        if len(layouts) > 1:
            raise ValueError("their columns differ")
        combined = datasets.concatenate_datasets(parts)
    except ValueError as err:
        named = "; ".join(f"{s.data_files or s.path}: {names_shown(ds.column_names)}"
                          for s, ds in zip(mixture.datasets, parts))
        raise UserError(f"the sources of the `datasets:` mixture convert to different layouts ({named}): "
                        f"{str(err).splitlines()[0]}. Fix: mix sources that convert alike (all chat `messages`, or "
                        "all prompt + completion), or convert one of them.") from None
    if mixture.test_split_size is not None:
        return combined.train_test_split(test_size=mixture.test_split_size, seed=seed)
    return datasets.DatasetDict({"train": combined})


def as_messages(ds):
    """Chat prompt + completion rows as one conversation (`messages`), so that they join a mixture of chat data."""
    if set(ds.column_names) != {"prompt", "completion"} or not len(ds) or not isinstance(ds[0]["prompt"], list):
        return ds
    return ds.map(lambda r: {"messages": r["prompt"] + r["completion"]}, remove_columns=["prompt", "completion"])


def check_columns(ds, where: str, text_field: str = "text") -> None:
    """SFT's: the split (converted) is in a layout SFTTrainer takes; the error names the formats that become one."""
    cols = set(ds.column_names or [])
    layouts = [f if f != {"text"} else {text_field} for f in SFT_FORMATS]
    if not any(f <= cols for f in layouts):
        takes = [f for f in formats.FORMATS.values() if set(formats.layout(f).COLUMNS) in SFT_FORMATS]
        named = ", ".join(f"{f.LABEL} ({' + '.join(f'`{f.default_columns(text_field).get(c, c)}`' for c in f.COLUMNS)})"
                          for f in takes)
        raise UserError(f"dataset {where} has columns {names_shown(cols)}, but SFT needs the columns of one of "
                        f"{named}. Fix: {columns_fix(ds)}.")
    check_no_undesirable_answers(ds, where)


def columns_fix(ds) -> str:
    """The fix for columns SFT does not take, with the file's own column names: its one text column read as the
    text to train on (a CSV of jokes), else its first two as prompt and completion."""
    features = getattr(ds, "features", None) or {}
    texts = [c for c in (ds.column_names or [])
             if getattr(features.get(c), "dtype", None) in ("string", "large_string")]
    if len(texts) == 1:
        return (f"train on the text of `{texts[0]}`: `dataset_format: text text={texts[0]}` in the recipe (on the "
                f"command line --dataset_format \"text text={texts[0]}\"), or dataset_text_field: {texts[0]}; the "
                f"other formats: {DOCS}")
    prompt, completion = texts[:2] if len(texts) >= 2 else ("question", "answer")
    return (f"name your columns with `dataset_format:` (e.g. `prompt_completion prompt={prompt} completion="
            f"{completion}`; {DOCS}), or set dataset_text_field")


def held_columns(ds, where: str) -> str:
    """A split's columns as a trainer kind's column error tells them: where the pack converted the file's format,
    the format too (DPO on an Alpaca file named columns ['completion', 'prompt'], which the file does not have)."""
    cols = names_shown(ds.column_names or [])
    read = {name for (w, split), name in rows.READ_AS.items() if w == where and (w, split) in rows.CONVERTED}
    if len(read) != 1:
        return f"has columns {cols}"
    return f"holds {formats.load(read.pop()).LABEL} rows (SFT data), read as columns {cols}"


def check_no_undesirable_answers(ds, where: str, kind: str = "SFT",
                                 taken: str = "SFT would train on those answers as on the good ones") -> None:
    """KTO's labelled answers under a kind that reads prompt + completion and drops `label`: SFTTrainer trained the
    answers labelled undesirable as the ones to give, the sampling kinds took them as the right answers their rewards
    compare with, without a word. Refused, not filtered: dropping rows the user gave would train on less data than
    the file holds, and only the user knows whether the false rows are wrong answers (keep the true ones) or the
    point of the data (KTO). Rows read as labelled answers only: a declared `dataset_format: prompt_completion` says
    the label is not what to train on. `kind`: the trainer's name; `taken`: what it would do with the false rows."""
    if "label" not in (ds.column_names or []) or not hasattr(ds, "__len__") \
            or "unpaired_preference" not in rows.READ_AS.values():
        return
    labels = ds["label"]
    bad = sum(v is False for v in labels)
    if bad:
        raise UserError(f"dataset {where} holds labelled answers (`label`), {bad} of its {len(labels)} rows labelled "
                        f"undesirable (false), and {taken}. Fix: train it with a KTO recipe (trainer: kto, e.g. "
                        "smollm2-135m-kto), keep only the rows labelled true, or, where `label` means something else, "
                        f"declare `dataset_format: prompt_completion` ({kind} then takes every row).")


def carve_size(size: float, n: int, ranks: int = 1, split: str = "train", where: str = "the dataset") -> int:
    """Rows eval_split_size holds out of n: a fraction below 1, else a number of rows; at least 1. One line where
    that leaves fewer training rows than the job's ranks (`ranks`; one each at least): it was capped at n - 1 without
    a word (20 of 10 rows, or 0.99: 9 held out, 1 trained on)."""
    held = max(1, round(size * n) if size < 1 else int(size))
    ranks = max(1, ranks)
    if n - held >= ranks:
        return held
    most = n - ranks
    asked = (f"{held} of the {n} rows of `{split}` in {where}" if held <= n else
             f"{held} rows, and `{split}` in {where} has {n}")
    left = "none to train on" if held >= n else f"{n - held} to train on for {ranks} ranks"
    each = f"; each of the {ranks} ranks needs a training row" if ranks > 1 else ""
    room = f"hold out at most {most} (eval_split_size {most}, or a share such as 0.1{each})" if most >= 1 else \
        f"add rows{each}"
    raise UserError(f"eval_split_size {size:g} holds out {asked}, leaving {left}. Fix: {room}, or give the data an "
                    "eval split of its own (a validation.jsonl beside train.jsonl).")


def held_out(ds, script_args, pack, seed: int, where: str, ranks: int = 1):
    """(train, eval or None, how the eval split was found) under the module's rules; script_args.dataset_test_split
    becomes the split found by another of the usual names. `ranks`: the job's, each of which needs a training row."""
    train_name, test_name = script_args.dataset_train_split, script_args.dataset_test_split
    train = ds[train_name]
    if test_name not in ds and test_name == "test":
        found = next((n for n in EVAL_NAMES if n in ds and n != train_name), None)
        if found:
            script_args.dataset_test_split = test_name = found
    size = getattr(pack, "eval_split_size", None) or 0
    streamed = not hasattr(train, "__len__")  # a streamed hub dataset: rows are not counted or carved here
    if streamed and test_name in ds and test_name != train_name:
        return train, ds[test_name], f"the `{test_name}` split (streamed)"
    if streamed:
        if size:
            raise UserError(f"eval_split_size {size:g} needs the rows counted, and the dataset {where} is streamed. "
                            "Fix: dataset_streaming: false, or a dataset with its own eval split.")
        return train, None, None
    if test_name in ds and test_name != train_name:
        if size:
            WARNINGS.append(f"eval_split_size {size:g} is not used: the dataset {where} has its own `{test_name}` "
                            "split, which is held out instead")
        file = rows.split_file(where, test_name)
        named = f"{file.name}, " if file is not None and file.stem != test_name else ""
        return train, ds[test_name], f"the `{test_name}` split ({named}{len(ds[test_name])} rows)"
    if size:
        n = len(train)
        if n < 2:
            raise UserError(f"eval_split_size {size:g}: the `{train_name}` split of {where} has {n} row(s), too few "
                            "to hold any out. Fix: add rows, or remove eval_split_size.")
        k = carve_size(size, n, ranks, train_name, where)
        chosen = sorted(random.Random(seed).sample(range(n), k))
        taken = set(chosen)
        rest = [i for i in range(n) if i not in taken]
        file = rows.split_file(where, train_name)
        if file is not None:  # rows still named by their file's line
            rows.ROW_ORIGIN[(where, train_name)] = (file, rest)
            rows.ROW_ORIGIN[(where, test_name)] = (file, chosen)
        if (where, train_name) in rows.CONVERTED:
            rows.CONVERTED.add((where, test_name))
        if (where, train_name) in rows.READ_AS:
            rows.READ_AS[(where, test_name)] = rows.READ_AS[(where, train_name)]
        return (train.select(rest), train.select(chosen),
                f"{k} of the {n} rows of `{train_name}` held out (eval_split_size {size:g}, seed {seed})")
    return train, None, None


def shared_rows(train, evaluation) -> int:
    """Eval rows that are also training rows, compared on the columns both have."""
    cols = [c for c in evaluation.column_names if c in set(train.column_names)]
    key = lambda row: json.dumps(row, sort_keys=True, default=str)  # noqa: E731
    seen = {key(r) for r in train.select_columns(cols)}
    return sum(key(r) in seen for r in evaluation.select_columns(cols))


def load_splits(script_args, dataset_args, want_eval: bool, check, pack=None, seed: int = 42,
                text_field: str = "text", ranks: int = 1):
    """(train, eval or None), with one-line errors for missing splits; `check(split, where)` is the trainer kind's
    column check (SFT's check_columns, DPO's). `want_eval`: True needs an eval split, False returns None for it,
    IF_ANY the one there is. `pack`: the recipe's PackArguments (dataset_format, eval_split_size); `seed`: the
    run's, which chooses the held-out rows; `ranks`: the job's processes, each of which needs a training row."""
    NOTES.clear()
    WARNINGS.clear()
    NO_EVAL.clear()
    ds = load_raw(script_args, dataset_args, pack, text_field, seed)
    where = script_args.dataset_name or "mixture"
    splits = list(ds.keys())
    train_split, test_split = script_args.dataset_train_split, script_args.dataset_test_split
    if train_split not in ds:
        raise UserError(f"dataset {where} has no `{train_split}` split (it has {splits}). Fix: set dataset_train_split.")
    check(ds[train_split], where)
    check_named_eval_split(ds, where, train_split, test_split)
    train, evaluation, how = held_out(ds, script_args, pack, seed, where, ranks)
    if evaluation is None:
        looked = (f"also looked for {', '.join(n for n in EVAL_NAMES if n != test_split)}" if test_split == "test"
                  else "a split named otherwise is not looked for")
        refusal = UserError(
            f"eval is on but dataset {where} has no `{test_split}` split (it has {splits}; {looked}). Fix: set "
            "dataset_test_split, eval_split_size: 0.1 (hold out 10% of the training rows), or eval_strategy: \"no\"."
        )
        if want_eval and want_eval != IF_ANY:
            raise refusal
        NO_EVAL.append(refusal)
        looked = f"looked for {', '.join(EVAL_NAMES)}" if test_split == "test" else f"no `{test_split}` split"
        NOTES.append(f"eval split: none in {where} ({looked}): nothing is scored as held out. Fix: eval_split_size: "
                     "0.1 holds out 10% of the training rows")
        return train, None
    check(evaluation, where)
    NOTES.append(f"eval split: {how}")
    if hasattr(evaluation, "__len__") and (shared := shared_rows(train, evaluation)):
        WARNINGS.append(f"{shared} of the {len(evaluation)} eval rows also appear in the training data: their scores "
                        "are not held out")
    return train, (evaluation if want_eval else None)


def check_named_eval_split(ds, where: str, train_split: str, test_split: str) -> None:
    """A dataset_test_split named other than `test` (the default, whose absence starts the lookup by the usual
    names) that the data lacks while it has a split besides the training one: a typo or another name for the split
    that is there (`validation` for a folder's test.jsonl), which held out nothing, without a word, and trained on
    no held-out rows. One line naming the splits, as a missing dataset_train_split is. Data of the training split
    alone keeps the rules (eval_split_size carves that name; else no eval split, refused where eval is on)."""
    others = [name for name in ds if name != train_split]
    if test_split == "test" or test_split in ds or not others:
        return
    usual = "" if "test" in others else f", or to `test` (the default: the first of {', '.join(EVAL_NAMES)} there is)"
    raise UserError(f"dataset {where} has no `{test_split}` split, which dataset_test_split names (it has "
                    f"{list(ds.keys())}). Fix: set dataset_test_split to {' or '.join(f'`{n}`' for n in others)} "
                    f"(--dataset_test_split {others[0]}){usual}.")


def load_sft_datasets(script_args, dataset_args, want_eval: bool, text_field: str = "text", pack=None,
                      seed: int = 42):
    """(train, eval or None) for SFT, with one-line errors for missing splits and wrong columns."""
    return load_splits(script_args, dataset_args, want_eval, lambda ds, where: check_columns(ds, where, text_field),
                       pack, seed, text_field)


def load_for(cfg, want_eval: bool, check):
    """load_splits with a run's settings: its dataset_format, eval_split_size, seed and text field."""
    return load_splits(cfg.script, cfg.mixture, want_eval, check, cfg.pack, cfg.training.seed,
                       getattr(cfg.training, "dataset_text_field", None) or "text", job_ranks(cfg.training))


def job_ranks(training) -> int:
    """The job's processes as the trainer config sees them: the launcher's and `make data`'s config is parsed with
    the job's world size (config/run_config.py as_seen_by_ranks), a rank's has its process group's; 1 where
    neither is known."""
    try:
        return max(1, int(training.world_size))
    except Exception:  # noqa: BLE001 -- a config without torch's state (a test's namespace): one process
        return 1


def is_local(script_args, mixture) -> bool:
    """Whether the data is on this machine (a file or folder; a mixture whose sources all are), so that the
    launcher can read and check it before any rank starts."""
    if mixture.datasets:
        def local(source):
            files = source.data_files
            files = [files] if isinstance(files, str) else list(files or [])
            return (files and all(Path(f).is_file() for f in files)) or looks_local(source.path)
        return all(local(s) for s in mixture.datasets)
    return bool(script_args.dataset_name) and looks_local(script_args.dataset_name)
