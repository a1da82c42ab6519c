"""One logged or reported figure as text, whatever it holds. A trainer may log None (TRL's `reward_std` when a reward
function scores no completion of a batch), a run's report may hold null where a figure does not exist (MFU on a
CPU), and a diverged run NaN or inf: the console, the summary and `make report` print "n/a" for a figure that is not
a number and Python's own `nan`/`inf` for one that is, and never raise while saying what happened."""

from __future__ import annotations

import numbers

MISSING = "n/a"


def is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def figure(value, spec: str = "", missing: str = MISSING) -> str:
    """`value` formatted with `spec` (a format spec: ".3f", ",.0f"); `missing` for None or anything not a number."""
    return format(value, spec) if is_number(value) else missing  # nan and inf format as "nan", "inf"


def percent(value, digits: int = 1, missing: str = MISSING) -> str:
    """A fraction as a percentage: 0.123 -> 12.3%."""
    return f"{figure(100 * value, f'.{digits}f')}%" if is_number(value) else missing
