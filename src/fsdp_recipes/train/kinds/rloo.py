"""RLOO: TRL's RLOOTrainer, REINFORCE with a leave-one-out baseline, reinforcement learning with a verifiable reward
on the same FSDP lifecycle as the other kinds.

Each step: every rank takes its share of the step's prompts, samples `num_generations` completions per prompt with
the policy being trained, scores them with the recipe's reward functions, and weights each completion by its reward
minus the mean reward of the *other* completions of its prompt (GRPO uses the group's mean and divides by its
spread). What RLOO shares with GRPO (rewards, generation backend, data, counting, plan, summary, the learned-nothing
check) is sampling.py's; this module adds RLOO's forwards and resume settings.
"""

from __future__ import annotations

from fsdp_recipes.train.kinds import sampling

SHARED_WITH = sampling  # every interface member not defined below (TrainerKind.from_module)

RESUME_SETTINGS = (*sampling.RESUME_SETTINGS, "normalize_advantages", "reward_clip_range")


def trainer_class():
    from trl import RLOOTrainer

    return RLOOTrainer


def extra_forwards(training) -> dict[str, float]:
    """Forwards per trained token besides its training forward and backward, once per sampled batch (trained on
    num_iterations times): sampling it, the policy's log-probabilities of what it sampled ("old_policy": RLOOTrainer
    computes them for every batch, trl 1.16 _generate_and_score_completions), and the reference model's when the KL
    term is on (beta > 0; RLOOConfig's default is 0.05)."""
    per_batch = 1.0 / training.num_iterations
    forwards = {"generation": per_batch, "old_policy": per_batch}
    if training.beta > 0:
        forwards["reference"] = per_batch
    return forwards
