"""Labelled answers: `{"prompt": ..., "completion": ..., "label": true}` (KTO's unpaired preference), as TRL takes
them; measured as prompt + completion. Checked as the file holds them: a prompt, an answer (text or chat turns, as a
pair's) and a true/false label in every row."""

from __future__ import annotations

import json

from fsdp_recipes.data import row_checks, rows
from fsdp_recipes.data.formats import preference, prompt_completion
from fsdp_recipes.data.spec import renamed
from fsdp_recipes.errors import UserError

LABEL = "labelled answers"
COLUMNS = ("prompt", "completion", "label")
HELP = '{"prompt": ..., "completion": ..., "label": true}'
ORDER = 80
ANSWERS = ("answer",)
plan_row, sequences, trained = prompt_completion.plan_row, prompt_completion.sequences, prompt_completion.trained


def convert(ds, spec, at, text_field: str = "text"):
    return renamed(ds, spec, COLUMNS)


def check_rows(ds, where: str, split: str) -> list[str]:
    """Every row as written (rows.written_rows). One label only is a warning: KTO then learns only to raise (or
    only to lower) answers' likelihood against the reference."""
    written = list(rows.written_rows(ds, where, split))
    if not written:
        raise UserError(f"the `{split}` split of the dataset {where} has no rows. Fix: point dataset_name at data "
                        "with rows (or the split at another file).")
    counts = {True: 0, False: 0}
    for i, row in enumerate(written):
        at = rows.row_at(where, split, i)
        label = row.get("label")
        if isinstance(label, str) and label.strip().lower() in ("true", "false"):  # quoted: JSON's text, not a bool
            value = label.strip().lower()
            raise UserError(f"{at}: `label` is the string {json.dumps(label)} (in quotes), which is text, not the "
                            f"JSON boolean {value}. Fix: write it without quotes in the file, \"label\": {value}.")
        if not isinstance(label, bool):
            raise UserError(f"{at}: `label` is {label!r}, not true or false. Fix: label each answer true (desirable) "
                            "or false (undesirable).")
        counts[label] += 1
        preference.text_of(row.get("prompt"), "prompt", at)
        preference.text_of(row.get("completion"), "completion", at)
    one = [name for name, flag in (("desirable", True), ("undesirable", False)) if counts[flag] == 0]
    return ([f"the `{split}` split of {where} has no {one[0]} answers ({counts[True]} desirable, {counts[False]} "
             "undesirable): KTO will only move the other kind"] if one else []) + \
        row_checks.joined_without_separator(ds, where, split, ("completion",))  # TRL joins prompt + completion


def describe_row(row: dict) -> str:
    """`make data`'s words on an example: its label."""
    return f", label {str(row['label']).lower()}" if "label" in row else ""
