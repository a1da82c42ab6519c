"""ShareGPT: `{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", "value": ...}]}`, converted to
`messages` (trl.data_utils.maybe_convert_to_chatml, then the roles: human -> user, gpt -> assistant, system ->
system; function and observation -> tool). LLaMA-Factory's variant as it means it (data/chat.py): a `function_call`
turn is the assistant's tool calls, a `system` column the system turn (where the conversation opens without one),
a `tools` column the row's tools."""

from __future__ import annotations

from fsdp_recipes.data import chat, row_checks

LABEL = "ShareGPT"
COLUMNS = ("conversations",)
OPTIONAL = ("system", "tools")  # LLaMA-Factory's columns of a conversation's system prompt and its tools
HELP = '{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", "value": ...}]}'
ORDER = 20
ROLE_NAMES = {"human": "user", "gpt": "assistant"}  # named in the launcher's line
ALSO_MAPPED = {"function": "tool", "observation": "tool"}  # mapped too, not named
LAYOUT = "messages"
BECOMES = "messages"
check_rows = row_checks.turns_or_text  # the rows as converted: chat turns


def convert(ds, spec, at, text_field: str = "text"):
    roles = {**ROLE_NAMES, **ALSO_MAPPED, **spec.roles}
    return chat.to_messages(ds, spec, spec.column("conversations"), roles, at, to_chatml=True,
                            system=spec.column("system"), tools=spec.column("tools"))
