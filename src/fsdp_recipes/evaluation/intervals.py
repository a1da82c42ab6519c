"""How sure a held-out score is: a 95% interval for a share answered right, and a paired test for the change between
two models answering the same rows (`changes`: each stage against the one before it). The summary's scores
(evaluation/scores/) and bench/paired_stages.py use these; nothing here loads a model.

Wilson's score interval (E. B. Wilson, "Probable inference, the law of succession, and statistical inference",
JASA 22:209-212, 1927), in the closed form of R. G. Newcombe, "Two-sided confidence intervals for the single
proportion: comparison of seven methods", Statistics in Medicine 17:857-872, 1998 (method 3, no continuity
correction), for r right of n, p = r/n, q = 1 - p and z = 1.959964 (the normal's 97.5% point):

    (2r + z² ± z √(z² + 4rq)) / (2(n + z²))

It stays inside [0, 1] and is not empty at 0/n or n/n, where the textbook p ± z √(pq/n) is (0/20: 0 to 16.1%).

The exact McNemar test (Q. McNemar, Psychometrika 12:153-157, 1947; exact conditional form as in M. W. Fagerland,
S. Lydersen, P. Laake, "The McNemar test for binary matched-pairs data", BMC Medical Research Methodology 13:91,
2013): two models answer the same n rows; only the discordant rows tell them apart, b right only before and c right
only after. Under "no change" each discordant row is a fair coin, so b ~ Binomial(b + c, 1/2), and the two-sided
p-value is

    min(1, 2 · Σ_{i ≤ min(b, c)} C(b + c, i) / 2^(b + c))

(1 when b = c). Paired, not two independent shares: 93 -> 92 right of 100 is "no change" whether 1 row or 8 rows
changed sides, and 90 -> 97 is a change only if the rows that moved moved mostly one way.
"""

from __future__ import annotations

import math

Z95 = 1.959964  # the standard normal's 97.5% quantile: a two-sided 95% interval
ALPHA = 0.05  # a change between stages is called one when its exact McNemar p-value is below this


def wilson(correct: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval (95% by default) for `correct` of `n`; (0, 1) when n is 0 (nothing known)."""
    if n == 0:
        return (0.0, 1.0)
    r, q = correct, 1 - correct / n
    root = z * math.sqrt(z * z + 4 * r * q)
    lo, hi = (2 * r + z * z - root) / (2 * (n + z * z)), (2 * r + z * z + root) / (2 * (n + z * z))
    return (max(0.0, lo), min(1.0, hi))


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value of b rows right only before against c right only after."""
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(b, c) + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def share(correct: int, n: int) -> dict:
    """One stage's exact match as metrics.json keeps it: the count and its Wilson 95% interval (shares, 4 places)."""
    lo, hi = wilson(correct, n)
    return {"correct": correct, "n": n, "wilson95": [round(lo, 4), round(hi, 4)]}


def paired(before: list[bool], after: list[bool]) -> dict:
    """Two models' right/wrong on the same rows, in the same order: the discordant counts, the exact McNemar p-value
    and the verdict (`better`, `worse` or `no change` at ALPHA)."""
    if len(before) != len(after):
        raise ValueError(f"a paired test needs the same rows: {len(before)} against {len(after)}")
    b = sum(x and not y for x, y in zip(before, after))
    c = sum(y and not x for x, y in zip(before, after))
    p = mcnemar_exact(b, c)
    verdict = "no change" if p >= ALPHA else ("better" if c > b else "worse")
    return {"right_only_before": b, "right_only_after": c, "mcnemar_exact_p": p, "verdict": verdict}


def changes(stages: list[str], right: list[list[bool]]) -> list[dict]:
    """The paired test of each stage against the one before it (base -> sft -> dpo: two), on the same rows: `from`,
    `to` and `paired`'s counts, p-value and verdict."""
    return [{"from": a, "to": b, **paired(ra, rb)} for a, b, ra, rb in zip(stages, stages[1:], right, right[1:])]


def p_text(p: float) -> str:
    """p=1.00, p=0.22, p=0.031, p<0.001."""
    if p < 0.001:
        return "p<0.001"
    return f"p={p:.2f}" if p >= 0.1 else f"p={p:.2g}"


def rate_text(correct: int, n: int) -> str:
    """`93/100 (86.3-96.6%)`: a count with its Wilson 95% interval in percent."""
    lo, hi = wilson(correct, n)
    return f"{correct}/{n} ({100 * lo:.1f}-{100 * hi:.1f}%)"


def change_text(change: dict) -> str:
    """`no change (p=1.00; 4 right only before, 3 only after)`."""
    return (f"{change['verdict']} ({p_text(change['mcnemar_exact_p'])}; {change['right_only_before']} right only "
            f"before, {change['right_only_after']} only after)")
