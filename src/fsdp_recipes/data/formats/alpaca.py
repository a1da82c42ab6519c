"""Alpaca: `{"instruction": ..., "input": ..., "output": ...}`, converted to a chat prompt + completion: the user
turn is the instruction, then a blank line and the input when there is one; a `system` column becomes the system
turn."""

from __future__ import annotations

from fsdp_recipes.data import row_checks
from fsdp_recipes.errors import UserError

LABEL = "Alpaca"
COLUMNS = ("instruction", "output")
OPTIONAL = ("input", "system")
HELP = '{"instruction": ..., "input": ..., "output": ...}'
ORDER = 30
LAYOUT = "prompt_completion"
BECOMES = "chat prompt + completion"
check_rows = row_checks.turns_or_text  # the rows as converted: chat prompt + completion


def convert(ds, spec, at, text_field: str = "text"):
    ins, inp, outp, system = (spec.column(c) for c in ("instruction", "input", "output", "system"))

    def alpaca(row, i):
        for slot, col in (("instruction", ins), ("output", outp)):
            value = row.get(col)
            if not isinstance(value, str) or not value.strip():
                shown = "empty" if isinstance(value, str) else repr(value)
                raise UserError(f"{at(i)}: Alpaca's `{col}` is {shown}, not text. Fix: give the row its {slot}, "
                                "or remove it.")
        extra = row.get(inp)
        user = row[ins] + (f"\n\n{extra}" if isinstance(extra, str) and extra.strip() else "")
        head = [{"role": "system", "content": row[system]}] if isinstance(row.get(system), str) and row[system] \
            else []
        return {"prompt": head + [{"role": "user", "content": user}],
                "completion": [{"role": "assistant", "content": row[outp]}]}

    drop = [c for c in (ins, inp, outp, system) if c in ds.column_names]
    return ds.map(alpaca, with_indices=True, remove_columns=drop)
