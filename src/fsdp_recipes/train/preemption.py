"""Stop at the next step boundary on SIGTERM or SIGUSR1, save a checkpoint, and exit with EXIT_PREEMPTED.

Kubernetes and Run:ai send SIGTERM before killing a pod; Slurm sends what `--signal` names (USR1 here)
before the time limit or on preemption. torchrun forwards the signal it receives to every rank and then
waits `PET_SHUTDOWN_TIMEOUT` seconds (the grace period; the launcher sets it) before killing them.

If the save outlives the grace period, torchrun kills the ranks: checkpoint-N then has no completion marker
(checkpoints.py) and is skipped on resume, and metrics.json is the provisional `status: preempted` report
written before the save began; the launcher adds what happened and still exits with EXIT_PREEMPTED.

A handler only sets a flag. At every step end each rank starts an all-reduce of its flag (one number, over the
gloo group of dist.host_group) and reads the one it started a step earlier, which has long arrived: the ranks see
the same combined flag at the same step, so all of them stop after the same step, save the same checkpoint, and
exit together, one step after the first rank saw the signal. Reading this step's flag at once would make every
rank wait for the slowest at every step; on a GPU a flag on the device would also block the host until the GPU
drained its queue (one host synchronisation per step). tests/test_host_syncs.py counts them: none per step.
Gap this fills: the Trainer has no preemption handling; a signal kills it wherever it is.
"""

from __future__ import annotations

import signal

from transformers import TrainerCallback

from fsdp_recipes.config.preemption import SIGNALS
from fsdp_recipes.dist import all_reduce_async


class PreemptionCallback(TrainerCallback):
    def __init__(self, report=None):
        self.signal_received: int | None = None
        self.preempted = False
        self.report = report  # RunReportCallback: told before the save, in case the grace period ends it
        self.pending = None  # the flags' all-reduce started at the previous step end
        for sig in SIGNALS:
            signal.signal(sig, self._handler)

    def _handler(self, signum, frame):
        self.signal_received = signum

    def on_step_end(self, args, state, control, **kwargs):
        previous, self.pending = self.pending, all_reduce_async([1.0 if self.signal_received else 0.0], "max")
        if previous is not None and previous.result()[0] > 0:
            self.preempted = True
            control.should_save = True
            control.should_training_stop = True
            if self.report is not None:  # replaced by the final report once checkpoint-N is complete
                self.report.write_provisional("preempted", f"stopped by a signal at step {state.global_step}; "
                                              f"checkpoint-{state.global_step} was being saved")
        return control

    def on_train_end(self, args, state, control, **kwargs):
        if self.pending is not None:  # every rank started it at the last step end: finish it on every rank
            self.pending.result()
            self.pending = None
