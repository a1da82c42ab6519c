"""Emptying a list field from the command line: `--lora_modules_to_save none`.

HfArgumentParser gives a list field (`list[str] | None`: lora_modules_to_save, lora_target_modules, label_names)
`nargs="+"`, so `--field` alone is argparse's "expected at least one argument" and `--field none` is `['none']`:
a recipe that sets `lora_modules_to_save: [lm_head]` could not be overridden to no modules. The pack follows
transformers' own word for "no values", `--report_to none`: `--field none` (any case) sets the field to its empty
value, None where it defaults to None (as if the recipe never set it) and [] where it defaults to []. The rule is
applied once, where the recipe is parsed (config/run_config.py), so the launcher's checks and the settings handed to
the ranks (config/handoff.py, JSON null) hold the same value. As argparse does, the last flag of a field wins:
`--lora_modules_to_save lm_head --lora_modules_to_save none` is None.

`none` is only for a field whose None its library reads as "no values" (lora_modules_to_save, lora_target_parameters,
debug; loss_weights and reward_weights: no weighting, each weighs 1). A field whose None means "the library's
default values" refuses it (NOT_EMPTIABLE): the run would train or evaluate on values nobody wrote.
"""

from __future__ import annotations

from fsdp_recipes.errors import UserError

EMPTY = "none"
# {field: (what None means to its library, the fix)}: `none` would not mean "no values" for these
NOT_EMPTIABLE = {
    "lora_target_modules": ("None is PEFT's default target modules for the model's architecture (q_proj v_proj for "
                            "llama-likes, none for some, e.g. qwen3_moe), not no modules",
                            "name the modules, --lora_target_modules q_proj v_proj (or all-linear), or "
                            "--use_peft false for full fine-tuning"),
    "label_names": ("None is transformers' default label names for the model (labels), not no labels",
                    "name them, --label_names labels"),
}


def _empty_value(name: str, default):
    if name in NOT_EMPTIABLE:
        why, fix = NOT_EMPTIABLE[name]
        raise UserError(f"--{name} {EMPTY}: {name} cannot be emptied: {why}. Fix: {fix}.")
    if default is None or default == []:
        return default
    raise UserError(f"--{name} {EMPTY}: {name} has no empty value (it defaults to {default}). Fix: give the "
                    f"values you want: --{name} {' '.join(map(str, default))}")


def take_empty_lists(parser, argv: list[str]) -> tuple[list[str], dict]:
    """(argv without its `--field none` flags, {field: its empty value}) for the parser's list fields; one line for
    a list flag with no value, `none` beside other values, or `--field=` (an empty string is no module name). The
    last flag of a field wins, as in argparse: an earlier one, emptied or with values, is dropped."""
    lists = {a.dest: a.default for a in parser._actions if a.nargs == "+" and a.dest}
    kept, emptied, i = [], {}, 0  # kept: (field or "", [args]) pieces, in order
    while i < len(argv):
        arg, i = argv[i], i + 1
        name, eq, value = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
        if name not in lists:
            kept.append(("", [arg]))
            continue
        emptied.pop(name, None)  # this flag replaces the field's earlier one
        kept = [piece for piece in kept if piece[0] != name]
        values = [value] if eq else []
        while not eq and i < len(argv) and not argv[i].startswith("--"):
            values.append(argv[i])
            i += 1
        fix = f"Fix: --{name} <value> [<value> ...], or --{name} {EMPTY} for no values."
        if not values or values == [""]:
            raise UserError(f"--{name} is given no value. {fix}")
        if any(v.lower() == EMPTY for v in values):
            if len(values) > 1:
                raise UserError(f"--{name} {' '.join(values)}: `{EMPTY}` empties the list, so it cannot stand "
                                f"beside other values. {fix}")
            emptied[name] = _empty_value(name, lists[name])
            continue
        kept.append((name, [arg] if eq else [arg, *values]))  # as written: `--field=v` keeps its one value in it
    return [a for _, args in kept for a in args], emptied
