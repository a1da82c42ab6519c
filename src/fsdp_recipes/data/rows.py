"""The dataset's rows, checked in the launcher before any rank loads them: one line with the file and the line.

Gap it fills: `datasets` reports a malformed JSON line as a DatasetGenerationError without the line, and TRL
takes an empty split, a role it does not know or a non-string content, and fails (or trains on nothing) inside every
rank. What max_length cuts is train/data_lengths.py's. Run by the launcher only (launcher.check_recipe); the ranks load the same
files after it passed.
"""

from __future__ import annotations

import json
from pathlib import Path

from fsdp_recipes.errors import UserError

ROLES = {"system", "user", "assistant", "tool"}
CONVERSATION_COLUMNS = ("messages", "prompt", "completion")


# (where, split) -> (file, the file's row index of each row of the split): rows of a split carved off another
# (loading.held_out) are still named by their line in the file
ROW_ORIGIN: dict[tuple[str, str], tuple[Path, list[int]]] = {}
# datasets' SPLIT_KEYWORDS (datasets/data_files.py): the file names a local folder's splits are read from
SPLIT_KEYWORDS = {"train": ("train", "training"), "validation": ("validation", "valid", "dev", "val"),
                  "test": ("test", "testing", "eval", "evaluation")}
CONVERTED: set[tuple[str, str]] = set()  # (where, split) whose rows the pack converted from another format


def check_file_bytes(path: Path) -> None:
    """What `datasets` would read wrongly or refuse without naming the file: a byte that is not UTF-8 (pyarrow loads
    it, and the row fails to decode when it is read, in a rank) and a file of blank lines only ("corresponds to no
    data"). A byte-order mark, Windows line endings and blank lines are read as datasets reads them. Parquet is
    binary: not scanned."""
    if path.suffix not in (".json", ".jsonl", ".csv"):
        return
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


def line_of(path: Path, index: int) -> int:
    """The line (as an editor counts them, from 1) of row `index` of a JSON Lines file: datasets skips blank lines,
    so row i is the i-th line that is not blank."""
    with open(path, encoding="utf-8-sig", errors="replace") as f:
        row = -1
        for number, line in enumerate(f, 1):
            if line.strip():
                row += 1
                if row == index:
                    return number
    return index + 1


def find_bad_json_line(path: Path) -> str | None:
    """`file:line: problem` for the first line of a JSON Lines file that does not parse, else None."""
    with open(path, encoding="utf-8-sig", errors="replace") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                json.loads(line)
            except json.JSONDecodeError as err:
                return f"{path}:{number}: {err.msg} (column {err.colno})"
    return None


def explain_load_failure(path: Path, err: Exception) -> UserError:
    """A load_dataset failure on local files, as one line: the bad JSON line when there is one."""
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.suffix in (".json", ".jsonl"))
    for f in files:
        if f.stat().st_size == 0:
            return UserError(f"the dataset file {f} is empty. Fix: put the rows in it, or remove it.")
    for f in files:
        if f.suffix == ".jsonl" and (bad := find_bad_json_line(f)):
            return UserError(f"malformed JSON line in the dataset: {bad}. Fix: correct or remove that line "
                             "(one JSON object per line).")
    cause = err.__cause__ or err
    first = next((x.strip() for x in str(cause).splitlines() if x.strip()), type(cause).__name__)
    return UserError(f"cannot read the dataset {path}: {type(cause).__name__}: {first}. Fix: check that the "
                     "file is valid JSON Lines / JSON / Parquet / CSV.")


def split_file(where: str, split: str) -> Path | None:
    """The JSON Lines file that holds a split of the dataset `where` (a file, or a folder of <split>.jsonl), if any."""
    if (where, split) in ROW_ORIGIN:
        return ROW_ORIGIN[(where, split)][0]
    if not where:  # a `datasets:` mixture: its sources name their own rows while they are converted
        return None
    path = Path(where)
    if path.is_dir():  # datasets names a folder's splits by these words in its file names (dev.jsonl: validation)
        names = [split, *SPLIT_KEYWORDS.get(split, ())]
        return next((path / f"{n}.jsonl" for n in names if (path / f"{n}.jsonl").is_file()), None)
    return path if path.suffix == ".jsonl" and path.is_file() else None


def row_at(where: str, split: str, index: int) -> str:
    """A row, and its line when the split is one JSON Lines file (blank lines skipped, as datasets skips them)."""
    file = split_file(where, split)
    if file is None:
        return f"{where} ({split} split), row {index}"
    if (where, split) in ROW_ORIGIN:
        index = ROW_ORIGIN[(where, split)][1][index]
    return f"{file}:{line_of(file, index)}"


def written_rows(ds, where: str, split: str):
    """The split's rows as its JSON Lines file holds them, where it is one and the pack did not convert them (Arrow
    gives a column one type, so a number among strings comes back as a string); else the dataset's rows."""
    file = split_file(where, split)
    if file is None:
        return iter(ds)
    if (where, split) in CONVERTED:  # the pack converted the file's format: the rows are the dataset's
        return iter(ds)
    rows = [json.loads(line) for line in file.read_text(encoding="utf-8-sig").splitlines() if line.strip()]
    if (where, split) in ROW_ORIGIN:
        rows = [rows[i] for i in ROW_ORIGIN[(where, split)][1]]
    return iter(rows)


def conversational(ds) -> bool:
    cols = [c for c in CONVERSATION_COLUMNS if c in ds.column_names]
    return bool(cols) and len(ds) > 0 and isinstance(ds[0][cols[0]], list)


def check_rows(ds, where: str, split: str) -> list[str]:
    """Errors for an empty split and malformed conversations; warnings (returned) for rows that are skipped."""
    if len(ds) == 0:
        raise UserError(f"the `{split}` split of the dataset {where} is empty. Fix: point dataset_name at data with "
                        "rows (or the split at another file).")
    chat = conversational(ds)
    if not chat:
        check_text_rows(ds, where, split)
        return []
    cols = [c for c in CONVERSATION_COLUMNS if c in ds.column_names]
    without_assistant = 0
    for i, row in enumerate(ds.select_columns(cols)):
        for c in cols:
            if not isinstance(row[c], list):
                raise UserError(f"{row_at(where, split, i)}: `{c}` is {kind_of(row[c])}, not a list of chat turns as "
                                f"in the other rows. Fix: give the row its {c} turns, or remove the row.")
        turns = [t for c in cols for t in row[c]]
        for turn in turns:
            role = turn.get("role") if isinstance(turn, dict) else None
            if role not in ROLES:
                raise UserError(f"{row_at(where, split, i)}: role {role!r} is not one of {sorted(ROLES)}. Fix: "
                                "rename the role (chat templates know only these).")
            content = turn.get("content")
            if not isinstance(content, str) and not (content is None and turn.get("tool_calls")):
                raise UserError(f"{row_at(where, split, i)}: a {role} turn's content is {type(content).__name__}, not "
                                "text. Fix: make every content a string.")
        if not any(t.get("role") == "assistant" for t in turns):
            without_assistant += 1
    if without_assistant == len(ds):
        raise UserError(f"no row of the `{split}` split of {where} has an assistant turn, so there is nothing to "
                        "learn. Fix: add the assistant's answers (role: assistant).")
    if without_assistant:
        return [f"{without_assistant} of {len(ds)} rows of the `{split}` split have no assistant turn; they teach "
                "nothing"]
    return []


def kind_of(value) -> str:
    return "missing" if value is None else type(value).__name__


def check_text_rows(ds, where: str, split: str) -> None:
    """Plain-text prompt + completion rows: both are text in every row (a row without one is a null here)."""
    cols = [c for c in ("prompt", "completion") if c in ds.column_names]
    if len(cols) < 2:
        return
    for i, row in enumerate(ds.select_columns(cols)):
        for c in cols:
            if not isinstance(row[c], str):
                raise UserError(f"{row_at(where, split, i)}: `{c}` is {kind_of(row[c])}, not text as in the other "
                                f"rows. Fix: give the row its {c}, or remove the row.")


def check_chat_template(tokenizer, model: str, where: str) -> None:
    if getattr(tokenizer, "chat_template", None) is None:
        raise UserError(f"the dataset {where} is conversational but the tokenizer of {model} has no chat template. "
                        "Fix: set chat_template_path, use a model whose tokenizer has one, or convert the data to a "
                        "text field.")
