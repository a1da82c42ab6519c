"""`dataset_format:` as written, checked against the registry (data/formats/), and the format of one loaded
dataset: the declaration checked against its columns, or the format detected from its columns and first row; and the
one line the launcher prints about it.

A declaration is the format's name, then optionally `slot=column` (the file's column for one of the format's
columns) and, for the chat formats, `name=role` (the file's role name for a chat role):
`dataset_format: alpaca instruction=question output=answer`, `dataset_format: sharegpt bot=assistant`; the words are
split as a shell splits them, so a column name with spaces is quoted: `prompt_completion completion='Adj. Close*'`.
The names it accepts are the registry's: config/run_config.py (a layer below) does not list them, and
train/run_checks.py checks a recipe's declaration here before any row is read.
"""

from __future__ import annotations

import re
import shlex
from typing import NoReturn

from fsdp_recipes.data import formats
from fsdp_recipes.data.spec import DOCS, ROLES, Spec, names_shown
from fsdp_recipes.errors import UserError


def parse_spec(text: str | None) -> Spec | None:
    """`dataset_format:` as written -> Spec, or one line naming what is wrong."""
    if text is None or not str(text).strip():
        return None
    words = split_words(str(text))
    name, pairs = words[0], words[1:]
    if name not in formats.FORMATS:
        raise UserError(f"dataset_format {name!r} is not one of {', '.join(formats.names())}. Fix: name one of those "
                        f"(then optionally slot=column or name=role; {DOCS}), or remove it to detect the format.")
    fmt, columns, roles = formats.load(name), {}, {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key or not value:
            raise UserError(f"dataset_format {text!r}: {pair!r} is not slot=column or name=role. Fix: write e.g. "
                            f"`{name} {fmt.slots[0]}=my_column`.")
        if key in fmt.slots:
            columns[key] = value
        elif fmt.chat and value in ROLES:
            roles[key] = value
        else:
            also = f", or a role name mapped to one of {', '.join(ROLES)}" if fmt.chat else ""
            raise UserError(f"dataset_format {text!r}: {key!r} is not a column of the {name} format "
                            f"({', '.join(fmt.slots)}){also}. Fix: use one of those on the left of `=`.")
    return Spec(name, columns, roles)


def split_words(text: str) -> list[str]:
    """The declaration's words, split as a shell splits them (shlex), commas separating too: a column name with a
    space or a comma is quoted, `prompt_completion prompt=Date completion='Adj. Close*'`."""
    if not re.search(r"""(^|[\s,=])['"]""", text):  # no value starts with a quote: `completion=it's` stays whole
        return [w for w in re.split(r"[\s,]+", text.strip()) if w] or split_nothing(text)
    lexer = shlex.shlex(text, posix=True)
    lexer.whitespace += ","
    lexer.whitespace_split = True
    lexer.commenters = ""
    lexer.escape = ""  # a backslash is part of a column name, not an escape
    try:
        words = list(lexer)
    except ValueError as err:  # "No closing quotation", "No escaped character"
        raise UserError(f"dataset_format {text!r}: {str(err)[0].lower()}{str(err)[1:]}. Fix: close the quotes around a "
                        "column name that has spaces, e.g. `prompt_completion completion='Adj. Close*'`.") from None
    return words or split_nothing(text)


def split_nothing(text: str) -> NoReturn:
    raise UserError(f"dataset_format {text!r} names no format. Fix: name one of {', '.join(formats.names())}.")


def detect(columns: list[str], first: dict | None, text_field: str = "text") -> Spec | None:
    """The Spec of the format a dataset's columns (and first row) fit (formats.detect); None when none fits."""
    fmt = formats.detect(columns, first, text_field)
    return None if fmt is None else Spec(fmt.name, fmt.default_columns(text_field) if text_field != "text" else {})


def resolve(ds, where: str, declared: str | None, text_field: str = "text") -> Spec | None:
    """The Spec for one loaded dataset: the declaration, checked against its columns, or the detected format."""
    spec = parse_spec(declared)
    cols = list(ds.column_names or [])
    if spec is None:
        first = ds[0] if len(ds) else None
        return detect(cols, first, text_field)
    fmt = formats.load(spec.name)
    spec = Spec(spec.name, {**fmt.default_columns(text_field), **spec.columns}, spec.roles)
    missing = [spec.column(c) for c in fmt.COLUMNS if spec.column(c) not in cols]
    if missing:
        raise UserError(f"dataset {where} is declared `dataset_format: {declared}` but has no column "
                        f"{', '.join(f'`{m}`' for m in missing)} (it has {names_shown(cols)}; one {spec.name} row: "
                        f"{fmt.HELP}). Fix: map the column "
                        f"(`{spec.name} {fmt.COLUMNS[0]}=<column>`), or remove dataset_format to detect the format.")
    return spec


def describe(spec: Spec, where: str, declared: bool, columns: list[str]) -> str:
    """The one line the launcher prints: what it found, and how it maps."""
    fmt = formats.load(spec.name)
    cols = [spec.column(c) for c in fmt.slots if spec.column(c) in columns or c in fmt.COLUMNS]
    how = f" -> {fmt.BECOMES}" if fmt.BECOMES else " (as TRL takes it)"
    mapped = [f"{spec.column(c)} as {c}" for c in fmt.slots if spec.column(c) != c]
    roles = {**(fmt.ROLE_NAMES or {}), **spec.roles}
    if roles:
        mapped.append("roles " + ", ".join(f"{k} -> {v}" for k, v in roles.items()))
    source = "declared by dataset_format" if declared else f"detected; declare it with `dataset_format: {spec.name}`"
    return (f"data {where}: {fmt.LABEL} ({', '.join(cols)}){how}" + (f"; {'; '.join(mapped)}" if mapped else "")
            + f" ({source})")


def convert(ds, spec: Spec | None, at, text_field: str = "text"):
    """The dataset in the layout TRL takes, by its format's conversion; `at(i)` names row i (file:line)."""
    return ds if spec is None else formats.load(spec.name).convert(ds, spec, at, text_field)
