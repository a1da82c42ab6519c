"""Prompt and response: `{"prompt": ..., "response": ...}`, converted to prompt + completion (the column renamed)."""

from __future__ import annotations

from fsdp_recipes.data import row_checks
from fsdp_recipes.data.spec import renamed

LABEL = "prompt/response"
COLUMNS = ("prompt", "response")
HELP = '{"prompt": ..., "response": ...}'
ORDER = 50
LAYOUT = "prompt_completion"
BECOMES = "prompt + completion"
check_rows = row_checks.turns_or_text  # the rows as converted: prompt + completion


def convert(ds, spec, at, text_field: str = "text"):
    return renamed(ds, spec, COLUMNS, {"response": "completion"})
