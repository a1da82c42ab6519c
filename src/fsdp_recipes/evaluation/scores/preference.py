"""Preference for the chosen answer, on preference eval data: each stage's log p(chosen) > log p(rejected) share with
its Wilson 95% interval and mean margin, and DPO's implicit-reward accuracy of the last stage against the one before
it (the margin's change between them, paired on the same pairs)."""

from __future__ import annotations

from fsdp_recipes.evaluation import intervals

NEEDS = ("preference rows",)
INTERVAL = "Wilson score interval, 95%, of each stage's preference and of the implicit-reward accuracy"


def applies(data) -> bool:
    return bool(data.pairs)


def score(check: dict, scores) -> None:
    add_preference(check, [s["margins"] for s in scores.raw])


def add_preference(check: dict, margins_per_stage: list[list[float]]) -> None:
    """Each stage's preference for the chosen answer of the eval pairs (its log p(chosen) - log p(rejected) above 0),
    with its Wilson 95% interval, and DPO's implicit-reward accuracy of the last stage against the one before it."""
    for stage, m in zip(check["stages"], margins_per_stage):
        preferred = sum(x > 0 for x in m)
        stage.update(preference_accuracy=preferred / len(m), preferred=preferred,
                     preference_wilson95=intervals.share(preferred, len(m))["wilson95"],
                     mean_logp_margin=sum(m) / len(m))
    # DPO's implicit reward r = beta * (log pi - log pi_ref), pi_ref the model the run started from: the chosen
    # answer's reward above the rejected one's (beta > 0 leaves the sign alone)
    reward = [t - r for t, r in zip(margins_per_stage[-1], margins_per_stage[-2])]
    right = sum(x > 0 for x in reward)
    check["preference"] = {"pairs": len(reward), "reward_accuracy": right / len(reward), "reward_correct": right,
                           "reward_wilson95": intervals.share(right, len(reward))["wilson95"],
                           "mean_reward_margin_over_beta": sum(reward) / len(reward)}


def lines(check: dict) -> list[str]:
    pref = check.get("preference")
    if not pref:
        return []
    n = pref["pairs"]
    return [f"preference on {n} eval pairs, log p(chosen) > log p(rejected): " + " -> ".join(
        f"{s['stage']} {intervals.rate_text(s['preferred'], n)} margin {s['mean_logp_margin']:+.2f}"
        for s in check["stages"]) + f"; implicit-reward accuracy {intervals.rate_text(pref['reward_correct'], n)}"]
