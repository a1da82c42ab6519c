"""A text field: `{"text": ...}` (or the column dataset_text_field names), as TRL takes it: every token trained."""

from __future__ import annotations

from fsdp_recipes.data import row_checks
from fsdp_recipes.data.spec import renamed
from fsdp_recipes.data.tokenizing import Planned, Sequence

LABEL = "a text field"
COLUMNS = ("text",)
HELP = '{"text": ...} (or the column dataset_text_field names)'
ORDER = 60
ANSWERS = ("answer",)
HAS_PROMPT = False
check_rows = row_checks.not_empty


def default_columns(text_field: str) -> dict:
    """The text is in the column dataset_text_field names."""
    return {"text": text_field}


def convert(ds, spec, at, text_field: str = "text"):
    return renamed(ds, spec, COLUMNS, {"text": text_field})


def plan_row(row: dict, batch, t):
    return Planned(None, {"answer": batch.text(row[t.text_field], True)}, trains_prompt=True)


def sequences(row: dict, tokens, t) -> list:
    ids = tokens(tokens.with_eos(row[t.text_field]))["input_ids"]
    return [Sequence("", ids, [True] * len(ids))]


def trained(t) -> str:
    return "every token"
