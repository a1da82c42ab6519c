"""Exact match: each stage's greedy answers equal to the reference answers (both stripped), with Wilson 95%
intervals, and the exact McNemar test of each stage against the one before it (evaluation/intervals.py). Scored where
every reference answer is short (SHORT_ANSWER_TOKENS); otherwise, and for text rows, a note says why not."""

from __future__ import annotations

from fsdp_recipes.evaluation import eval_rows, intervals
from fsdp_recipes.evaluation.stages import names

NEEDS = ("generations",)
INTERVAL = ("Wilson score interval, 95%, per stage (wilson95); exact McNemar test between consecutive stages, a change "
            f"where p < {intervals.ALPHA}")


def applies(data) -> bool:
    return bool(data.items)  # text rows too: the note says there is no prompt to answer


def score(check: dict, scores) -> None:
    data, raw = scores.data, scores.raw
    refs, expected = data.refs, data.expected
    long = max(s.get("long_answers", 0) for s in raw)  # every stage generated for every prompt, or none scored
    right = [[o == e for o, e in zip(s["answers"], expected)] for s in raw] if refs and not long else None
    check.update(exact_match=right is not None, base_correct=sum(right[0]) if right else None,
                 trained_correct=sum(right[-1]) if right else None)
    for stage, r in zip(check["stages"], right or [None] * len(raw)):
        stage.update(intervals.share(sum(r), len(r)) if r is not None else {"correct": None})
    check["changes"] = intervals.changes([name for name, _ in scores.stages], right) if right else []
    if refs and long:
        check["exact_match_note"] = (
            f"{long} of the {len(refs)} reference answers are over {eval_rows.SHORT_ANSWER_TOKENS} tokens (exact match "
            f"is for short answers; the loss is the measure); sample_generations.json has the first "
            f"{eval_rows.SAMPLE_ROWS} prompts answered, up to {eval_rows.SAMPLE_TOKENS} tokens each")
    elif not refs:
        check["exact_match_note"] = f"text rows (`{data.text_field}`) have no prompt to answer: the loss is the measure"


def lines(check: dict) -> list[str]:
    n = check["n"]
    what = "eval prompts" if check.get("held_out", True) else (
        "eval prompts (not held out: chosen again on resume)" if check.get("eval_rows_changed")
        else "training prompts (not held out)")
    if not (check.get("exact_match", True) and n):
        return [f"exact match not scored: {check['exact_match_note']}"] if check.get("exact_match_note") else []
    chain = check["stages"]
    rates = " -> ".join(f"{name} {intervals.rate_text(s['correct'], n)}" for name, s in zip(names(check), chain))
    changes = check.get("changes") or []
    if len(chain) == 2 and changes:
        out = [f"exact match on {n} {what}: {rates}: {intervals.change_text(changes[0])}"]
    else:
        out = [f"exact match on {n} {what}: {rates}"]
        if changes:
            out.append("            on the same prompts: " + "; ".join(
                f"{c['from']} -> {c['to']} {intervals.change_text(c)}" for c in changes))
    out.append(f"            95% Wilson intervals; a change: exact McNemar test on the prompts only one side got "
               f"right (p < {intervals.ALPHA})")
    return out
