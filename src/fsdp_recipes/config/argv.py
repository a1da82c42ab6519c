"""Single fields read from command-line overrides before the recipe is parsed (the node count, the grace period, the
trainer kind): `--key v` / `--key=v`, as the full parse will read them."""

from __future__ import annotations

import argparse


def override(argv: list[str], key: str, default):
    """The value of `--key v` / `--key=v` among command-line overrides, else `default`: for the few settings the
    launcher needs before the recipe is parsed (torchrun's grace period, the node count)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    parser.add_argument(f"--{key}", default=default)
    try:
        known, _ = parser.parse_known_args(argv)
    except argparse.ArgumentError:  # `--key` with no value: the full parse names the mistake
        return default
    return getattr(known, key)


def given(argv: list[str], *keys: str) -> bool:
    """Whether any of `--key v` / `--key=v` is among command-line overrides (override() reads its value)."""
    return any(a == f"--{k}" or a.startswith(f"--{k}=") for a in argv for k in keys)
