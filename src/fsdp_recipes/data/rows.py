"""Where a dataset's row is: its file and line (or its row of a JSON array), for every one-line error about a row
(the format checks, the trainer kinds' checks, `make data`'s examples), also for rows of a split carved off another;
and the rows as the file holds them.

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


def file_layout(path: Path) -> str | None:
    """How a data file holds its rows, as datasets reads it: "lines" (JSON Lines, also in a .json file), "array" (a
    JSON array, also in a .jsonl file), "csv"; None for another file (Parquet, compressed)."""
    if path.suffix == ".csv":
        return "csv"
    if path.suffix not in (".json", ".jsonl") or not path.is_file():
        return None
    return read_once(path, "layout", first_row_layout)


def first_row_layout(path: Path) -> str:
    with open(path, encoding="utf-8-sig", errors="replace") as f:
        for line in f:
            if line.strip():
                return "array" if line.lstrip().startswith("[") else "lines"
    return "lines"


def line_of(path: Path, index: int) -> int:
    """The line (as an editor counts them, from 1) of row `index` of a JSON Lines file: datasets skips blank lines,
    so row i is the i-th line that is not blank."""
    starts = row_starts(path, "lines")
    return starts[index] if index < len(starts) else index + 1


def csv_line_of(path: Path, index: int) -> int:
    """The line where row `index` of a CSV file starts (the header is line 1; a quoted cell may span lines, and
    blank lines are skipped, as pandas reads it)."""
    starts = row_starts(path, "csv")
    return starts[index] if index < len(starts) else index + 2


# (path, what) -> ((mtime, size), what the file says): a format's conversion names every row it converts (data/chat.py
# hands each turn its row's place), and reading the file (up to the row) for each made a 20,000-row ShareGPT or
# Alpaca file take a minute to convert; read once while the file is unchanged
READ: dict[tuple[Path, str], tuple[tuple[int, int], object]] = {}


def read_once(path: Path, what: str, read):
    """`read(path)`, remembered while the file's time and size stay the same."""
    stat = path.stat()
    stamp = (stat.st_mtime_ns, stat.st_size)
    cached = READ.get((path, what))
    if cached is None or cached[0] != stamp:
        cached = READ[(path, what)] = (stamp, read(path))
    return cached[1]


def row_starts(path: Path, layout: str) -> list[int]:
    """The line (from 1) each row of a JSON Lines ("lines") or CSV ("csv") file starts on."""
    return read_once(path, layout, csv_starts if layout == "csv" else lines_starts)


def lines_starts(path: Path) -> list[int]:
    with open(path, encoding="utf-8-sig", errors="replace") as f:
        return [number for number, line in enumerate(f, 1) if line.strip()]


def csv_starts(path: Path) -> list[int]:
    import csv

    starts = []
    with open(path, newline="", encoding="utf-8-sig", errors="replace") as f:
        reader, start, header = csv.reader(f), 1, True
        for cells in reader:
            if cells and not header:
                starts.append(start)
            header = header and not cells
            start = reader.line_num + 1
    return starts


def place_of(path: Path, index: int) -> str:
    """Row `index` of a data file, as an editor finds it: `file:line` (JSON Lines, CSV), or `file, row N of its
    JSON array` (1-based)."""
    layout = file_layout(path)
    if layout == "array":
        return f"{path}, row {index + 1} of its JSON array"
    return f"{path}:{csv_line_of(path, index) if layout == 'csv' else line_of(path, index)}"


def written_in(path: Path) -> list | None:
    """The rows as a JSON file holds them (a number among strings stays a number), None for another file."""
    layout = file_layout(path)
    if layout == "array":
        return json.loads(path.read_text(encoding="utf-8-sig"))
    if layout == "lines":
        return [json.loads(line) for line in path.read_text(encoding="utf-8-sig").splitlines() if line.strip()]
    return None


def count_rows(path: Path) -> int:
    """How many rows datasets reads from a data file (split_file's)."""
    written = written_in(path)
    if written is not None:
        return len(written)
    import csv

    with open(path, newline="", encoding="utf-8-sig", errors="replace") as f:
        return max(0, sum(1 for cells in csv.reader(f) if cells) - 1)  # the header is no row


def split_file(where: str, split: str) -> Path | None:
    """The data file that holds a split of the dataset `where` (a file, or a folder of <split>.jsonl), if any: JSON
    Lines, a JSON array or CSV, whose rows place_of names."""
    if (where, split) in ROW_ORIGIN:
        return ROW_ORIGIN[(where, split)][0]
    if not where:  # a `datasets:` mixture: its sources name their own rows while they are converted
        return None
    path = Path(where)
    if path.is_dir():  # datasets names a folder's splits by these words in its file names (dev.jsonl: validation)
        names = [split, *SPLIT_KEYWORDS.get(split, ())]
        return next((path / f"{n}{ext}" for n in names for ext in (".jsonl", ".json", ".csv")
                     if (path / f"{n}{ext}").is_file()), None)
    return path if path.is_file() and file_layout(path) is not None else None


def row_at(where: str, split: str, index: int) -> str:
    """A row, and its place in its file (place_of: its line, or its row of a JSON array); else its row, from 1."""
    file = split_file(where, split)
    if file is None:
        return f"{where} ({split} split), row {index + 1}"
    if (where, split) in ROW_ORIGIN:
        index = ROW_ORIGIN[(where, split)][1][index]
    return place_of(file, index)


def written_rows(ds, where: str, split: str):
    """The split's rows as its JSON Lines file holds them, where it is one and the pack did not convert them (Arrow
    gives a column one type, so a number among strings comes back as a string); else the dataset's rows."""
    file = split_file(where, split)
    if file is None:
        return iter(ds)
    if (where, split) in CONVERTED:  # the pack converted the file's format: the rows are the dataset's
        return iter(ds)
    rows = written_in(file)
    if rows is None:  # CSV: every cell is read as text (data/loading.py), as the file holds it
        return iter(ds)
    if (where, split) in ROW_ORIGIN:
        rows = [rows[i] for i in ROW_ORIGIN[(where, split)][1]]
    return iter(rows)


