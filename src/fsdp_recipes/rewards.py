"""Reward functions a GRPO recipe names by import path (`reward_funcs: [fsdp_recipes.rewards.exact_answer]`).

TRL's GRPOTrainer calls each one per batch with keyword arguments: `prompts`, `completions` (chat turns, or text
for plain prompts), `completion_ids`, every other column of the dataset (here `answer`, which train/kinds/sampling.py
takes from a prompt-completion dataset's `completion`), and `trainer_state`, `log_extra`, `log_metric`. So a
reward function takes the arguments it reads by name and `**kwargs` for the rest, and returns one float (or None:
not applicable) per completion. Yours can live in any importable module; the launcher checks its signature before
any rank starts (train/kinds/sampling.py check_reward_func), and the ranks check what it returns at every call
(sampling.CheckedReward): no list, a list of the wrong length, a non-number, NaN or inf, an exception, or None for
every completion is one line naming the function, at the step where it happens.
"""

from __future__ import annotations


def text_of(completion) -> str:
    """A completion's text: the last turn's content for chat completions, the string itself otherwise."""
    if isinstance(completion, list):
        return completion[-1]["content"] if completion else ""
    return str(completion)


def exact_answer(completions: list, answer: list, **kwargs) -> list[float]:
    """1.0 where the completion, stripped, is exactly the expected answer (the sum, on the default's task), else 0.0:
    the same test as the run summary's exact match, so the training reward and the held-out score measure one
    thing."""
    return [1.0 if text_of(c).strip() == text_of(a).strip() else 0.0 for c, a in zip(completions, answer)]


def number_only(completions: list, **kwargs) -> list[float]:
    """The share of the completion's non-space characters that are digits: 1.0 for a bare number, as the default's
    system prompt asks ("Answer with the number only."), partial credit on the way there. `make smoke` adds it to the
    exact answer: a tiny random model is never exactly right, and a reward that never varies within a group trains
    nothing (its LoRA B matrices would stay zero, which the final-save check refuses as an incomplete save)."""
    shares = []
    for c in completions:
        chars = [ch for ch in text_of(c) if not ch.isspace()]
        shares.append(sum(ch.isdigit() for ch in chars) / len(chars) if chars else 0.0)
    return shares
