"""Held-out loss: each stage's mean negative log-likelihood per scored token of the reference answers (of the text,
for text rows), and its perplexity (evaluation/answer_loss.py). A mean over tokens, so no interval: the exact match
beside it carries those."""

from __future__ import annotations

from fsdp_recipes.evaluation.stages import names

NEEDS = ("log-probs",)
INTERVAL = "none: a mean over every scored token, compared between stages as it is"


def applies(data) -> bool:
    return bool(data.items)


def score(check: dict, scores) -> None:
    last = scores.raw[-1]["loss"]  # what was counted is the same rows for every stage: the last stage's counts
    check["loss"] = {k: last[k] for k in ("rows", "tokens", "rows_cut", "max_tokens")}
    for stage, raw in zip(check["stages"], scores.raw):
        stage.update(loss=raw["loss"]["loss"], perplexity=raw["loss"]["perplexity"])


def lines(check: dict) -> list[str]:
    loss, chain = check.get("loss"), check["stages"]
    if not loss or not all(s.get("loss") is not None for s in chain):
        return []
    held = check.get("held_out", True)
    rows = f"{loss['rows']} eval rows" if held else (
        f"{loss['rows']} eval rows (not held out: chosen again on resume)" if check.get("eval_rows_changed")
        else f"{loss['rows']} training rows (not held out)")
    cut = f"; {loss['rows_cut']} rows cut at {loss['max_tokens']} tokens" if loss.get("rows_cut") else ""
    scored = "answer tokens" if check["n"] else "tokens"
    per_stage = " -> ".join(f"{name} {s['loss']:.3f}" + (f" (perplexity {s['perplexity']:.3g})" if s.get(
        "perplexity") is not None else "") for name, s in zip(names(check), chain))
    # rows the training data also holds (summary.rows_note names them): their loss is no held-out loss
    label = "held-out loss" if held and not check.get("eval_rows_in_train") else "loss"
    return [f"{label} on {rows} ({loss['tokens']:,} {scored}{cut}): {per_stage}"]
