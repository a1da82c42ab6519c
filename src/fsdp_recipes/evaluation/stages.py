"""The models the summary scores: a run's trained model and every stage before it (base -> sft -> dpo), and the
run's eval data and each stage's scores as every metric (evaluation/scores/) reads them."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path


def trained_model_dir(run_dir: Path) -> Path | None:
    """The model directory the generations load: `merged/` of a LoRA run, else the run's own full model; None for a
    LoRA run without a merged model (nothing loadable without peft here)."""
    merged = run_dir / "merged"
    trained = merged if (merged / "config.json").exists() else run_dir
    return trained if (trained / "config.json").exists() else None


def stages(run_dir: Path, run_args: dict, trained: Path) -> list[tuple[str, str]]:
    """(name, model folder) from the first base model to this run's trained model. A model that is another run's
    output (its folder or `merged/` beside that run's run_args.json: the SFT model a DPO run continues from) is
    named by that run's trainer, and its own base comes before it."""
    chain = [(run_args.get("pack_args", {}).get("trainer", "trained"), str(trained))]
    model = run_args["model_args"]["model_name_or_path"]
    seen = {Path(run_dir).resolve()}
    for _ in range(8):  # a chain of runs, each continuing from the one before
        folder = Path(model)
        source = folder.parent if folder.name == "merged" else folder
        if not (source / "run_args.json").is_file() or source.resolve() in seen:  # a run trained over its own model
            break
        seen.add(source.resolve())
        before = json.loads((source / "run_args.json").read_text())
        chain.append((before.get("pack_args", {}).get("trainer", "trained"), model))
        model = before["model_args"]["model_name_or_path"]
    chain.append(("base", model))
    return chain[::-1]


def names(check: dict) -> list[str]:
    """The stages as the summary's lines call them: `base model` and `trained` for a run and its base, else each
    stage's own name (base, sft, dpo)."""
    chain = check["stages"]
    return ["base model", "trained"] if len(chain) == 2 else [s["stage"] for s in chain]


@dataclasses.dataclass(frozen=True)
class EvalData:
    """A run's scored rows, as every metric sees them (evaluation/eval_rows.py reads them)."""

    items: list  # (prompt, reference answer), or (None, text) for a text row: what the held-out loss scores
    pairs: list = dataclasses.field(default_factory=list)  # (chat prompt, chosen, rejected) of preference rows
    text_field: str = "text"
    four_bit: bool = False  # a 4-bit run: its 4-bit base + adapter is scored beside the stages

    @property
    def refs(self) -> list:
        """(prompt, reference answer) of the rows that have a prompt to answer."""
        return [(p, a) for p, a in self.items if p is not None]

    @property
    def expected(self) -> list[str]:
        """The reference answers stripped, as exact match compares them."""
        return [a.strip() for _, a in self.refs]


@dataclasses.dataclass(frozen=True)
class Scores:
    """What the stages' models gave, from one load each (evaluation/scoring.py score_stage): per stage, what the
    metrics that apply NEED: `loss` (log-probs: answer_loss.held_out_loss), `answers` and `long_answers`
    (generations), `margins` (preference rows)."""

    data: EvalData
    stages: list  # (name, model folder), base first
    raw: list  # one dict per stage
    adapted: dict | None = None  # a 4-bit run: the 4-bit base + adapter's, beside the stages
