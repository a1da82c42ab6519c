"""Evaluation metrics: one module each, and one registry, METRICS. The scoring (evaluation/scoring.py) loads each
stage's model once (base -> sft -> dpo), computes what the metrics that apply to the run's eval rows NEED, once for
all of them, and hands it to each; the summary (launch/summary.py) prints every metric's lines. Nothing outside this
folder names a metric.

A metric module provides (EvalMetric below checks it when the metric is registered):
    NEEDS                 what it reads of each stage's model, a tuple of NEEDS_KINDS: "log-probs" (the reference
                          answers' held-out loss, evaluation/answer_loss.py), "generations" (greedy answers to the
                          prompts, evaluation/generation.py), "preference rows" (log p(chosen) - log p(rejected) of
                          each pair)
    applies(data)         whether the run's eval rows have what it scores (stages.EvalData: prompts with reference
                          answers or texts, preference pairs, a 4-bit run)
    score(check, scores)  how it scores the stages from what they gave (stages.Scores): its counts with their
                          intervals and the paired test between stages (evaluation/intervals.py), written into the
                          check that sample_generations.json keeps, each stage's into check["stages"][i] (which
                          metrics.json's `eval` keeps too)
    INTERVAL              how sure its figures are, in words: the interval and the paired test it reports, or why
                          it has none (metrics.json's `eval` keeps it under `intervals`)
    lines(check)          its lines in the summary, from the check alone ([] where it has nothing to say)

The order of NAMES is the order of the summary's lines; the metrics on preference rows come after the line that says
whether the scored rows were held out.

Adding a metric: its module here and its name in NAMES (docs/architecture.md).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from types import ModuleType

from fsdp_recipes import registry
from fsdp_recipes.registry import members_of

NAMES = ("held_out_loss", "exact_match", "four_bit", "preference")
NEEDS_KINDS = ("log-probs", "generations", "preference rows")  # what evaluation/scoring.py computes for a stage


@dataclasses.dataclass(frozen=True)
class EvalMetric:
    """What the scoring and the summary ask of a metric. Built from the metric's module by `from_module`: a missing
    member, or a need the scoring cannot compute, fails there, when the metric is registered."""

    name: str
    NEEDS: tuple
    applies: Callable
    score: Callable
    INTERVAL: str
    lines: Callable
    module: ModuleType | None = None

    @classmethod
    def from_module(cls, name: str, module: ModuleType) -> EvalMetric:
        members = members_of(cls, module, "evaluation metric", name, "fsdp_recipes/evaluation/scores/__init__.py")
        needs = module.NEEDS
        if not isinstance(needs, tuple) or not needs or not set(needs) <= set(NEEDS_KINDS):
            raise TypeError(f"evaluation metric {name} ({module.__name__}) NEEDS {needs!r}: a tuple of "
                            f"{', '.join(NEEDS_KINDS)}")
        if not isinstance(module.INTERVAL, str) or not module.INTERVAL:
            raise TypeError(f"evaluation metric {name} ({module.__name__}): INTERVAL says in words how sure its "
                            f"figures are (or why it has no interval)")
        return cls(name=name, module=module, **members)

    def on_pairs(self) -> bool:
        """It scores the preference rows: its lines follow the note on the scored rows."""
        return "preference rows" in self.NEEDS


METRICS: dict[str, EvalMetric] = {
    name: EvalMetric.from_module(name, importlib.import_module(f"{__name__}.{name}")) for name in NAMES
}


def register(name: str, module: ModuleType) -> EvalMetric:
    """A metric added after the pack's own (a test's, a user's): checked as they are, scored and printed after them."""
    return registry.register(METRICS, EvalMetric, name, module)


def applying(data) -> list[EvalMetric]:
    """The metrics that apply to the run's eval data, in the summary's order."""
    return [m for m in METRICS.values() if m.applies(data)]
