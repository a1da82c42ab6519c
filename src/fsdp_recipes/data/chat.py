"""Chat turns: the conversion of the chat formats (data/formats/messages.py, sharegpt.py) to `messages` whose roles
are chat roles, with the file's role names mapped; a turn whose role is neither is one line with its file and line.

Tool calls are converted as the tool that wrote them means them, to what transformers' chat templates and TRL take
(an assistant turn with `tool_calls: [{"type": "function", "function": {"name": ..., "arguments": {...}}}]`, its
result a `tool` turn, the row's `tools` a list of `{"type": "function", "function": <JSON schema>}`):
- OpenAI writes each call's `arguments` as a JSON string, and `content: null` beside the calls: the arguments are
  read into the object they encode (transformers' templates render an object; a string is rendered quoted, or
  refused) and the null content becomes "" (a template that adds text to it fails on null); the legacy
  `function_call` of an assistant turn is its one tool call;
- LLaMA-Factory's ShareGPT writes a call as a `function_call` turn whose value is the JSON `{"name": ...,
  "arguments": ...}` (or a list of them), its result as an `observation` turn, the tools as a JSON string of bare
  schemas in a `tools` column, and a conversation's system prompt in a `system` column, used where the conversation
  does not open with a system turn (LLaMA-Factory's SharegptDatasetConverter).
"""

from __future__ import annotations

import json

from fsdp_recipes.data.spec import ROLES, Spec
from fsdp_recipes.errors import UserError

CALL = {"function_call": "assistant"}  # LLaMA-Factory's role of an assistant turn that is tool calls


def to_messages(ds, spec: Spec, src: str, roles: dict, at, to_chatml: bool = False, system: str | None = None,
                tools: str | None = None):
    """`src`'s turns as `messages` (datasets' map, one pass), their roles mapped by `roles` and their tool calls as
    above; `to_chatml`: ShareGPT's from/value turns first become role/content ones (trl.data_utils.
    maybe_convert_to_chatml), and its `function_call` turns tool calls; `system`, `tools`: the file's columns of a
    conversation's system prompt and its tools (LLaMA-Factory's), where it has them."""
    system = system if system in (ds.column_names or []) else None
    tools = tools if tools in (ds.column_names or []) else None
    if not roles and src == "messages" and not to_chatml and not system and not tools and not has_calls(ds, src):
        return ds

    def chat(row, i):
        turns = row[src]
        if not isinstance(turns, list):
            raise UserError(f"{at(i)}: `{src}` is {type(turns).__name__}, not a list of turns. Fix: give every "
                            f"row its turns, or remove the row.")
        if to_chatml:
            from trl.data_utils import maybe_convert_to_chatml

            turns = maybe_convert_to_chatml({"conversations": [dict(t) if isinstance(t, dict) else t
                                                               for t in turns]})["messages"]
        out = []
        for n, t in enumerate(turns, 1):
            role = t.get("role") if isinstance(t, dict) else None
            if to_chatml and role in CALL and role not in roles:
                out.append({"role": CALL[role], "content": "", "tool_calls": sharegpt_calls(t.get("content"),
                                                                                            at(i), n)})
                continue
            if role not in roles and role not in ROLES:
                known = ", ".join(f"{k} -> {v}" for k, v in roles.items() if k != v) or "none"
                raise UserError(f"{at(i)}: role {role!r} is not a chat role ({', '.join(ROLES)}) nor one the "
                                f"pack maps ({known}). Fix: map it in the recipe, e.g. `dataset_format: {spec.name} "
                                f"{role or 'bot'}=assistant`.")
            out.append(openai_turn({**t, "role": roles.get(role, role)}, at(i), n))
        converted = {"messages": out}
        if system:
            prompt = row.get(system)
            if isinstance(prompt, str) and prompt.strip() and not (out and out[0]["role"] == "system"):
                converted["messages"] = [{"role": "system", "content": prompt}, *out]
            elif prompt is not None and not isinstance(prompt, str):
                raise UserError(f"{at(i)}: `{system}` is {type(prompt).__name__}, not the text of a system prompt. "
                                f"Fix: write it as text, or leave it empty.")
        if tools:
            converted["tools"] = tool_schemas(row.get(tools), at(i), tools)
        return converted

    drop = [c for c in (src, system, tools) if c and c != "tools"]
    return ds.map(chat, with_indices=True, remove_columns=drop)


def has_calls(ds, src: str) -> bool:
    """Whether any turn carries tool calls (OpenAI's `tool_calls`, or its legacy `function_call`)."""
    if src not in (ds.column_names or []):
        return False
    return any(isinstance(t, dict) and (t.get("tool_calls") or t.get("function_call"))
               for turns in ds[src] if isinstance(turns, list) for t in turns)


def arguments_of(value, at: str, n: int, name) -> dict:
    """A call's arguments as the object transformers' templates render: an object as it is, a JSON string read."""
    if isinstance(value, dict):
        return value
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            parsed = None
        if isinstance(parsed, dict):
            return parsed
    raise UserError(f"{at}: turn {n}'s call of {name!r} has arguments {value!r}, not a JSON object. Fix: write them "
                    "as one, e.g. \"arguments\": \"{\\\"city\\\": \\\"Paris\\\"}\" (OpenAI) or {\"city\": \"Paris\"}.")


def call(name, arguments, at: str, n: int, extra: dict | None = None) -> dict:
    if not isinstance(name, str) or not name:
        raise UserError(f"{at}: turn {n} calls a tool without a name ({name!r}). Fix: give each call its "
                        "function's name.")
    return {**(extra or {}), "type": "function", "function": {"name": name, "arguments": arguments_of(
        arguments, at, n, name)}}


def openai_turn(turn: dict, at: str, n: int) -> dict:
    """An OpenAI turn as templates take it: each tool call's arguments an object, null content beside calls ""."""
    calls = turn.get("tool_calls")
    legacy = turn.get("function_call")
    if not calls and isinstance(legacy, dict):
        calls = [{"type": "function", "function": legacy}]
    if not calls:
        return {k: v for k, v in turn.items() if k != "function_call" or v is not None}
    if not isinstance(calls, list):
        raise UserError(f"{at}: turn {n}'s tool_calls is {type(calls).__name__}, not a list of calls. Fix: write "
                        "[{\"type\": \"function\", \"function\": {\"name\": ..., \"arguments\": ...}}].")
    converted = []
    for c in calls:
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict):
            raise UserError(f"{at}: turn {n} has a tool call without its function ({c!r}). Fix: write "
                            "{\"type\": \"function\", \"function\": {\"name\": ..., \"arguments\": ...}}.")
        converted.append(call(fn.get("name"), fn.get("arguments"), at, n,
                              {k: v for k, v in c.items() if k not in ("type", "function") and v is not None}))
    out = {k: v for k, v in turn.items() if k != "function_call"}
    return {**out, "content": "" if turn.get("content") is None else turn["content"], "tool_calls": converted}


def sharegpt_calls(value, at: str, n: int) -> list[dict]:
    """LLaMA-Factory's `function_call` turn: the JSON of one call {"name", "arguments"} or a list of them."""
    try:
        parsed = json.loads(value) if isinstance(value, str) else value
    except json.JSONDecodeError:
        parsed = None
    calls = parsed if isinstance(parsed, list) else [parsed]
    if not calls or not all(isinstance(c, dict) for c in calls):
        raise UserError(f"{at}: turn {n} is a function_call whose value {value!r} is not the JSON of a call. Fix: "
                        "write it as LLaMA-Factory does, {\"name\": \"get_weather\", \"arguments\": {\"city\": "
                        "\"Paris\"}} (or a list of those), or map the role: `function_call=assistant` keeps the value "
                        "as the assistant's text.")
    return [call(c.get("name"), c.get("arguments"), at, n) for c in calls]


def tool_schemas(value, at: str, column: str) -> list[dict] | None:
    """A row's tools as transformers' templates take them: a list of {"type": "function", "function": schema}
    (LLaMA-Factory writes a JSON string of bare schemas); None without tools (TRL passes no tools then)."""
    if value is None or value == "" or value == []:
        return None
    try:
        tools = json.loads(value) if isinstance(value, str) else value
    except json.JSONDecodeError as err:
        raise UserError(f"{at}: `{column}` is not JSON ({err.msg}, column {err.colno}). Fix: write the tools as a "
                        "JSON list of function schemas, [{\"name\": ..., \"description\": ..., \"parameters\": "
                        "{...}}].") from None
    tools = tools if isinstance(tools, list) else [tools]
    out = []
    for tool in tools:
        if not isinstance(tool, dict) or not (tool.get("name") or isinstance(tool.get("function"), dict)):
            raise UserError(f"{at}: a tool in `{column}` is {tool!r}, not a function schema. Fix: write each as "
                            "{\"name\": ..., \"description\": ..., \"parameters\": {...}}.")
        out.append(tool if isinstance(tool.get("function"), dict) else {"type": "function", "function": tool})
    return out or None
