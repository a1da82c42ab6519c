"""User mistakes become one clear line and a non-zero exit, never a traceback; and the pack's exit codes."""

from __future__ import annotations

import functools
import os
import select
import sys

EXIT_USER_ERROR = 2  # a mistake the user can fix, found before training
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for Ctrl-C
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: a checkpoint was saved on a signal; the same command resumes from it
EXIT_GATE_FAILED = 3  # trained and saved, but below the recipe's MFU floor or over its memory ceiling (metrics/gates.py)
EXIT_DIVERGED = 4  # trained and saved, but the loss diverged: the weights are not worth using
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a shell reports for a command whose reader closed the pipe


class UserError(Exception):
    """A problem the user can fix: the message names the problem and the fix. `exit_code`: 2 for a mistake found
    before training; the launcher uses 1 for a run that failed during training."""

    def __init__(self, message: str, exit_code: int = EXIT_USER_ERROR) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def cli(main):
    """Decorate a CLI `main`: a UserError prints `error: <message>` on stderr and exits with its code (2)."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except UserError as err:
            print(f"error: {err}", file=sys.stderr, flush=True)
            sys.exit(err.exit_code)
        except KeyboardInterrupt:  # Ctrl-C where no step of the command handles it (pressed again while it stops)
            print("interrupted", file=sys.stderr, flush=True)
            sys.exit(EXIT_INTERRUPTED)
        except BrokenPipeError:
            if not reader_left_stdout():  # another pipe or socket broke: a failure, with its traceback
                raise
            # `fsdp-recipes plan ... | head`: the reader has what it wanted and left. Python's flush of stdout at exit
            # would raise again (the idiom of the signal module's docs)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(EXIT_BROKEN_PIPE)

    return wrapper


def reader_left_stdout() -> bool:
    """Whether stdout is a pipe whose reader closed it: its write end then polls POLLERR (Linux, macOS)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll, or no real stdout
        return False
