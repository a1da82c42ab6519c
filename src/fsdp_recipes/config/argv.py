"""Single fields read from command-line overrides before the recipe is parsed (the node count, the grace period, the
trainer kind): `--key v` / `--key=v`, as the full parse will read them."""

from __future__ import annotations

import argparse
from typing import Any

from fsdp_recipes.errors import UserError


def override(argv: list[str], key: str, default):
    """The value of `--key v` / `--key=v` among command-line overrides, else `default`: for the few settings the
    launcher needs before the recipe is parsed (torchrun's grace period, the node count). A yes/no setting (a bool
    `default`) given bare, `--key`, is True, as transformers' HfArgumentParser reads it (nargs "?", const True)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    if isinstance(default, bool):
        parser.add_argument(f"--{key}", default=default, nargs="?", const=True)
    else:
        parser.add_argument(f"--{key}", default=default)
    try:
        known, _ = parser.parse_known_args(argv)
    except argparse.ArgumentError:  # `--key` with no value: the full parse names the mistake
        return default
    return getattr(known, key)


def yes_or_no(value: Any) -> bool | None:
    """A yes/no word as transformers' HfArgumentParser reads it (`string_to_bool`), else None."""
    word = str(value).lower()
    return True if word in ("yes", "true", "t", "y", "1") else False if word in ("no", "false", "f", "n", "0") else None


def as_bool(key: str, value: Any) -> bool:
    """A yes/no setting read as the full parse reads it, or its one line."""
    if isinstance(value, bool):
        return value
    if (read := yes_or_no(value)) is None:
        raise UserError(f"{key}: '{value}' is not yes or no. Fix: --{key} true (or false).")
    return read


def as_int(key: str, value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise UserError(f"{key}: '{value}' is not a whole number. Fix: --{key} 2, say.") from None


def given(argv: list[str], *keys: str) -> bool:
    """Whether any of `--key v` / `--key=v` is among command-line overrides (override() reads its value)."""
    return any(a == f"--{k}" or a.startswith(f"--{k}=") for a in argv for k in keys)


def set_by(argv: list[str], user: list[str], *keys: str) -> dict[str, tuple[Any, bool]]:
    """{key: (its value among `argv`, as the full parse will read it (None: not there), whether `user`, the user's own
    overrides at the end of `argv`, set it)}: what `make smoke`'s run line says it will run, `(yours)` marked."""
    return {key: (override(argv, key, None), given(user, key)) for key in keys}
