"""Preference pairs: `{"prompt": ..., "chosen": ..., "rejected": ...}`, text or chat turns, or implicit-prompt pairs
whose prompt is the turns `chosen` and `rejected` share; as TRL takes them. Checked as the file holds them: a
chosen and a rejected answer that differ, a non-empty prompt where there is a prompt column, text contents and
known roles (DPO's and KTO's checks, train/kinds/); a warning where text prompts and answers meet with no space or
newline (TRL joins them as written)."""

from __future__ import annotations

from fsdp_recipes.data import row_checks, rows
from fsdp_recipes.data.spec import ROLES, renamed
from fsdp_recipes.data.tokenizing import Planned, Sequence
from fsdp_recipes.errors import UserError

LABEL = "preference pairs"
COLUMNS = ("chosen", "rejected")
OPTIONAL = ("prompt",)
HELP = '{"prompt": ..., "chosen": ..., "rejected": ...} (the prompt may be inside the answers)'
ORDER = 70
ANSWERS = ("chosen", "rejected")


def convert(ds, spec, at, text_field: str = "text"):
    return renamed(ds, spec, COLUMNS + OPTIONAL)


def text_of(value, what: str, at: str) -> str:
    """The text of a completion or prompt, plain or conversational; one line when it is neither."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value:
        for turn in value:
            role = turn.get("role") if isinstance(turn, dict) else None
            if role not in ROLES:
                raise UserError(f"{at}: a `{what}` turn has role {role!r}, not one of {sorted(ROLES)}. Fix: rename "
                                "the role (chat templates know only these).")
            if not isinstance(turn.get("content"), str):
                raise UserError(f"{at}: the {role} turn of `{what}` has content of type "
                                f"{type(turn.get('content')).__name__}, not text. Fix: make every content a string.")
        return "\x00".join(f"{t['role']}:{t['content']}" for t in value)
    if row_checks.is_number(value):
        raise UserError(f"{at}: `{what}` is the number {value!r}, not text. Fix: {row_checks.quoted(what, value)}.")
    if value is None or value == []:
        raise UserError(f"{at}: `{what}` is missing or empty. Fix: give every pair a {what} answer, or remove "
                        "the row.")
    raise UserError(f"{at}: `{what}` is {type(value).__name__}, not text or a list of chat turns. Fix: make it a "
                    "string or [{\"role\": ..., \"content\": ...}].")


def check_rows(ds, where: str, split: str) -> list[str]:
    """Every pair, as the file holds it (rows.written_rows: Arrow gives a column one type)."""
    if len(ds) == 0:
        raise UserError(f"the `{split}` split of the dataset {where} has no preference pairs. Fix: point "
                        "dataset_name at data with rows (or the split at another file).")
    has_prompt = "prompt" in ds.column_names
    for i, row in enumerate(rows.written_rows(ds, where, split)):
        at = rows.row_at(where, split, i)
        if has_prompt:
            prompt = row.get("prompt")
            if prompt is None or (isinstance(prompt, (str, list)) and not (prompt.strip() if isinstance(prompt, str)
                                                                           else prompt)):
                raise UserError(f"{at}: the prompt is empty. Fix: give the pair its prompt, or remove the row.")
            text_of(prompt, "prompt", at)
        chosen, rejected = text_of(row.get("chosen"), "chosen", at), text_of(row.get("rejected"), "rejected", at)
        kinds = {k: isinstance(row.get(k), list) for k in ("prompt", "chosen", "rejected") if k in row}
        if len(set(kinds.values())) > 1:
            chat = ", ".join(k for k, v in kinds.items() if v)
            raise UserError(f"{at}: {chat} are chat turns but {', '.join(k for k, v in kinds.items() if not v)} "
                            "plain text; TRL reads a pair as one or the other. Fix: make them all lists of chat "
                            "turns (or all text), or drop `prompt` and keep it inside `chosen` and `rejected`.")
        if chosen == rejected:
            raise UserError(f"{at}: `chosen` and `rejected` are the same answer, so the pair prefers nothing. Fix: "
                            "remove the row, or give it a different rejected answer.")
    return row_checks.joined_without_separator(ds, where, split, ANSWERS)  # text pairs: TRL joins prompt + answer


def plan_row(row: dict, batch, t) -> Planned:
    """The prompt, and prompt + chosen, prompt + rejected; the answers are trained."""
    from trl.data_utils import is_conversational, maybe_extract_prompt

    chat = is_conversational(row)
    row = maybe_extract_prompt(row) if "prompt" not in row else row
    return Planned(batch.chat(row["prompt"], row, True) if chat else batch.text(row["prompt"]),
                   {n: batch.chat(row["prompt"] + row[n], row) if chat else batch.text(row["prompt"] + row[n], True)
                    for n in ANSWERS})


def sequences(row: dict, tokens, t) -> list[Sequence]:
    from trl.data_utils import common_prefix_length, is_conversational, maybe_extract_prompt

    chat = is_conversational(row)
    row = maybe_extract_prompt(row) if "prompt" not in row else row
    prompt = tokens(row["prompt"], True)["input_ids"]
    out = []
    for name in ANSWERS:
        ids = tokens(row["prompt"] + row[name] if chat else row["prompt"] + tokens.with_eos(row[name]))["input_ids"]
        start = common_prefix_length(prompt, ids)
        out.append(Sequence(name, ids, [i >= start for i in range(len(ids))]))
    return out


def trained(t) -> str:
    return "the chosen and the rejected answers (the prompt is not scored)"
