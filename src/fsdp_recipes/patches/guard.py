"""How the pack replaces a private function of torch, accelerate, PEFT or transformers.

Every such patch fills a named upstream gap and was written against one signature and checked on a range of
releases (versions.py). `target` looks the function up and refuses, with one line naming the patch and the fix,
when an installed library is outside that range, or the function is gone or its parameters changed: a silently
mismatched patch would do something else than what its docstring says. `record` lists what was applied, for
run_args.json (`patches_applied`).
"""

from __future__ import annotations

import inspect

from fsdp_recipes.errors import UserError
from fsdp_recipes.patches.versions import outside

APPLIED: list[dict] = []  # in this process, in the order applied


class PatchTargetChanged(UserError):
    """The library function a patch replaces is missing or has another signature than the one it was written for."""


def target(owner, name: str, params: tuple[str, ...], *, patch: str, checked_on: dict[str, str]):
    """`owner.name`, provided every installed library of `checked_on` ({"torch": ">=2.11,<2.16"}, from
    versions.checked_on) is in its range and the function's parameters are exactly `params`."""
    where = f"{getattr(owner, '__module__', '')}.{getattr(owner, '__qualname__', getattr(owner, '__name__', owner))}"
    ranges = ", ".join(f"{lib}{spec}" for lib, spec in checked_on.items())
    fix = (f"Fix: install the versions it was checked on ({ranges}), or update the patch in "
           f"fsdp_recipes/patches/ to the new code")
    unchecked = outside(checked_on)
    if unchecked:
        raise PatchTargetChanged(f"patch {patch}: {', '.join(unchecked)} is outside the versions it was checked on "
                                 f"({ranges}). Fix: install those, or run make test-compat with {unchecked[0]} and "
                                 f"widen fsdp_recipes/patches/versions.py and pyproject.toml together")
    fn = getattr(owner, name, None)
    if fn is None:
        raise PatchTargetChanged(f"patch {patch}: {where}.{name} no longer exists. {fix}")
    got = tuple(inspect.signature(fn).parameters)
    if got != params:
        raise PatchTargetChanged(f"patch {patch}: {where}.{name} now takes {got}, the patch was written for "
                                 f"{params}. {fix}")
    return fn


def record(patch: str, replaces: str, gap: str) -> None:
    if not any(p["patch"] == patch for p in APPLIED):
        APPLIED.append({"patch": patch, "replaces": replaces, "gap": gap})
