"""A run resumed from a checkpoint of its last step trains no further step (transformers 5.17-5.24).

Gap this fills: the Trainer checks `global_step >= max_steps` only after an optimizer step (DefaultFlowCallback's
on_step_end), never before the first step of a resumed epoch. Resumed from checkpoint-N with N == max_steps in the
middle of an epoch (`_init_training_state`: epochs_trained = N // steps per epoch, so the epoch loop still runs),
`_run_epoch` skips the N trained batches and trains batch N+1: the run ends at step N+1 of N, with a step the
uninterrupted run never took (its learning rate past the schedule's end, its tokens counted) and a
checkpoint-(N+1). Such a checkpoint is what a preemption seen at the last step leaves (train/preemption.py stops
the ranks one step after the signal, so a signal during step N-1 or N saves checkpoint-N and exits 75), and what a
run killed during its final save leaves: the relaunch then trained one extra step, under FSDP and under tensor
parallel alike (measured 2026-11-29: tiny-cpu-lora, `[train] step 5/4`). A callback cannot prevent it (the loop
reads `should_training_stop` only after a step), so the pack's trainer skips the epoch instead: nothing is left to
train, and the Trainer goes on to its end of training with the checkpoint's weights, optimizer state and logs.
"""

from __future__ import annotations

import functools

from fsdp_recipes.patches.guard import record, target
from fsdp_recipes.patches.versions import checked_on

PATCH = "resume_at_end.no_step_past_max_steps"
PARAMS = ("self", "model", "epoch", "train_dataloader", "steps_in_epoch", "num_update_steps_per_epoch", "trial",
          "ignore_keys_for_eval", "start_time", "resume_from_checkpoint", "epochs_trained",
          "steps_trained_in_current_epoch")


def no_step_past_max_steps(trainer) -> None:
    """`trainer` (that instance only) runs no epoch once its state is at max_steps: a resume at the last step."""
    original = target(type(trainer), "_run_epoch", PARAMS, patch=PATCH, checked_on=checked_on("transformers"))

    @functools.wraps(original)
    def run_epoch(*args, **kwargs):
        if trainer.state.global_step >= trainer.state.max_steps:  # only a resume gets here at max_steps
            trainer.control.should_training_stop = True  # and no later epoch either
            return None
        return original(trainer, *args, **kwargs)

    trainer._run_epoch = run_epoch
    record(PATCH, "transformers.Trainer._run_epoch (the pack's trainers)",
           "a run resumed at its last step (global_step == max_steps, mid-epoch) trains one step past max_steps")
