"""The checks of rows in the layouts TRL takes, which the formats (data/formats/) name as their `check_rows`: chat
turns with chat roles and text contents, prompt + completion rows whose parts are text, a split with rows. Run by
the launcher only (before any rank starts; the ranks load the same files after it passed): errors with the file and
the line.

Gap it fills: TRL takes an empty split, a role it does not know or a non-string content, and fails (or trains on
nothing) inside every rank; and it joins a text prompt and its answer as written, which no one tells a user whose
prompts end without a space or newline (joined_without_separator).
"""

from __future__ import annotations

import json
import re
import unicodedata

from fsdp_recipes.data.rows import row_at, written_rows
from fsdp_recipes.data.spec import ROLES
from fsdp_recipes.errors import UserError

CONVERSATION_COLUMNS = ("messages", "prompt", "completion")


def not_empty(ds, where: str, split: str) -> list[str]:
    """The check of a layout whose rows need nothing more: the split has rows."""
    if len(ds) == 0:
        raise UserError(f"the `{split}` split of the dataset {where} is empty. Fix: point dataset_name at data with "
                        "rows (or the split at another file).")
    return []


def conversational(ds) -> bool:
    cols = [c for c in CONVERSATION_COLUMNS if c in ds.column_names]
    return bool(cols) and len(ds) > 0 and isinstance(ds[0][cols[0]], list)


def turns_or_text(ds, where: str, split: str) -> list[str]:
    """The check of chat and prompt + completion layouts: errors for an empty split and malformed conversations (or
    text rows without their text); warnings (returned) for rows that are skipped."""
    if len(ds) == 0:
        raise UserError(f"the `{split}` split of the dataset {where} is empty. Fix: point dataset_name at data with "
                        "rows (or the split at another file).")
    chat = conversational(ds)
    if not chat:
        check_text_rows(ds, where, split)
        return joined_without_separator(ds, where, split, ("completion",))
    cols = [c for c in CONVERSATION_COLUMNS if c in ds.column_names]
    without_answer, user_last = [], []
    for i, row in enumerate(ds.select_columns(cols)):
        for c in cols:
            if not isinstance(row[c], list):
                raise UserError(f"{row_at(where, split, i)}: `{c}` is {kind_of(row[c])}, not a list of chat turns as "
                                f"in the other rows. Fix: give the row its {c} turns, or remove the row.")
        turns = [t for c in cols for t in row[c]]
        if not turns:  # `"messages": []`: chat templates refuse an empty conversation (in the ranks, a traceback)
            raise UserError(f"{row_at(where, split, i)}: {' and '.join(f'`{c}`' for c in cols)} "
                            f"{'holds' if len(cols) == 1 else 'hold'} no turns. Fix: give the row its turns, or remove "
                            "the row.")
        for turn in turns:
            role = turn.get("role") if isinstance(turn, dict) else None
            if role not in ROLES:
                raise UserError(f"{row_at(where, split, i)}: role {role!r} is not one of {sorted(ROLES)}. Fix: "
                                "rename the role (chat templates know only these).")
            content = turn.get("content")
            if not isinstance(content, str) and not (content is None and turn.get("tool_calls")):
                fix = quoted("content", content) if is_number(content) else "make every content a string"
                turn_of = f"{'an' if role == 'assistant' else 'a'} {role} turn"
                raise UserError(f"{row_at(where, split, i)}: {turn_of}'s content is {type(content).__name__}"
                                f"{f' {content!r}' if is_number(content) else ''}, not text. Fix: {fix}.")
        if not any(answers(t) for t in turns):
            without_answer.append(i)
        elif "messages" in row and turns[-1].get("role") == "user":
            user_last.append(i)
    if len(without_answer) == len(ds):
        raise UserError(f"no row of the `{split}` split of {where} has an assistant turn that answers (text or tool "
                        "calls), so there is nothing to learn. Fix: add the assistant's answers (role: assistant).")
    warned = []
    if without_answer:
        warned.append(f"{len(without_answer)} of {len(ds)} rows of the `{split}` split have no assistant turn (or "
                      f"only empty ones; first: {row_at(where, split, without_answer[0])}): they teach no answer, "
                      "and an empty one still trains its end-of-turn token (the model learns to say nothing). Fix: "
                      "fill in or drop those rows")
    if user_last:  # OpenAI trains the assistant's turns only; TRL trains every token unless assistant_only_loss
        warned.append(f"{len(user_last)} of {len(ds)} rows of the `{split}` split end on a user turn that nothing "
                      f"answers (first: {row_at(where, split, user_last[0])}): unless assistant_only_loss, the model "
                      "learns to write it. Fix: drop the last turn of those rows, or assistant_only_loss: true")
    return warned


def answers(turn: dict) -> bool:
    """An assistant turn that says something: text, or tool calls. `"content": ""` answers nothing, and TRL's training
    templates still train its end-of-turn token (inside `{% generation %}`)."""
    said = bool((turn.get("content") or "").strip()) or bool(turn.get("tool_calls"))
    return turn.get("role") == "assistant" and said


def kind_of(value) -> str:
    return "missing" if value is None else type(value).__name__


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def quoted(key: str, value) -> str:
    """The fix for a number where text goes (a JSON file's `"completion": 2`): the same key with the number as text.
    CSV cells are read as text already (data/loading.py)."""
    return f"write it as text in the file, \"{key}\": {json.dumps(str(value))}"


def check_text_rows(ds, where: str, split: str) -> None:
    """Plain-text prompt + completion rows: both are text in every row (a row without one is a null here)."""
    cols = [c for c in ("prompt", "completion") if c in ds.column_names]
    if len(cols) < 2:
        return
    # as the file holds them: datasets reads a column of numbers and text as JSON values, where "2" comes back 2
    for i, row in enumerate(written_rows(ds.select_columns(cols), where, split)):
        for c in cols:
            if is_number(row.get(c)):
                raise UserError(f"{row_at(where, split, i)}: `{c}` is the number {row[c]!r}, not text. Fix: "
                                f"{quoted(c, row[c])}.")
            if not isinstance(row.get(c), str):
                raise UserError(f"{row_at(where, split, i)}: `{c}` is {kind_of(row.get(c))}, not text as in the "
                                f"other rows. Fix: give the row its {c}, or remove the row.")


LEFT_ATTACHING = ",.;:!?'\u2019\u2026%"  # punctuation written against the text before it
# a rendered chat prompt's last special token (Mistral's [/INST], ChatML-style <|assistant|>, DeepSeek's
# <｜Assistant｜>): the template puts the answer right after it, so no separator is expected there
SPECIAL_TOKEN_END = re.compile(r"(\[/?[A-Z_]+\]|<\|[^<>|]*\|>|<｜[^<>｜]*｜>|</?s>)$")


def runs_together(prompt: str, answer: str) -> bool:
    """Whether prompt + answer, joined as written, glue two words: neither side whitespace, the answer not starting
    with punctuation that attaches to the text before it (", world", "'s", ")"), the seam not inside a script written
    without spaces (CJK), and the prompt not ending with a chat template's special token."""
    if not answer or prompt[-1].isspace() or answer[0].isspace():
        return False
    if answer[0] in LEFT_ATTACHING or unicodedata.category(answer[0]) in ("Pe", "Pf"):  # closing brackets, quotes
        return False
    if unicodedata.east_asian_width(prompt[-1]) in "WF" or unicodedata.east_asian_width(answer[0]) in "WF":
        return False
    return not SPECIAL_TOKEN_END.search(prompt)


def joined_without_separator(ds, where: str, split: str, answers: tuple[str, ...]) -> list[str]:
    """Plain-text rows whose prompt and answer meet with no whitespace between them, counted: one warning (returned)
    for the split. TRL joins a text prompt and its answer as written (`prompt + completion` in SFTTrainer's,
    DPOTrainer's and KTOTrainer's tokenize_fn, by design: the data says where the answer starts), so "What is 2+2?"
    and "4" train "What is 2+2?4", and at inference the prompt a user types ends the same way. Not changed here (the
    training text is TRL's contract and the recipes'), only said, since nothing else tells the user. Chat rows are
    rendered by the chat template, which separates the turns itself."""
    cols = ["prompt", *answers]
    if any(c not in ds.column_names for c in cols):
        return []
    joined, first = 0, None
    for i, row in enumerate(ds.select_columns(cols)):
        prompt = row["prompt"]
        if not isinstance(prompt, str) or not prompt:
            continue
        answer = next((row[a] for a in answers if isinstance(row[a], str) and runs_together(prompt, row[a])), None)
        if answer is not None:
            joined += 1
            first = first or (i, prompt, answer)
    if not joined:
        return []
    i, prompt, answer = first
    what = "completion" if answers == ("completion",) else "answer"
    seam = ("..." if len(prompt) > 12 else "") + prompt[-12:] + answer[:12] + ("..." if len(answer) > 12 else "")
    return [f"{joined} of {len(ds)} rows of the `{split}` split: the prompt ends and the {what} starts without a space "
            f"or newline, so the model learns {seam!r} (first: {row_at(where, split, i)}): TRL joins them as written. "
            "Fix: end the prompts with a separator (a space or a newline), or use a chat model's conversational format "
            "(prompt and completion as lists of chat turns)"]


def check_chat_template(tokenizer, model: str, where: str) -> None:
    if getattr(tokenizer, "chat_template", None) is None:
        raise UserError(f"the dataset {where} is conversational but the tokenizer of {model} has no chat template. "
                        "Fix: set chat_template_path, use a model whose tokenizer has one, or convert the data to a "
                        "text field.")
