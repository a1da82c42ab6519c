"""evaluation/intervals.py against published and hand-worked values, not against itself: Wilson's score interval and the
exact McNemar test that the summary and bench/paired_stages.py report with."""

import math

import pytest

from fsdp_recipes.evaluation import intervals


@pytest.mark.parametrize("correct, n, lo, hi", [
    # R. G. Newcombe, Statistics in Medicine 17:857-872 (1998): the worked examples, method 3 (score interval
    # without continuity correction), 95%
    (81, 263, 0.2553, 0.3662),
    (15, 148, 0.0624, 0.1605),
    (0, 20, 0.0000, 0.1611),
    (1, 29, 0.0061, 0.1718),
    # by hand, (2r + z^2 ± z sqrt(z^2 + 4 r q)) / (2 (n + z^2)) with z = 1.96: at 0/n the upper limit is
    # z^2 / (n + z^2) = 3.8415 / 103.8415 and at n/n the lower one is n / (n + z^2)
    (0, 100, 0.0, 0.0370),
    (100, 100, 0.9630, 1.0),
])
def test_wilson_intervals_are_the_published_ones(correct, n, lo, hi):
    got = intervals.wilson(correct, n)
    assert (round(got[0], 4), round(got[1], 4)) == (lo, hi)


def test_wilson_interval_of_nothing_is_everything():
    assert intervals.wilson(0, 0) == (0.0, 1.0)


@pytest.mark.parametrize("b, c, p", [
    # M. W. Fagerland, S. Lydersen, P. Laake, BMC Medical Research Methodology 13:91 (2013), and its supplement
    # "How to calculate the McNemar mid-p test": airway hyper-responsiveness before and after stem cell
    # transplantation in 21 children (Bentur et al. 2009), discordant pairs 1 and 7; the exact conditional p-value is
    # 2 x binomcdf(1, 8, 0.5) = 2 x 9/256
    (1, 7, 0.0703125),
    (7, 1, 0.0703125),  # two-sided: the same either way round
    # by hand: 2 x P(X <= min(b, c)) for X ~ Bin(b + c, 1/2)
    (0, 6, 2 / 64),  # 0.03125
    (4, 3, 1.0),  # 2 x (1 + 7 + 21 + 35)/128 = 1: 93 -> 92 of 100 with 4 and 3 rows changing sides
    (2, 10, 2 * (1 + 12 + 66) / 4096),  # 0.0386
    (5, 5, 1.0),
    (0, 0, 1.0),  # no discordant row: nothing tells the two apart
])
def test_exact_mcnemar_p_values(b, c, p):
    assert intervals.mcnemar_exact(b, c) == pytest.approx(p, rel=1e-12)


def test_a_change_is_judged_on_the_rows_that_changed_sides():
    # 93 -> 92 of 100: 4 right only before, 3 only after
    before = [True] * 89 + [True] * 4 + [False] * 3 + [False] * 4
    after = [True] * 89 + [False] * 4 + [True] * 3 + [False] * 4
    assert intervals.paired(before, after) == {"right_only_before": 4, "right_only_after": 3,
                                               "mcnemar_exact_p": 1.0, "verdict": "no change"}
    # 6 rows fixed, none broken: p = 0.03125 < 0.05
    assert intervals.paired([False] * 6 + [True] * 4, [True] * 10)["verdict"] == "better"
    assert intervals.paired([True] * 10, [False] * 6 + [True] * 4)["verdict"] == "worse"
    # 5 fixed, none broken: p = 2/32 = 0.0625, not a change at 5%
    assert intervals.paired([False] * 5, [True] * 5)["verdict"] == "no change"
    with pytest.raises(ValueError, match="the same rows"):
        intervals.paired([True], [True, False])


def test_the_texts():
    assert intervals.rate_text(93, 100) == "93/100 (86.3-96.6%)"
    assert [intervals.p_text(p) for p in (1.0, 0.5, 0.0703125, 0.03125, 0.0009)] == [
        "p=1.00", "p=0.50", "p=0.07", "p=0.031", "p<0.001"]
    change = {"right_only_before": 4, "right_only_after": 3, "mcnemar_exact_p": 1.0, "verdict": "no change"}
    assert intervals.change_text(change) == "no change (p=1.00; 4 right only before, 3 only after)"
    assert intervals.share(93, 100) == {"correct": 93, "n": 100, "wilson95": [0.8625, 0.9657]}
    assert not math.isnan(intervals.wilson(1, 1)[0])
