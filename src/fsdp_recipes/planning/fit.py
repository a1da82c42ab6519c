"""`make plan ARGS=--fit`: what fits at a topology, by searching the plain plan's own budget
(fsdp_recipes.planning.memory_budget.budget) over one setting at a time. Each answer comes with the next step past
it, which does not fit, so it can be checked against the plain plan's table by hand.

The budget grows with tokens per micro-batch (batch x max_length) and shrinks with the shard group, so a bisection
finds each boundary: the largest per-device batch at the recipe's max_length, the longest max_length at the recipe's
batch, whether activation checkpointing is what makes it fit, and, for a recipe that does not fit, the smallest
topology that does (more GPUs shrink the sharded states; under HSDP only the shard group inside a node does).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from fsdp_recipes.planning.memory_budget import GIB, ModelShape, Setup, budget

BATCH_LIMIT = 1 << 14  # searched up to; an answer at the limit says so
LENGTH_LIMIT = 1 << 21


def total(m: ModelShape, s: Setup) -> int:
    return budget(m, s)["total"]


def largest(fits: Callable[[int], bool], limit: int) -> int:
    """The largest n in [1, limit] with fits(n), for a fits that holds up to a point and then never again; 0 when
    fits(1) fails."""
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:  # fits(lo), not fits(hi) (or hi past the limit)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def smallest(fits: Callable[[int], bool], limit: int) -> int | None:
    """The smallest n in [1, limit] with fits(n), for a fits that, once true, stays true; None when none does."""
    if not fits(limit):
        return None
    lo, hi = 0, limit  # not fits(lo) (or lo = 0), fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi


@dataclasses.dataclass
class Answer:
    what: str
    value: int | None
    fits_bytes: int | None  # the budget at the answer
    next_bytes: int | None  # at one step past it (None: the search's limit)
    note: str = ""


def batch(m: ModelShape, s: Setup, max_length: int, usable: float, sequences: int = 1, note: str = "",
          sampled_per_row: int = 0) -> Answer:
    """`sequences`: a row's sequences (a DPO pair is 2, as the plain plan counts its tokens); `note`: where the
    answer stands (default: at max_length); `sampled_per_row`: completions the policy's generate holds at once per
    row of the batch (GRPO's steps_per_generation; 0: its KV cache is not the batch's, or there is none)."""
    def at(b: int) -> int:
        sampled = {"generated_sequences": b * sampled_per_row} if sampled_per_row else {}
        return total(m, dataclasses.replace(s, tokens=b * max_length * sequences, **sampled))

    b = largest(lambda n: at(n) <= usable, BATCH_LIMIT)
    return Answer("per_device_train_batch_size", b, at(b) if b else None,
                  at(b + 1) if b < BATCH_LIMIT else None, note or f"at max_length {max_length:,}")


def length(m: ModelShape, s: Setup, batch_size: int, usable: float, model_limit: int | None,
           sequences: int = 1) -> Answer:
    limit = model_limit or LENGTH_LIMIT
    at = lambda n: total(m, dataclasses.replace(s, tokens=batch_size * n * sequences))  # noqa: E731
    n = largest(lambda k: at(k) <= usable, limit)
    note = f"at per_device_train_batch_size {batch_size}"
    if n == limit:
        note += f"; the model's own limit (max_position_embeddings {limit:,}) fits"
    return Answer("max_length", n, at(n) if n else None, at(n + 1) if n < limit else None, note)


def checkpointing(m: ModelShape, s: Setup, usable: float) -> str:
    off = total(m, dataclasses.replace(s, checkpointed=False))
    on = total(m, dataclasses.replace(s, checkpointed=True, checkpoint_every=1, checkpoint_ops=False))  # full
    if off <= usable:
        verdict = "not needed"
    elif on <= usable:
        verdict = "needed"
    else:
        verdict = "not enough on its own"
    return f"activation checkpointing: {verdict} (off: {off / GIB:,.2f} GiB; on: {on / GIB:,.2f} GiB per GPU)"


def smallest_fsdp_world(m: ModelShape, s: Setup, usable: float, limit: int) -> int | None:
    """The fewest GPUs a one-dimensional FSDP over all of them needs. With the recipe's mesh kept (tp x cp above
    1), a multiple of tp x cp, from tp x cp itself: FSDP shards over the world / tp (dp_shard x cp)."""
    step = s.tp * s.cp

    def fits(k: int) -> bool:
        return total(m, dataclasses.replace(s, shard=k * step // s.tp, strategy="FSDP", world=k * step)) <= usable

    k = smallest(fits, limit // step)
    return k * step if k else None


def smallest_shard(m: ModelShape, s: Setup, usable: float, per_node: int) -> int | None:
    """HSDP: the smallest shard group (GPUs per node) that fits; more nodes add replicas, not memory."""
    return smallest(lambda n: total(m, dataclasses.replace(s, shard=n)) <= usable, per_node)
