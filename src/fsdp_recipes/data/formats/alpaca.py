"""Alpaca: `{"instruction": ..., "input": ..., "output": ...}`, converted to a chat prompt + completion: the user
turn is the instruction, then a blank line and the input when there is one; a `system` column becomes the system
turn, and LLaMA-Factory's `history` column (`[[instruction, answer], ...]`, the turns before this one) the user and
assistant turns between them."""

from __future__ import annotations

from fsdp_recipes.data import row_checks
from fsdp_recipes.errors import UserError

LABEL = "Alpaca"
COLUMNS = ("instruction", "output")
OPTIONAL = ("input", "system", "history")
HELP = '{"instruction": ..., "input": ..., "output": ...}'
ORDER = 30
LAYOUT = "prompt_completion"
BECOMES = "chat prompt + completion"
check_rows = row_checks.turns_or_text  # the rows as converted: chat prompt + completion


def convert(ds, spec, at, text_field: str = "text"):
    ins, inp, outp, system, history = (spec.column(c) for c in ("instruction", "input", "output", "system",
                                                                 "history"))

    def alpaca(row, i):
        for slot, col in (("instruction", ins), ("output", outp)):
            value = row.get(col)
            if row_checks.is_number(value):
                raise UserError(f"{at(i)}: Alpaca's `{col}` is the number {value!r}, not text. Fix: "
                                f"{row_checks.quoted(col, value)}.")
            if not isinstance(value, str) or not value.strip():
                shown = "empty" if isinstance(value, str) else repr(value)
                raise UserError(f"{at(i)}: Alpaca's `{col}` is {shown}, not text. Fix: give the row its {slot}, "
                                "or remove it.")
        extra = row.get(inp)
        user = row[ins] + (f"\n\n{extra}" if isinstance(extra, str) and extra.strip() else "")
        head = [{"role": "system", "content": row[system]}] if isinstance(row.get(system), str) and row[system] \
            else []
        return {"prompt": head + earlier(row.get(history), history, lambda: at(i)) + [{"role": "user", "content": user}],
                "completion": [{"role": "assistant", "content": row[outp]}]}

    drop = [c for c in (ins, inp, outp, system, history) if c in ds.column_names]
    return ds.map(alpaca, with_indices=True, remove_columns=drop)


def earlier(pairs, column: str, at) -> list[dict]:
    """LLaMA-Factory's history: [[instruction, answer], ...] as the user and assistant turns before the row's own.
    `at()` names the row, called for an error only: it reads the file up to the row, and for every row of a
    20,000-row file that took 53 s."""
    if pairs is None or pairs == []:
        return []
    turns = []
    for n, pair in enumerate(pairs if isinstance(pairs, list) else [pairs], 1):
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(x, str) for x in pair)):
            raise UserError(f"{at()}: Alpaca's `{column}` holds {pair!r} at turn pair {n}, not [instruction, answer]. "
                            "Fix: write the earlier turns as [[\"question\", \"answer\"], ...], or leave it empty.")
        turns += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
    return turns
