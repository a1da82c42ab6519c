"""Chat turns: the conversion of the chat formats (data/formats/messages.py, sharegpt.py) to `messages` whose roles
are chat roles, with the file's role names mapped; a turn whose role is neither is one line with its file and line.
"""

from __future__ import annotations

from fsdp_recipes.data.spec import ROLES, Spec
from fsdp_recipes.errors import UserError


def to_messages(ds, spec: Spec, src: str, roles: dict, at, to_chatml: bool = False):
    """`src`'s turns as `messages` (datasets' map, one pass), their roles mapped by `roles`; `to_chatml`: ShareGPT's
    from/value turns first become role/content ones (trl.data_utils.maybe_convert_to_chatml)."""
    if not roles and src == "messages" and not to_chatml:
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
        for t in turns:
            role = t.get("role") if isinstance(t, dict) else None
            if role not in roles and role not in ROLES:
                known = ", ".join(f"{k} -> {v}" for k, v in roles.items() if k != v) or "none"
                raise UserError(f"{at(i)}: role {role!r} is not a chat role ({', '.join(ROLES)}) nor one the "
                                f"pack maps ({known}). Fix: map it in the recipe, e.g. `dataset_format: {spec.name} "
                                f"{role or 'bot'}=assistant`.")
            out.append({**t, "role": roles.get(role, role)})
        return {"messages": out}

    return ds.map(chat, with_indices=True, remove_columns=[src])
