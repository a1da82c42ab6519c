"""A rank's failure, as one record the launcher reads: every exception the entry point catches is written to
torchrun's per-rank error file, and the rank's lifetime is tied to the launcher's.

The record is torchrun's own (`torch.distributed.elastic.multiprocessing.errors`): torchrun sets
TORCHELASTIC_ERROR_FILE for every worker, reads the file when the worker fails and shows its message as the root
cause. We write the same JSON that `ErrorHandler.record_exception` writes (`message.message`,
`message.extraInfo.py_callstack`, `.timestamp`) and add what the launcher needs to print one line and choose an
exit code: the exception's type, its message alone, the global rank, the phase (`setup` until the first optimizer
step of this run, then `training`), the step in progress, and a timestamp precise enough to tell which rank failed
first (torchrun's is whole seconds). The launcher passes `--log_dir` to torchrun, so it knows where the files are.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

from fsdp_recipes import dist

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"  # set by torchrun for each worker
# Beside the error file: what the rank keeps for its log only (train/console.py); launch/rank_output.py relays it
DETAILS_FILE = "details.log"

# Where this rank is: the launcher's exit code is 2 for a failure before the first optimizer step, 1 after it.
STATE = {"phase": "setup", "step": None, "trained_steps": None}  # trained_steps: set once the Trainer's loop ended


class NonFiniteLoss(RuntimeError):
    """The loss of a training step was NaN or infinite: training stops before the optimizer applies it."""


def training_started(completed_step: int) -> None:
    """Called after each optimizer step; `completed_step` is the Trainer's global_step."""
    STATE["phase"] = "training"
    STATE["step"] = completed_step + 1  # the step now in progress


def mark_rank() -> None:
    """Write this rank's global number beside its error file: torchrun's folders are named by local rank, and the
    launcher names the logs by global rank (launch/rank_output.py)."""
    path = os.environ.get(ERROR_FILE_ENV)
    if path and "RANK" in os.environ:
        with open(os.path.join(os.path.dirname(path), "rank"), "w") as f:
            f.write(os.environ["RANK"])


def record(err: BaseException) -> dict:
    """Write `err` (being handled) to torchrun's error file for this rank, if there is one; returns the record."""
    now = time.time()
    data = {
        "message": {
            "message": f"{type(err).__name__}: {err}",
            "extraInfo": {
                "py_callstack": traceback.format_exc(),
                "timestamp": str(int(now)),
                # the pack's fields, beside torchrun's
                "time": now,
                "type": f"{type(err).__module__}.{type(err).__qualname__}",
                "error": str(err),
                "rank": dist.rank(),
                "phase": STATE["phase"],
                "step": STATE["step"],
                "trained_steps": STATE["trained_steps"],
            },
        }
    }
    path = os.environ.get(ERROR_FILE_ENV)
    if path:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    return data


def make_phase_callback():
    from transformers import TrainerCallback

    class PhaseCallback(TrainerCallback):
        """Moves the record's phase to `training` once this run has taken an optimizer step."""

        def on_optimizer_step(self, args, state, control, **kwargs):
            training_started(state.global_step)

        def on_step_end(self, args, state, control, **kwargs):
            training_started(state.global_step)  # global_step is updated after on_optimizer_step

        def on_train_end(self, args, state, control, **kwargs):
            STATE["trained_steps"] = state.global_step  # what fails now fails after the loop, in no step

    return PhaseCallback()


def die_with_parent(sig: int = 9) -> None:
    """Linux: have the kernel send `sig` to this process when its parent dies (prctl PR_SET_PDEATHSIG).

    Gap it fills: the launcher starts `accelerate launch` in a session of its own, and torchrun starts each rank in
    yet another; a launcher killed with SIGKILL (the OOM killer, `kill -9`, a closed terminal's SIGHUP to a
    process that cannot pass it on) left torchrun and the ranks running, holding memory and GPUs. The launcher sets
    this for `accelerate launch` (a preexec function), and each rank for itself (its parent is torchrun). Safe to
    call anywhere; a no-op off Linux."""
    import ctypes

    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, sig, 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the call: the kernel will not send the signal now
        os.kill(os.getpid(), sig)


def details(text: str) -> None:
    """Append `text` to this rank's log only (stderr when not under the launcher)."""
    text = text if text.endswith("\n") else text + "\n"
    error_file = os.environ.get(ERROR_FILE_ENV)
    if error_file:
        try:
            with open(os.path.join(os.path.dirname(error_file), DETAILS_FILE), "a") as f:
                f.write(text)
            return
        except OSError:  # a full temporary disk must not stop training: then the console gets it
            pass
    sys.stderr.write(text)
    sys.stderr.flush()
