"""The dataset's files, read as `datasets` will read them, before it does: what it would read wrongly or refuse
without naming the file or the line, as one line with both.

Gap it fills: `datasets` reports a malformed JSON line as a DatasetGenerationError without the line, and loads a
byte that is not UTF-8 to fail later, in a rank.
"""

from __future__ import annotations

import json
from pathlib import Path

from fsdp_recipes.config.model_found import absolute_where, looks_local
from fsdp_recipes.data.rows import file_layout
from fsdp_recipes.data.spec import names_shown
from fsdp_recipes.errors import UserError
from fsdp_recipes.paths import in_pack_cache

FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst")  # datasets decompresses these itself (fsspec, by the file's extension)


def local_files(path: Path) -> list[Path]:
    """The data files datasets reads from a local file or folder (those of the builders above)."""
    if path.is_file():
        return [path]
    return sorted(p for p in path.rglob("*") if p.suffix in FILE_BUILDERS and p.is_file()
                  and not any(part.startswith(".") for part in p.relative_to(path).parts))


def file_builder(path: Path) -> str | None:
    """datasets' builder for a data file: by its extension, under a compression's (`qa.jsonl.gz`: json)."""
    suffixes = path.suffixes[-2:]
    if len(suffixes) == 2 and suffixes[1] in COMPRESSIONS:
        return FILE_BUILDERS.get(suffixes[0])
    return FILE_BUILDERS.get(path.suffix)


def check_found(name: str) -> Path:
    """A local dataset_name that names nothing is one line (the launcher asks before the ranks start too)."""
    path = Path(name)
    if not path.exists():
        fix = fix_for_missing(path)
        raise UserError(f"dataset not found: {path}{resolved(path)}. Fix: {fix}{'' if fix.endswith('?') else '.'}")
    return path


def resolved(path: Path) -> str:
    """` (<the absolute path>; ...)` for a relative path: it is taken from the folder the command runs in, and a
    user who wrote it from the recipe's folder (`mine.jsonl` beside sft.yaml) saw only `mine.jsonl`."""
    where = absolute_where(path)
    return f" ({where})" if where else ""


def check_named_found(name: str | None, built_by_checks: bool) -> None:
    """The launcher's, before the ranks start (issue 42: data mistakes within 5 s): a mistyped local dataset_name is
    one line now. Not a hub id or a `datasets:` mixture (checked with the recipe), nor data the checks build: the tiny
    and SmolLM2 assets in the pack's cache, and DPO's pairs from the SFT model's answers (`built_by_checks`)."""
    if name is not None and not built_by_checks and looks_local(name) and not in_pack_cache(name):
        check_found(name)


def fix_for_missing(path: Path) -> str:
    """A close name beside the missing path (a typo), else the tiny default's builder where the path is in the
    pack's cache; else to check dataset_name (the builder was named for any path, a user's own file too)."""
    import difflib

    parent = path.parent if str(path.parent) else Path(".")
    if parent.is_dir():
        close = difflib.get_close_matches(path.name, [p.name for p in parent.iterdir()], n=1, cutoff=0.75)
        if close:
            return f"did you mean {parent / close[0] if str(path.parent) not in ('', '.') else close[0]}?"
    if in_pack_cache(str(path)):
        return "check dataset_name, or build the tiny default's data with `python -m fsdp_recipes.assets.tiny_assets`"
    return "check dataset_name (a file, or a folder of train.jsonl and validation.jsonl)"


# a binary file under a text file's name: (its first bytes, what it is, the fix), the fix given the file's path.
# Without this, its first byte that is not UTF-8 was blamed on an encoding (iconv -f cp1252).
MAGIC = ((b"PAR1", "a Parquet file", lambda p: f"rename it to {p.with_suffix('.parquet').name}"),
         *((magic, f"{name}-compressed", lambda p, s=suffix: f"rename it to {p.name}{s}")
           for magic, name, suffix in ((b"\x1f\x8b", "gzip", ".gz"), (b"\xfd7zX", "xz", ".xz"),
                                       (b"(\xb5/\xfd", "zstd", ".zst"), (b"BZh", "bzip2", ".bz2"))),
         (b"PK\x03\x04", "a zip archive (an Excel workbook is one)",
          lambda p: "export the sheet as CSV (comma-separated) or the rows as JSON Lines"))


def check_not_a_model(path: Path) -> None:
    """A model folder given as dataset_name: datasets reads its JSON files (config.json, tokenizer_config.json) as
    rows, failing (CastError: Couldn't cast) or loading a row of settings."""
    if path.is_dir() and (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        raise UserError(f"the dataset {path} is a model folder (config.json and weights), not data. Fix: point "
                        "dataset_name at your data (a file, or a folder of train.jsonl and validation.jsonl); a "
                        "model goes in model_name_or_path.")


def check_file_bytes(path: Path) -> None:
    """What `datasets` would read wrongly or refuse without naming the file: a byte that is not UTF-8 (pyarrow loads
    it, and the row fails to decode when it is read, in a rank) and a file of blank lines only ("corresponds to no
    data"). A byte-order mark, Windows line endings and blank lines are read as datasets reads them. Parquet is
    binary: not scanned."""
    if path.suffix not in (".json", ".jsonl", ".csv"):
        return
    with open(path, "rb") as f:
        head = f.read(4)
    for magic, kind, fix in MAGIC:
        if head.startswith(magic):
            raise UserError(f"the dataset file {path} is {kind} (its first bytes say so), not the text its name says. "
                            f"Fix: {fix(path)}.")
    with open(path, "rb") as f:
        blank = True
        for number, line in enumerate(f, 1):
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as err:
                raise UserError(f"{path}:{number}: byte 0x{line[err.start]:02x} at column {err.start + 1} is not "
                                "UTF-8 (the file was saved in another encoding, e.g. Latin-1 or Windows-1252). Fix: "
                                f"save the file as UTF-8 (`iconv -f cp1252 -t utf-8`), or correct that line.") from None
            if blank and text.lstrip("\ufeff").strip():
                blank = False
    if blank and path.stat().st_size:
        raise UserError(f"the dataset file {path} holds only blank lines, no rows. Fix: put the rows in it, or remove "
                        "it.")
    check_csv_separator(path)
    check_not_one_object(path)


CSV_SEPARATORS = {";": "semicolons", "\t": "tabs", "|": "vertical bars"}


def check_csv_separator(path: Path) -> None:
    """A CSV file whose columns another character separates (semicolons, as spreadsheets save CSV in many locales;
    tabs): datasets reads commas only, so its header became one column named `prompt;completion` and the error said
    the columns were wrong, not why."""
    if path.suffix != ".csv":
        return
    import csv

    with open(path, newline="", encoding="utf-8-sig", errors="replace") as f:
        header = next(csv.reader(f), [])
    if len(header) != 1:
        return
    for sep, name in CSV_SEPARATORS.items():
        if len([c for c in header[0].split(sep) if c.strip()]) > 1:
            raise UserError(f"{path}:1: the header `{header[0]}` separates its columns with {name}, and datasets "
                            "reads a CSV file's columns separated by commas (it read one column). Fix: save the file "
                            f"with commas (pandas: pd.read_csv(path, sep={sep!r}).to_csv(path, index=False)), or as "
                            "JSON Lines.")


def check_not_one_object(path: Path) -> None:
    """A .json or .jsonl file whose text is one JSON object, not rows: written over several lines (a table of
    settings, or rows nested under a key), or holding its rows as columns (`{"prompt": [...], "completion": [...]}`).
    datasets reads either as ONE row with a column per key, and the column check listed them all (8,000 for
    datasets' own languages.json, a 56 KB line). One object on one line is a JSON Lines file of one row: left alone."""
    if path.suffix not in (".json", ".jsonl") or file_layout(path) != "lines":
        return
    with open(path, encoding="utf-8-sig", errors="replace") as f:
        lines = (line for line in f if line.strip())
        first = next(lines, "")
        try:
            obj, spread = json.loads(first), False
        except json.JSONDecodeError:
            obj, spread = None, True
        if not spread and next(lines, None) is not None:  # JSON Lines: a row on each line
            return
    if spread:
        try:
            obj = json.loads(path.read_text(encoding="utf-8-sig", errors="replace"))
        except json.JSONDecodeError:  # a malformed JSON Lines file: explain_load_failure names its line
            return
    if not isinstance(obj, dict) or not obj:
        return
    # columns: lists of one length of plain values (a chat row's lists hold turns, dicts)
    columns = (all(isinstance(v, list) for v in obj.values()) and len({len(v) for v in obj.values()}) == 1
               and len(next(iter(obj.values()))) > 1 and not any(isinstance(x, dict) for v in obj.values() for x in v))
    if not spread and not columns:
        return
    nested = next((k for k, v in obj.items() if isinstance(v, list) and v and all(isinstance(r, dict) for r in v)),
                  None)
    if columns:
        what = (f"holds its rows as columns: one JSON object of {len(obj)} lists ({names_shown(obj, 5)}), which "
                "datasets reads as one row")
        fix = ("write one object per row, as JSON Lines (pandas: pd.read_json(path).to_json(\"rows.jsonl\", "
               "orient=\"records\", lines=True))")
    else:
        what = (f"is a single JSON object ({len(obj):,} keys: {names_shown(obj, 5)}), not a list of rows or a JSON "
                "Lines file: datasets reads it as one row with a column per key")
        fix = ("write the rows as JSON Lines (one JSON object per line) or as a JSON array of objects"
               + (f"; its rows look to be the {len(obj[nested])} objects under `{nested}`: jq -c '.{nested}[]' "
                  f"{path.name} > rows.jsonl" if nested else ""))
    raise UserError(f"the dataset file {path} {what}. Fix: {fix}.")


def find_bad_json_line(path: Path) -> str | None:
    """`file:line: problem (column N)` for the first line of a JSON Lines file that does not parse, else None. The
    line is parsed without its line ending: with it, a line cut short after `"completion":` failed on the newline,
    "line 2, column 1" of the text parsed, and the error said column 1 of the file's line."""
    with open(path, encoding="utf-8-sig", errors="replace") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                json.loads(line.rstrip("\r\n"))
            except json.JSONDecodeError as err:
                return f"{path}:{number}: {err.msg} (column {err.pos + 1})"
    return None


def explain_load_failure(path: Path, err: Exception) -> UserError:
    """A load_dataset failure on local files, as one line: the bad JSON line when there is one."""
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.suffix in (".json", ".jsonl"))
    for f in files:
        if f.stat().st_size == 0:
            return UserError(f"the dataset file {f} is empty. Fix: put the rows in it, or remove it.")
    for f in files:
        if file_layout(f) == "array":  # a JSON array (datasets reads one in a .jsonl file too): its line and column
            try:
                json.loads(f.read_text(encoding="utf-8-sig"))
            except json.JSONDecodeError as bad:
                return UserError(f"malformed JSON in the dataset: {f}:{bad.lineno}: {bad.msg} (column {bad.colno}) "
                                 "of its JSON array. Fix: correct the array there (or write one JSON object per "
                                 "line).")
            continue
        if f.suffix == ".jsonl" and (bad := find_bad_json_line(f)):
            return UserError(f"malformed JSON line in the dataset: {bad}. Fix: correct or remove that line "
                             "(one JSON object per line).")
    cause = err.__cause__ or err
    if path.is_dir() and type(cause).__name__ == "EmptyDatasetError":  # datasets found no data file in the folder
        return UserError(f"the dataset folder {path} holds no data file. Fix: put the rows in it as train.jsonl (and "
                         "validation.jsonl), or point dataset_name at a file.")
    first = next((x.strip() for x in str(cause).splitlines() if x.strip()), type(cause).__name__)
    if path.is_dir() and len(found := local_files(path)) > 1:  # datasets joins a folder's files into its splits
        shown = ", ".join(str(f.relative_to(path)) for f in found[:4]) + (f" and {len(found) - 4} more"
                                                                          if len(found) > 4 else "")
        return UserError(f"cannot read the dataset folder {path}: datasets reads its {len(found)} data files "
                         f"({shown}) together, as the splits their names say, and they do not fit together "
                         f"({type(cause).__name__}: {first}). Fix: point dataset_name at one file, or keep only "
                         "train, validation and test files with the same columns in the folder.")
    return UserError(f"cannot read the dataset {path}: {type(cause).__name__}: {first}. Fix: check that the "
                     "file is valid JSON Lines / JSON / Parquet / CSV.")
