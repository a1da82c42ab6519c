"""The dataset layouts the pack reads, declared (`dataset_format:`) or detected from the first row, and their
conversion to the layouts TRL's trainers take: `messages`, `prompt` + `completion`, a text field, preference pairs
and labelled answers.

    messages             {"messages": [{"role": "user", "content": ...}, {"role": "assistant", "content": ...}]}
    sharegpt             {"conversations": [{"from": "human", "value": ...}, {"from": "gpt", "value": ...}]}
                         -> messages (trl.data_utils.maybe_convert_to_chatml, then the roles: human -> user,
                         gpt -> assistant, system -> system)
    alpaca               {"instruction": ..., "input": ..., "output": ...} -> chat prompt + completion (the user turn
                         is the instruction, then a blank line and the input when there is one)
    prompt_completion    {"prompt": ..., "completion": ...} (text or chat turns)
    prompt_response      {"prompt": ..., "response": ...} -> prompt + completion
    text                 {"text": ...} (or the column dataset_text_field names)
    preference           {"prompt": ..., "chosen": ..., "rejected": ...} (the prompt may be inside the answers)
    unpaired_preference  {"prompt": ..., "completion": ..., "label": true}

A declaration is the format's name, then optionally `slot=column` (the file's column for one of the format's
columns) and, for the chat formats, `name=role` (the file's role name for a chat role):
`dataset_format: alpaca instruction=question output=answer`, `dataset_format: sharegpt bot=assistant`.
Each file is converted with datasets' `map`, once, where it is loaded (train/loading.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fsdp_recipes.errors import UserError

ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system", "user": "user", "assistant": "assistant",
                  "tool": "tool", "function": "tool", "observation": "tool"}
DOCS = "docs/training.md#dataset-formats"


@dataclass(frozen=True)
class Format:
    name: str
    label: str
    needs: tuple[str, ...]  # the columns that identify it, by their default names
    optional: tuple[str, ...] = ()
    chat: bool = False  # holds turns whose roles a declaration may map
    becomes: str = ""  # what the pack converts it to; "" when TRL takes it as it is


# In detection order: the more specific layout first (labelled answers hold prompt + completion too).
FORMATS = {f.name: f for f in (
    Format("unpaired_preference", "labelled answers", ("prompt", "completion", "label")),
    Format("preference", "preference pairs", ("chosen", "rejected"), ("prompt",)),
    Format("messages", "OpenAI chat", ("messages",), chat=True),
    Format("sharegpt", "ShareGPT", ("conversations",), chat=True, becomes="messages"),
    Format("alpaca", "Alpaca", ("instruction", "output"), ("input", "system"), becomes="chat prompt + completion"),
    Format("prompt_completion", "prompt/completion", ("prompt", "completion")),
    Format("prompt_response", "prompt/response", ("prompt", "response"), becomes="prompt + completion"),
    Format("text", "a text field", ("text",)),
)}
NAMES = ("messages", "sharegpt", "alpaca", "prompt_completion", "prompt_response", "text", "preference",
         "unpaired_preference")  # as the docs list them


@dataclass(frozen=True)
class Spec:
    """A parsed `dataset_format:`: the format, the file's column for each of its columns, the file's role names."""

    name: str
    columns: dict = field(default_factory=dict)  # slot -> the file's column
    roles: dict = field(default_factory=dict)  # the file's role name -> chat role


def parse_spec(text: str | None) -> Spec | None:
    """`dataset_format:` as written -> Spec, or one line naming what is wrong."""
    if text is None or not str(text).strip():
        return None
    words = str(text).replace(",", " ").split()
    name, pairs = words[0], words[1:]
    if name not in FORMATS:
        raise UserError(f"dataset_format {name!r} is not one of {', '.join(NAMES)}. Fix: name one of those "
                        f"(then optionally slot=column or name=role; {DOCS}), or remove it to detect the format.")
    fmt, columns, roles = FORMATS[name], {}, {}
    slots = fmt.needs + fmt.optional
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key or not value:
            raise UserError(f"dataset_format {text!r}: {pair!r} is not slot=column or name=role. Fix: write e.g. "
                            f"`{name} {slots[0]}=my_column`.")
        if key in slots:
            columns[key] = value
        elif fmt.chat and value in ROLES:
            roles[key] = value
        else:
            also = f", or a role name mapped to one of {', '.join(ROLES)}" if fmt.chat else ""
            raise UserError(f"dataset_format {text!r}: {key!r} is not a column of the {name} format "
                            f"({', '.join(slots)}){also}. Fix: use one of those on the left of `=`.")
    return Spec(name, columns, roles)


def detect(columns: list[str], first: dict | None, text_field: str = "text") -> Spec | None:
    """The format a dataset's columns (and first row) fit, in FORMATS' order; None when none fits."""
    cols = set(columns)
    for fmt in FORMATS.values():
        needs = {text_field if c == "text" else c for c in fmt.needs}
        if needs <= cols:
            if fmt.name == "messages" and first is not None and not isinstance(first.get("messages"), list):
                continue
            return Spec(fmt.name, {"text": text_field} if fmt.name == "text" and text_field != "text" else {})
    return None


def column(spec: Spec, slot: str) -> str:
    return spec.columns.get(slot, slot)


def roles_of(spec: Spec) -> dict:
    base = dict(SHAREGPT_ROLES) if spec.name == "sharegpt" else {}
    return {**base, **spec.roles}


def describe(spec: Spec, where: str, declared: bool, columns: list[str]) -> str:
    """The one line the launcher prints: what it found, and how it maps."""
    fmt = FORMATS[spec.name]
    cols = [column(spec, c) for c in fmt.needs + fmt.optional if column(spec, c) in columns or c in fmt.needs]
    how = f" -> {fmt.becomes}" if fmt.becomes else " (as TRL takes it)"
    mapped = [f"{column(spec, c)} as {c}" for c in fmt.needs + fmt.optional if column(spec, c) != c]
    roles = {k: v for k, v in roles_of(spec).items() if k in ("human", "gpt") or k in spec.roles}
    if roles:
        mapped.append("roles " + ", ".join(f"{k} -> {v}" for k, v in roles.items()))
    source = "declared by dataset_format" if declared else f"detected; declare it with `dataset_format: {spec.name}`"
    return (f"data {where}: {fmt.label} ({', '.join(cols)}){how}" + (f"; {'; '.join(mapped)}" if mapped else "")
            + f" ({source})")


def resolve(ds, where: str, declared: str | None, text_field: str = "text") -> Spec | None:
    """The Spec for one loaded dataset: the declaration, checked against its columns, or the detected format."""
    spec = parse_spec(declared)
    cols = list(ds.column_names or [])
    if spec is None:
        first = ds[0] if len(ds) else None
        return detect(cols, first, text_field)
    fmt = FORMATS[spec.name]
    missing = [column(spec, c) for c in fmt.needs if column(spec, c) not in cols]
    if spec.name == "text" and "text" not in spec.columns:
        missing = [] if text_field in cols else [text_field]
    if missing:
        raise UserError(f"dataset {where} is declared `dataset_format: {declared}` but has no column "
                        f"{', '.join(f'`{m}`' for m in missing)} (it has {sorted(cols)}). Fix: map the column "
                        f"(`{spec.name} {fmt.needs[0]}=<column>`), or remove dataset_format to detect the format.")
    return spec


def convert(ds, spec: Spec | None, where: str, at, text_field: str = "text"):
    """The dataset in the layout TRL takes (datasets' map, one pass); `at(i)` names row i (file:line). Rows that do
    not fit the format are one line with `at(i)`."""
    if spec is None:
        return ds
    name = spec.name
    if name in ("messages", "sharegpt"):
        src = column(spec, "messages" if name == "messages" else "conversations")
        roles = roles_of(spec)
        if name == "messages" and not roles and src == "messages":
            return ds

        def chat(row, i):
            turns = row[src]
            if not isinstance(turns, list):
                raise UserError(f"{at(i)}: `{src}` is {type(turns).__name__}, not a list of turns. Fix: give every "
                                f"row its turns, or remove the row.")
            if name == "sharegpt":
                from trl.data_utils import maybe_convert_to_chatml

                turns = maybe_convert_to_chatml({"conversations": [dict(t) if isinstance(t, dict) else t
                                                                   for t in turns]})["messages"]
            out = []
            for t in turns:
                role = t.get("role") if isinstance(t, dict) else None
                if role not in roles and role not in ROLES:
                    known = ", ".join(f"{k} -> {v}" for k, v in roles.items() if k != v) or "none"
                    raise UserError(f"{at(i)}: role {role!r} is not a chat role ({', '.join(ROLES)}) nor one the "
                                    f"pack maps ({known}). Fix: map it in the recipe, e.g. `dataset_format: {name} "
                                    f"{role or 'bot'}=assistant`.")
                out.append({**t, "role": roles.get(role, role)})
            return {"messages": out}

        return ds.map(chat, with_indices=True, remove_columns=[src])
    if name == "alpaca":
        ins, inp, outp, system = (column(spec, c) for c in ("instruction", "input", "output", "system"))

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
    # the column layouts TRL takes: renamed where the file names them otherwise
    fmt = FORMATS[name]
    target = {"prompt_response": {"response": "completion"}, "text": {"text": text_field}}.get(name, {})
    renames = {}
    for slot in fmt.needs + fmt.optional:
        src, dst = column(spec, slot), target.get(slot, slot)
        if src != dst and src in ds.column_names:
            renames[src] = dst
    return ds.rename_columns(renames) if renames else ds
