"""GRPO: TRL's GRPOTrainer, reinforcement learning with a verifiable reward, on the same FSDP lifecycle as SFT and DPO.

Each step: every rank takes its share of the step's prompts, samples `num_generations` completions per prompt with
the policy being trained, scores them with the recipe's reward functions, and trains on the completions weighted by
their advantage over their group's mean reward. A group whose completions all score alike carries no advantage,
hence no gradient. What GRPO shares with the other sampling kinds (rewards, generation backend, data, counting,
plan, summary) is sampling.py's; this module adds GRPO's forwards and resume settings.
"""

from __future__ import annotations

from fsdp_recipes.train.kinds import sampling

SHARED_WITH = sampling  # every interface member not defined below (TrainerKind.from_module)

RESUME_SETTINGS = (*sampling.RESUME_SETTINGS, "loss_type", "scale_rewards")


def trainer_class():
    from trl import GRPOTrainer

    return GRPOTrainer


def extra_forwards(training) -> dict[str, float]:
    """Forwards per trained token besides its training forward and backward, each run once per sampled batch, which
    is trained on num_iterations times (trl 1.16 _generate_and_score_completions): sampling it; the reference
    model's when the KL term is on (beta > 0); and the policy's own again ("old_policy", the log-probabilities TRL's
    importance sampling needs) with vLLM's importance-sampling correction, or when a sampled batch outlives an
    optimizer step (the accumulation not a multiple of steps_per_generation x num_iterations)."""
    per_batch = 1.0 / training.num_iterations
    forwards = {"generation": per_batch}
    if training.beta > 0:
        forwards["reference"] = per_batch
    every = training.steps_per_generation * training.num_iterations
    if training.gradient_accumulation_steps % every or (training.use_vllm and
                                                        training.vllm_importance_sampling_correction):
        forwards["old_policy"] = per_batch
    return forwards
