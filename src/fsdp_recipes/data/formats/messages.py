"""OpenAI chat: `{"messages": [{"role": "user", "content": ...}, {"role": "assistant", "content": ...}]}`, as TRL
takes it (the file's role names mapped where a declaration names them: `messages bot=assistant`); tool calls as
OpenAI means them, in the form transformers' templates take (data/chat.py: each call's JSON-string arguments read,
null content beside calls ""), and a `tools` column of function schemas."""

from __future__ import annotations

from fsdp_recipes.data import chat, row_checks
from fsdp_recipes.data.tokenizing import Planned, Sequence

LABEL = "OpenAI chat"
COLUMNS = ("messages",)
OPTIONAL = ("tools",)  # the row's tools: [{"type": "function", "function": <JSON schema>}], or a JSON string of them
HELP = '{"messages": [{"role": "user", "content": ...}, {"role": "assistant", "content": ...}]}'
ORDER = 10
ROLE_NAMES: dict = {}  # chat roles already; a declaration may map others
ANSWERS = ("answer",)
check_rows = row_checks.turns_or_text


def fits(columns: set, first: dict | None, text_field: str) -> bool:
    """`messages` holds the turns (a list), not e.g. a text column of that name."""
    return first is None or isinstance(first.get("messages"), list)


def convert(ds, spec, at, text_field: str = "text"):
    return chat.to_messages(ds, spec, spec.column("messages"), dict(spec.roles), at, tools=spec.column("tools"))


def plan_row(row: dict, batch, t):
    """The prompt: the turns before the last assistant turn; the answer: the whole conversation (all of it is
    trained unless assistant_only_loss, then from the first assistant turn)."""
    turns = row["messages"]
    answers = [i for i, turn in enumerate(turns) if turn.get("role") == "assistant"]
    last = answers[-1] if answers else len(turns)
    planned = Planned(batch.chat(turns[:last], row, True) if last else None, {"answer": batch.chat(turns, row)},
                      trains_prompt=not t.assistant_only_loss)
    if t.assistant_only_loss and answers and answers[0] < last:  # an earlier answer is trained too
        planned.first = batch.chat(turns[:answers[0]], row, True) if answers[0] else None
        planned.trains_prompt = answers[0] == 0
    return planned


def sequences(row: dict, tokens, t) -> list:
    out = tokens(row["messages"], masks=t.assistant_only_loss)
    ids = out["input_ids"]
    trained = [bool(m) for m in out["assistant_masks"]] if "assistant_masks" in out else [True] * len(ids)
    return [Sequence("", ids, trained)]


def trained(t) -> str:
    return ("the assistant turns (assistant_only_loss)" if t.assistant_only_loss
            else "every token (assistant_only_loss is off)")
