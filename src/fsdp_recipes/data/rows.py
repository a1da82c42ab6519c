"""Where a dataset's row is: its file and line, for every one-line error about a row (the format checks, the trainer
kinds' checks, `make data`'s examples), also for rows of a split carved off another; and the rows as the file holds
them.

Gap it fills: `datasets` names neither the file nor the line of a row, and Arrow gives a column one type (a number
among strings comes back as a string). The registries below are filled by data/loading.py, once per load.
"""

from __future__ import annotations

import json
from pathlib import Path

# (where, split) -> (file, the file's row index of each row of the split): rows of a split carved off another
# (loading.held_out) are still named by their line in the file
ROW_ORIGIN: dict[tuple[str, str], tuple[Path, list[int]]] = {}
# datasets' SPLIT_KEYWORDS (datasets/data_files.py): the file names a local folder's splits are read from
SPLIT_KEYWORDS = {"train": ("train", "training"), "validation": ("validation", "valid", "dev", "val"),
                  "test": ("test", "testing", "eval", "evaluation")}
CONVERTED: set[tuple[str, str]] = set()  # (where, split) whose rows the pack converted from another format
READ_AS: dict[tuple[str, str], str] = {}  # (where, split) -> the format its rows were read in (data/formats/)


def clear() -> None:
    """Forget the last load's rows (data/loading.py load_splits, before it loads)."""
    ROW_ORIGIN.clear()
    CONVERTED.clear()
    READ_AS.clear()


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


