"""A 4-bit run: its base was scored as it trained on it (loaded in 4 bits with the run's settings), and the 4-bit base
with the run's adapter is scored beside the stages: its exact match (or held-out loss, where answers are long), and
on how many prompts the merged model (the dequantised base + adapter, scored as `trained`) gives the same answer."""

from __future__ import annotations

from fsdp_recipes.evaluation import intervals

NEEDS = ("generations", "log-probs")
INTERVAL = "Wilson score interval, 95%, of the 4-bit base + adapter's exact match (adapted.wilson95)"


def applies(data) -> bool:
    return data.four_bit


def score(check: dict, scores) -> None:
    adapted = scores.adapted
    right = [o == e for o, e in zip(adapted["answers"], scores.data.expected)] if check.get("exact_match") else None
    merged = [e["trained"] for e in check["examples"]]
    check["four_bit"] = {"base": "loaded in 4 bits with the run's BitsAndBytesConfig, the model it trained on",
                         "adapted": intervals.share(sum(right), len(right)) if right else None,
                         "adapted_loss": adapted["loss"]["loss"],
                         "merged_same_answers": sum(a == m for a, m in zip(adapted["answers"], merged)),
                         "answers_compared": min(len(merged), len(adapted["answers"]))}
    for example, a in zip(check["examples"], adapted["answers"]):
        example["trained_4bit"] = a


def lines(check: dict) -> list[str]:
    q = check.get("four_bit")
    if not q:
        return []
    # its exact match where answers are scored, else its held-out loss (long answers); no answers: text rows
    parts = ["the base scored in 4 bits, as it trained"]
    if q.get("adapted"):
        parts.append(f"the 4-bit base + adapter {intervals.rate_text(q['adapted']['correct'], check['n'])}")
    elif q.get("adapted_loss") is not None:
        parts.append(f"the 4-bit base + adapter held-out loss {q['adapted_loss']:.3f}")
    if q.get("answers_compared"):
        parts.append(f"the merged model (dequantised base + adapter) gives its answer on "
                     f"{q['merged_same_answers']}/{q['answers_compared']}")
    return ["4 bits      " + "; ".join(parts)]
