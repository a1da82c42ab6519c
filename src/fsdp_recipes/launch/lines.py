"""What the launcher prints: its `[launch]` lines, and an exception no check turned into a UserError as one line,
its traceback in a file."""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager

# Only light modules here: the heavy imports (torch, transformers, TRL) happen in the checks, while the ranks
# import the same in parallel.
from fsdp_recipes.errors import UserError


def say(msg: str) -> None:
    print(f"[launch] {msg}", flush=True)


@contextmanager
def unexpected_errors(doing: str):
    """Any exception but a UserError, raised inside, becomes the one line of `unexpected`."""
    try:
        yield
    except UserError:
        raise
    except Exception as err:
        raise unexpected(err, doing) from None


def unexpected(err: Exception, doing: str, fix: str = "correct the setting or file it names",
               exit_code: int = 2) -> UserError:
    """An exception no check turned into a UserError (a library's own validation, or a bug): one line, and the
    traceback in a file, since output_dir may be what is wrong."""
    import traceback

    fd, path = tempfile.mkstemp(prefix="fsdp-recipes-launch-", suffix=".log")
    with os.fdopen(fd, "w") as f:
        f.write("".join(traceback.format_exception(err)))
    first = next((x.strip() for x in str(err).splitlines() if x.strip()), "")
    return UserError(f"{type(err).__name__} while {doing}: {first}. Fix: {fix}; full traceback: {path}",
                     exit_code=exit_code)

