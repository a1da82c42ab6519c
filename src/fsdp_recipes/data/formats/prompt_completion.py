"""Prompt and completion: `{"prompt": ..., "completion": ...}`, text or chat turns, as TRL takes it (the file's
column names mapped where a declaration names them). The layout Alpaca and prompt/response rows become."""

from __future__ import annotations

from fsdp_recipes.data import row_checks
from fsdp_recipes.data.spec import renamed
from fsdp_recipes.data.tokenizing import Planned, Sequence

LABEL = "prompt/completion"
COLUMNS = ("prompt", "completion")
HELP = '{"prompt": ..., "completion": ...} (text or chat turns)'
ORDER = 40
ANSWERS = ("answer",)
check_rows = row_checks.turns_or_text


def convert(ds, spec, at, text_field: str = "text"):
    return renamed(ds, spec, COLUMNS)


def plan_row(row: dict, batch, t):
    """The prompt (a chat prompt with its generation prompt), and prompt + completion; TRL's default
    (completion_only_loss None) trains the completion only."""
    from trl.data_utils import is_conversational

    chat = is_conversational(row)
    planned = Planned(batch.chat(row["prompt"], row, True) if chat else batch.text(row["prompt"]))
    planned.full["answer"] = (batch.chat(row["prompt"] + row["completion"], row) if chat
                              else batch.text(row["prompt"] + row["completion"], True))
    planned.trains_prompt = t.completion_only_loss is False
    return planned


def sequences(row: dict, tokens, t) -> list:
    from trl.data_utils import common_prefix_length, is_conversational

    chat = is_conversational(row)
    prompt = tokens(row["prompt"], True)["input_ids"]
    out = (tokens(row["prompt"] + row["completion"], masks=t.assistant_only_loss) if chat
           else tokens(row["prompt"] + tokens.with_eos(row["completion"])))
    ids, start = out["input_ids"], common_prefix_length(prompt, out["input_ids"])
    completion = [i >= start for i in range(len(ids))]
    trained = completion if t.completion_only_loss is not False else [True] * len(ids)
    if "assistant_masks" in out:
        trained = [a and bool(m) for a, m in zip(trained, out["assistant_masks"])]
    return [Sequence("", ids, trained)]


def trained(t) -> str:
    if t.completion_only_loss is False:
        return "every token (completion_only_loss is off)"
    return "the completion" + (", the assistant's tokens of it (assistant_only_loss)" if t.assistant_only_loss
                               else "")
