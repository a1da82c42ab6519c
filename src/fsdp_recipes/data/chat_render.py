"""Every chat row rendered by the recipe's chat template before any rank starts: a template that refuses a row is
one line naming its file and line, what is wrong with its turns, and the fix.

Gap it fills: templates check the order of the turns themselves (Mistral's and Llama 2's raise "Conversation roles
must alternate user/assistant/user/assistant/..." for two user turns in a row, Gemma's refuses a system turn), and
OpenAI's or LLaMA-Factory's files hold orders TRL passes on as they are. The error came from jinja2 inside TRL's
tokenizing in every rank, or in the launcher as "TemplateError while ...", naming neither the file nor the row.

A template's verdict depends on the turns' roles, not their words: one row of each distinct sequence of roles (with
whether a turn carries tool calls, or no content) is rendered as the trainer renders it (its layout's plan_row,
data/formats/), so a split of any size costs one rendering per distinct shape.

A template may also drop a turn without a word: Mistral's and Llama 2's older templates (the tiny assets' too) render
user and assistant turns only, so a system prompt never reaches the model. The same rendering finds it: a row whose
system text is in none of its renderings is counted (`Dropped`), one warning for the split (data/length_report.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fsdp_recipes.data.tokenizing import TemplateRefused
from fsdp_recipes.errors import UserError

CHAT_COLUMNS = ("messages", "prompt", "completion", "chosen", "rejected")


def shape(row: dict) -> tuple:
    """What a template's verdict on a row depends on: each chat column's roles, which turns carry tool calls or no
    content, and whether the row has tools."""
    return (bool(row.get("tools")),) + tuple(
        (c, tuple((t.get("role"), bool(t.get("tool_calls")), t.get("content") is None) if isinstance(t, dict) else ()
                  for t in row[c]))
        for c in CHAT_COLUMNS if isinstance(row.get(c), list))


def turns_of(row: dict) -> list[dict]:
    """The row's conversation as the template sees it whole: messages, or prompt + an answer."""
    if isinstance(row.get("messages"), list):
        return row["messages"]
    answer = next((row[c] for c in ("completion", "chosen", "rejected") if isinstance(row.get(c), list)), [])
    return [*(row.get("prompt") if isinstance(row.get("prompt"), list) else []), *answer]


def what_to_fix(turns: list[dict]) -> str:
    """The change to the row's turns that strict templates ask for, read from its roles."""
    roles = [t.get("role") for t in turns if isinstance(t, dict)]
    spoken = [(i, r) for i, r in enumerate(roles) if r != "system"]
    for (i, a), (j, b) in zip(spoken, spoken[1:]):
        if a == b and a in ("user", "assistant"):
            return f"merge its consecutive {a} turns ({i + 1} and {j + 1}) into one turn"
    late = next((i for i, r in enumerate(roles) if r == "system" and i > 0), None)
    if late is not None:
        return f"move its system turn ({late + 1}) to the start (or fold it into the next user turn)"
    if roles and roles[0] == "system":
        return "fold its system turn into the first user turn (the template takes none)"
    if roles and roles[-1] != "assistant":
        return "end it on the assistant's turn (drop the last turn)"
    if roles and roles[0] == "assistant":
        return "start it with a user turn"
    return "give its turns the order and contents the template expects"


def refused(err: TemplateRefused, at: str, row: dict, same: int) -> UserError:
    turns = turns_of(row)
    roles = ", ".join(str(t.get("role")) + ("+tool_calls" if t.get("tool_calls") else "") for t in turns
                      if isinstance(t, dict))
    more = f"; {same - 1} more row{'s have' if same > 2 else ' has'} these turns" if same > 1 else ""
    return UserError(f"{at}: the chat template refuses this row ({roles}): {err}{more}. Fix: {what_to_fix(turns)}, or "
                     "remove the row; or set chat_template_path to a template that renders this order.")


@dataclass(frozen=True)
class Dropped:
    """Rows whose system turn the chat template left out of every rendering: how many, the first, its text."""

    rows: int
    first: str  # the first such row's place (file:line)
    text: str


def system_texts(row: dict) -> list[str]:
    """The text of the row's system turns (any chat column), those with words."""
    return [t["content"].strip() for c in CHAT_COLUMNS if isinstance(row.get(c), list) for t in row[c]
            if isinstance(t, dict) and t.get("role") == "system" and isinstance(t.get("content"), str)
            and t["content"].strip()]


def drops_system(row: dict, rendered) -> str | None:
    """The row's first system text that none of its renderings holds (the template ignores the system role), else
    None; None where the plan gave no text to look in."""
    texts = [x for x in (rendered if isinstance(rendered, (list, tuple)) else []) if isinstance(x, str)]
    if not texts:
        return None
    return next((s for s in system_texts(row) if not any(s in x for x in texts)), None)


def check_renders(ds, plan: Callable[[dict], object], at: Callable[[int], str]) -> Dropped | None:
    """Render one row of each distinct shape (plan: the layout's rendering of a row, returning the texts rendered);
    a refusal is one line naming the first row of that shape and how many more share it. Returns the rows whose
    system turn the template dropped (Dropped), or None."""
    cols = [c for c in (*CHAT_COLUMNS, "tools") if c in ds.column_names]
    if not cols or not len(ds):
        return None
    firsts: dict[tuple, int] = {}
    counts: dict[tuple, int] = {}
    size = 1000  # rows read from Arrow at a time: a row at a time is 7x slower (9 s for 100,000 chat rows)
    for b, batch in enumerate(ds.select_columns(cols).iter(batch_size=size)):
        for k, values in enumerate(zip(*(batch[c] for c in cols))):
            key = shape(dict(zip(cols, values)))
            firsts.setdefault(key, b * size + k)
            counts[key] = counts.get(key, 0) + 1
    dropped: list[tuple[int, int, str]] = []  # (first row, rows of its shape, the system text missing)
    for key, i in firsts.items():
        row = ds[i]
        try:
            rendered = plan(row)
        except TemplateRefused as err:
            raise refused(err, at(i), row, counts[key]) from None
        if (missing := drops_system(row, rendered)) is not None:
            dropped.append((i, counts[key], missing))
    if not dropped:
        return None
    first, _, text = min(dropped)
    return Dropped(sum(n for _, n, _ in dropped), at(first), text)
