"""`fsdp-recipes <command> [args]`: one entry point for what the pack does (cli/commands.py lists the commands).

    fsdp-recipes finetune smollm2-135m-lora --max_steps 20
    fsdp-recipes plan mistral-7b-full --gpus 8 --gpu H100
    fsdp-recipes job --launcher slurm mistral-small-lora --nodes 2 --gpus 8

The arguments after the command go to that command's own `main` as they are. A mistyped command, and a missing or
unknown argument of any command, is one `error:` line naming the fix, exit 2.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import os
import re
import sys
from contextlib import contextmanager

from fsdp_recipes.cli.commands import BY_NAME, COMMANDS, Command
from fsdp_recipes.errors import UserError, cli

PROG = "fsdp-recipes"


def usage() -> str:
    rows = "\n".join(f"  {c.name:<12} {c.help}" for c in COMMANDS)
    return (f"usage: {PROG} <command> [args]   ({PROG} <command> --help for its own)\n\ncommands:\n{rows}\n")


def find(name: str) -> Command:
    if name in BY_NAME:
        return BY_NAME[name]
    close = difflib.get_close_matches(name, BY_NAME, n=1)
    fix = f"{PROG} {close[0]}" if close else f"one of {', '.join(c.name for c in COMMANDS)}"
    raise UserError(f"no command '{name}'. Fix: {fix} (`{PROG} --help` lists them).")


NOT_A_NUMBER = re.compile(r"argument (--[\w-]+): invalid int value: '(.*)'")
MAKE_VARIABLES = {"--gpus": "GPUS", "--nodes": "NODES"}  # the Makefile's variables that hand these flags on


@contextmanager
def as_command(command: Command):
    """The command's own parser named `fsdp-recipes <command>` in its help, and its usage errors (argparse's
    usage line, then the error, exit 2) as one `error:` line that names the fix, as every pack error is."""
    argv0, error = sys.argv[0], argparse.ArgumentParser.error

    def one_line(parser, message):
        bad = NOT_A_NUMBER.fullmatch(message)
        if bad:  # `make plan GPUS=abc` said "argument --gpus: invalid int value", a flag make's user never typed
            flag, value = bad.groups()
            make = f" (make: {MAKE_VARIABLES[flag]}=<n>)" if flag in MAKE_VARIABLES else ""
            raise UserError(f"{flag} takes a whole number, not '{value}'. Fix: {flag} <n>{make}.")
        unknown = message.removeprefix("unrecognized arguments: ").split() if message.startswith("unrecognized") else []
        close = [c for word in unknown if word.startswith("-")
                 for c in difflib.get_close_matches(word.split("=")[0], parser._option_string_actions, n=1)]
        hint = f"did you mean {' and '.join(close)}? " if close else ""
        raise UserError(f"{message}. Fix: {hint}see `{parser.prog} --help`.")

    sys.argv[0] = f"{PROG} {command.name}"  # argparse's default prog
    argparse.ArgumentParser.error = one_line  # parsers with an `error` of their own keep it
    try:
        yield
    finally:
        sys.argv[0], argparse.ArgumentParser.error = argv0, error


@cli
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage(), end="")
        return 0
    command = find(argv[0])
    module, function = command.target.split(":")
    target = getattr(importlib.import_module(module), function)
    os.environ.update(command.env)
    with as_command(command):
        return int(target(argv[1:]) or 0)
