"""What the pack knows of one dataset's format once it is declared (`dataset_format:`) or detected: `Spec`, the
format's name, the file's column for each of the format's columns and the file's name for each chat role; and the
chat roles themselves, which every chat check and conversion shares.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ROLES = ("system", "user", "assistant", "tool")  # the roles chat templates know
DOCS = "docs/training.md#dataset-formats"


@dataclass(frozen=True)
class Spec:
    """A format's name, the file's column for each of its columns (slot -> column) and the file's role names."""

    name: str
    columns: dict = field(default_factory=dict)  # slot -> the file's column
    roles: dict = field(default_factory=dict)  # the file's role name -> chat role

    def column(self, slot: str) -> str:
        return self.columns.get(slot, slot)


def renamed(ds, spec: Spec, slots: tuple[str, ...], target: dict | None = None):
    """The dataset with the file's column for each slot renamed to the slot's name (or to `target[slot]`): the
    conversion of a layout TRL takes as it is, written with other column names."""
    renames = {}
    for slot in slots:
        src, dst = spec.column(slot), (target or {}).get(slot, slot)
        if src != dst and src in ds.column_names:
            renames[src] = dst
    return ds.rename_columns(renames) if renames else ds


SHOWN = 20  # names a one-line error lists before "and N more"


def names_shown(names, limit: int = SHOWN) -> str:
    """A list of column (or key) names for a one-line error, sorted: the first `limit` and how many more (a JSON file
    of one object read as one row had 8,000 "columns", and the error that listed them was 56 KB on one line)."""
    names = sorted(str(n) for n in names)
    shown = repr(names[:limit])
    return shown if len(names) <= limit else f"{shown[:-1]}, ...] and {len(names) - limit:,} more"
