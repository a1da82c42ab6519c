"""The preemption contract, written once: which signals mean "save and stop", and how long a save may take.

A scheduler (Slurm, Kubernetes, a user's `kill`) sends one of SIGNALS to the launcher; the launcher passes it on
through torchrun, which waits `PET_SHUTDOWN_TIMEOUT` (the recipe's `preemption_grace_s`) before killing the ranks;
every rank stops at the same step boundary, saves and exits 75 (train/preemption.py). A scheduler must itself wait
longer than that before its own kill: the recipe's grace plus SHUTDOWN_MARGIN_S (torchrun's shutdown and the
launcher's summary). The ranks' argument default, the launcher and every cluster launcher (cluster/) read these.
"""

from __future__ import annotations

import signal

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # what the ranks treat as preemption (SIGINT is the user's Ctrl-C)
GRACE_S = 120  # preemption_grace_s's default: seconds the ranks get to save after the signal
SHUTDOWN_MARGIN_S = 60  # on top of the grace, for a scheduler: torchrun's shutdown and the launcher's summary


def grace_seconds(recipe) -> int:
    """preemption_grace_s of a config/recipes.py `Recipe` (not imported: recipes.py reads run_config.py, which reads
    GRACE_S here) before it is parsed: torchrun reads it at start; the parse checks it later."""
    value = recipe.field("preemption_grace_s")
    try:
        return int(value)
    except (TypeError, ValueError):
        return GRACE_S


def scheduler_grace(grace_s: int) -> int:
    """What a scheduler must allow between its signal and its kill for a save of `grace_s` seconds to finish."""
    return grace_s + SHUTDOWN_MARGIN_S
