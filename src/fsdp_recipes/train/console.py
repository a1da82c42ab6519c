"""What a rank shows on the console, and what it keeps for its log only.

Under the launcher, each rank's stdout and stderr go to the terminal and to output_dir/logs/rank<N>.log, and the
rank's `details.log` (beside torchrun's files for it) goes to that log only (launch/rank_output.py). A person reads
the console: it gets one line per logging step; the Trainer's whole log dictionaries and the library warnings a user
cannot act on go to details. Run without the launcher, details go to stderr: nothing is lost.
"""

from __future__ import annotations

import json
import re
import warnings

from transformers import TrainerCallback

from fsdp_recipes.library_logs import LOG_ONLY_WARNINGS
from fsdp_recipes.metrics import gates
from fsdp_recipes.metrics.figures import figure, is_number
from fsdp_recipes.train.failure_record import details



def log_only(category: type[Warning], message: str) -> bool:
    return any(issubclass(category, cat) and re.search(pattern, message) for cat, pattern in LOG_ONLY_WARNINGS)


def keep_upstream_warnings_in_log() -> None:
    """LOG_ONLY_WARNINGS go to details instead of stderr; the warnings filters still decide what is shown at all."""
    show = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):
        if log_only(category, str(message)):
            details(warnings.formatwarning(message, category, filename, lineno, line))
        else:
            show(message, category, filename, lineno, file, line)

    warnings.showwarning = showwarning


def no_loading_bars() -> None:
    """transformers' bars for loading and writing weights (a second each here) stay off the console; a download
    from the hub keeps its bar, which says how long the wait will be."""
    import huggingface_hub
    import transformers

    hub_bars = not huggingface_hub.utils.are_progress_bars_disabled()  # HF_HUB_DISABLE_PROGRESS_BARS, the user's
    transformers.utils.logging.disable_progress_bar()  # also turns off huggingface_hub's: back on as they were
    if hub_bars:
        huggingface_hub.utils.enable_progress_bars()


def progress_line(logs: dict, step: int, max_steps: int) -> str | None:
    """`[train] step 4/48  loss 2.217  lr 1.00e-03  146 tokens/s` for a training log; an eval line for an eval
    log; None for the rest (the end-of-training totals: the launcher's summary says them)."""
    width = len(str(max_steps))
    if "loss" in logs:
        parts = [f"[train] step {step:>{width}}/{max_steps}", f"loss {figure(logs['loss'], '.4g')}"]
        if "learning_rate" in logs:
            parts.append(f"lr {figure(logs['learning_rate'], '.2e')}")
        if "reward" in logs:  # GRPO: the sampled completions' mean reward
            parts.append(f"reward {figure(logs['reward'], '.3f')}")
        if "aux_loss" in logs:  # a mixture of experts: the router's load-balancing loss, before its coefficient
            parts.append(f"aux_loss {figure(logs['aux_loss'], '.4g')}")
        if "tokens_per_second" in logs:
            parts.append(f"{figure(logs['tokens_per_second'], ',.0f')} tokens/s")
        return "  ".join(parts)
    if "eval_loss" in logs:
        return f"[train] eval at step {step}/{max_steps}: loss {figure(logs['eval_loss'], '.4g')}"
    return None


class ProgressLines(TrainerCallback):
    """Instead of the Trainer's progress bars (ProgressCallback) or raw dictionaries (PrinterCallback): rank 0
    prints one line per log; every rank keeps the whole dictionary in its log. A loss past `divergence_factor` times
    the first is said on its line (metrics/gates.py: the summary and the exit code say it at the end)."""

    def __init__(self, divergence_factor: float = 0.0):
        self.divergence_factor = divergence_factor
        self.losses: list[float] = []

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            # the state's: the Trainer turns a fractional logging_steps into steps
            print(f"[train] training {state.max_steps} steps, a line every {state.logging_steps:g}", flush=True)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs:
            return
        details(f"[train] step {state.global_step}: {json.dumps(logs, default=str)}")
        line = progress_line(logs, state.global_step, state.max_steps) if state.is_world_process_zero else None
        if line and is_number(logs.get("loss")):  # an eval log has none; a None loss judges nothing
            self.losses.append(float(logs["loss"]))
            why = gates.diverged(self.losses, self.divergence_factor)
            if why:
                line += f"  DIVERGING: {why}"
        if line:
            print(line, flush=True)


def replace_progress_output(trainer, divergence_factor: float = 0.0) -> None:
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    trainer.remove_callback(ProgressCallback)
    trainer.remove_callback(PrinterCallback)
    trainer.add_callback(ProgressLines(divergence_factor))
