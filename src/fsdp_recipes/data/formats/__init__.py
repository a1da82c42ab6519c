"""Dataset formats: one module each in this folder, and one registry, FORMATS, built from the modules at import.
Everything outside this folder asks the registry and the format (`formats.load(name)`, `formats.detect`,
`formats.check_rows`), never a format's name; adding a format is adding its module here (docs/architecture.md).

A format module provides (DataFormat below checks it when FORMATS is built, at import; a missing member is a
TypeError that names it):
    LABEL                 what the launcher's line calls it ("ShareGPT")
    COLUMNS               the columns that identify it, by their default names (a declaration may map each: slot=col)
    HELP                  one row of it, as the docs show it and a declared column that is missing is told
    ORDER                 where it stands in the lists users see; detection prefers, among the formats whose columns
                          a row has, the one that claims the most of them, then the one listed first
    convert(ds, spec, at, text_field)  the dataset in the layout TRL takes (datasets' map, one pass); a row that does
                          not fit is one line naming `at(i)`, its file and line
    check_rows(ds, where, split)  the rows as converted, in the launcher before any rank starts: errors with file
                          and line (data/rows.py row_at); returns the warnings
and, for a layout TRL takes as it is (no LAYOUT), how its rows are measured (data/lengths.py, `make data`,
`make plan --time`):
    ANSWERS               the answers of a row ("answer",), or ("chosen", "rejected") for a pair
    plan_row(row, batch, t)  a row's texts queued in a data/tokenizing.py Batch: its prompt, its sequences, where its
                          loss starts
    sequences(row, tokens, t)  a row's training sequences, tokenized one by one, with the loss's mask (`make data`)
    trained(t)            what the loss counts, in words
Optional, with the defaults of DataFormat: OPTIONAL (more columns it reads), ROLE_NAMES (a chat format: the file's
role names it maps, named in the launcher's line; a declaration may add name=role), LAYOUT (the registered layout
its rows become) and BECOMES (that, in the launcher's words), fits(columns, first, text_field) (detection beyond the
columns: `messages` must hold a list), default_columns(text_field) (a slot's column by default: the text field),
HAS_PROMPT (False: a layout without a prompt) and describe_row(row) (`make data`'s words on one row: a label).
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from collections.abc import Callable
from types import ModuleType

from fsdp_recipes.data import row_checks, rows

NOT_MEMBERS = ("name", "module")  # DataFormat's fields that the registry fills, not the module
LAYOUT_MEMBERS = ("ANSWERS", "plan_row", "sequences", "trained")  # required of a layout TRL takes as it is


def _no_columns(text_field: str) -> dict:
    return {}


def _nothing(row: dict) -> str:
    return ""


@dataclasses.dataclass(frozen=True)
class DataFormat:
    """What loading, the checks, the lengths, `make data` and `make plan` ask of a format. Built from the format's
    module by `from_module`: a missing member fails there, when the registry is built, not while a file is read."""

    name: str
    LABEL: str
    COLUMNS: tuple
    HELP: str
    ORDER: int
    convert: Callable
    check_rows: Callable
    OPTIONAL: tuple = ()
    ROLE_NAMES: dict | None = None  # None: not a chat format
    LAYOUT: str = ""  # "": TRL takes it as it is
    BECOMES: str = ""
    fits: Callable | None = None
    default_columns: Callable = _no_columns
    ANSWERS: tuple | None = None
    plan_row: Callable | None = None
    sequences: Callable | None = None
    trained: Callable | None = None
    HAS_PROMPT: bool = True
    describe_row: Callable = _nothing
    module: ModuleType | None = None

    @classmethod
    def from_module(cls, name: str, module: ModuleType) -> DataFormat:
        members = {f.name: getattr(module, f.name) for f in dataclasses.fields(cls)
                   if f.name not in NOT_MEMBERS and hasattr(module, f.name)}
        layout = members.get("LAYOUT", "")
        required = required_members() + ([] if layout else list(LAYOUT_MEMBERS))
        for member in required:
            if member not in members:
                also = "" if member in required_members() else \
                    " (a layout TRL takes as it is; a format that becomes another names it in LAYOUT)"
                raise TypeError(f"data format {name} ({module.__name__}) lacks {member}: every format provides "
                                f"{', '.join(required)}{also} (fsdp_recipes/data/formats/__init__.py)")
        return cls(name=name, module=module, **members)

    @property
    def slots(self) -> tuple[str, ...]:
        return self.COLUMNS + self.OPTIONAL

    @property
    def chat(self) -> bool:
        """A chat format: a declaration may map the file's role names to chat roles."""
        return self.ROLE_NAMES is not None

    def matches(self, columns: set, first: dict | None, text_field: str) -> int:
        """How many of the columns it claims, where a dataset of these columns (and first row) is in this format;
        0 where it is not."""
        defaults = self.default_columns(text_field)
        if not {defaults.get(c, c) for c in self.COLUMNS} <= columns:
            return 0
        if self.fits is not None and not self.fits(columns, first, text_field):
            return 0
        return sum(defaults.get(c, c) in columns for c in self.slots)


def required_members() -> list[str]:
    return [f.name for f in dataclasses.fields(DataFormat) if f.name not in NOT_MEMBERS
            and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]


FORMATS: dict[str, DataFormat] = {}


def register(fmt: DataFormat) -> DataFormat:
    """A format into the registry, in its ORDER; its LAYOUT must be a registered layout TRL takes."""
    if fmt.LAYOUT and (fmt.LAYOUT not in FORMATS or FORMATS[fmt.LAYOUT].LAYOUT):
        raise TypeError(f"data format {fmt.name}: LAYOUT {fmt.LAYOUT!r} is not a registered layout TRL takes as it "
                        f"is ({', '.join(n for n, f in FORMATS.items() if not f.LAYOUT)})")
    listed = sorted([*(f for f in FORMATS.values() if f.name != fmt.name), fmt], key=lambda f: f.ORDER)
    FORMATS.clear()
    FORMATS.update((f.name, f) for f in listed)
    return fmt


def _build() -> None:
    found = [DataFormat.from_module(m.name, importlib.import_module(f"{__name__}.{m.name}"))
             for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")]
    for fmt in sorted(found, key=lambda f: bool(f.LAYOUT)):  # the layouts first: the others name one
        register(fmt)


_build()


def load(name: str) -> DataFormat:
    return FORMATS[name]


def names() -> tuple[str, ...]:
    """The formats as the docs list them (ORDER)."""
    return tuple(FORMATS)


def detect(columns, first: dict | None, text_field: str = "text", layouts_only: bool = False) -> DataFormat | None:
    """The format a dataset's columns (and first row) fit: of those that fit, the one that claims the most columns
    (labelled answers hold prompt + completion too; a pair with a `messages` column is still a pair), then the one
    listed first; None when none fits. `layouts_only`: the layouts TRL takes, for rows already converted."""
    cols = set(columns)
    best, claimed = None, 0
    for fmt in FORMATS.values():
        if layouts_only and fmt.LAYOUT:
            continue
        n = fmt.matches(cols, first, text_field)
        if n > claimed:
            best, claimed = fmt, n
    return best


def layout(fmt: DataFormat) -> DataFormat:
    """The layout TRL takes that a format's rows are in once converted."""
    return FORMATS[fmt.LAYOUT] if fmt.LAYOUT else fmt


def check_rows(ds, where: str, split: str, text_field: str = "text") -> list[str]:
    """A split's rows, checked by the format they were read in (rows.READ_AS, which data/loading.py fills), else by
    the layout they are in (a mixture's sources, joined); where none fits, that the split has rows. Errors with file
    and line; returns the warnings."""
    name = rows.READ_AS.get((where, split))
    if name is not None:
        return FORMATS[name].check_rows(ds, where, split)
    fmt = detect(ds.column_names or [], ds[0] if len(ds) else None, text_field, layouts_only=True)
    return (fmt.check_rows if fmt is not None else row_checks.not_empty)(ds, where, split)
