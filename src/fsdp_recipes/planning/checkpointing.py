"""`make plan`'s activation-checkpointing choice: each policy the option offers (speed/activation_checkpointing.py,
fastest first) planned in full, and the pick: the recipe's pin, or for `auto` the fastest whose total fits the
limit the run's gates leave (the GPU's memory x the smallest of the planner's 90%, 1 - memory_headroom_warning and
peak_memory_max_fraction), else the one that holds least. The line names which of them set the limit: a stricter
gate (the default recipe's 50%) is a second figure beside the report's "usable", and unnamed it read as a mistake.
The memory of each comes from memory_budget.budget, so the pick is the same arithmetic the table prints.
"""

from __future__ import annotations

import dataclasses

from fsdp_recipes import speed
from fsdp_recipes.planning import memory_budget
from fsdp_recipes.planning.memory_budget import GIB


@dataclasses.dataclass
class Choice:
    label: str  # the line's label, the option's own words
    totals: dict[str, int]  # policy -> bytes per GPU under the recipe's strategy, fastest first
    fields: dict[str, dict]  # policy -> its Setup fields
    pick: str
    pinned: bool  # the recipe named it (else the planner picked)
    limit: float  # bytes per GPU the pick had to fit
    # what set the limit, in the line's words: the planner's usable budget, or a stricter share the recipe's gates set
    # (a limit beside "71.6 GiB usable" with no name read as a second, contradicting budget)
    limit_source: str = "the usable budget"


def limit_share(pack, headroom: float, capacity_gib: float) -> tuple[float, str]:
    """(the share of the GPU's memory the gates leave, what set it, named): the planner's headroom (the usable
    budget), or the recipe's memory_headroom_warning or peak_memory_max_fraction where stricter. The shares are all of
    the GPU's whole memory, as metrics/gates.py judges the run (peak reserved / device total)."""
    of = f"of {capacity_gib:.1f} GiB"
    stricter = f"stricter than the {headroom * capacity_gib:.1f} GiB usable"
    shares = [(headroom, f"the usable budget: {100 * headroom:g}% {of}")]
    if pack.memory_headroom_warning:
        share = 1 - pack.memory_headroom_warning
        shares.append((share, f"the memory_headroom_warning margin: {100 * share:g}% {of}, {stricter}"))
    if pack.peak_memory_max_fraction is not None:
        share = pack.peak_memory_max_fraction
        shares.append((share, f"the peak_memory_max_fraction gate: {100 * share:g}% {of}, {stricter}"))
    return min(shares, key=lambda pair: pair[0])  # on a tie, the first: the usable budget


def choose(cfg, shape: memory_budget.ModelShape, setup: memory_budget.Setup, capacity_bytes: float,
           headroom: float) -> Choice | None:
    choices, pinned, label = speed.planner_choices(cfg)
    if not choices:
        return None
    totals = {name: memory_budget.budget(shape, dataclasses.replace(setup, **fields))["total"]
              for name, fields in choices.items()}
    share, source = limit_share(cfg.pack, headroom, capacity_bytes / GIB)
    limit = capacity_bytes * share
    if pinned is not None:
        return Choice(label, totals, choices, pinned, True, limit, source)
    fitting = [name for name, total in totals.items() if total <= limit]
    pick = fitting[0] if fitting else min(totals, key=totals.get)
    return Choice(label, totals, choices, pick, False, limit, source)


def setup_for(choice: Choice | None, setup: memory_budget.Setup) -> memory_budget.Setup:
    return dataclasses.replace(setup, **choice.fields[choice.pick]) if choice else setup


def line(choice: Choice) -> str:
    cells = ", ".join(f"{name} {total / GIB:,.1f} GiB" + ("" if total <= choice.limit else " (over)")
                      for name, total in choice.totals.items())
    why = "the recipe's" if choice.pinned else (
        "the fastest that fits" if choice.totals[choice.pick] <= choice.limit else "none fits; the least memory")
    return (f"{choice.label}: {cells}; limit {choice.limit / GIB:,.1f} GiB per GPU ({choice.limit_source}) -> pick "
            f"{choice.pick} ({why})")
