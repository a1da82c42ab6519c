"""How the pack replaces a private function of torch, accelerate, PEFT or transformers.

Every such patch fills a named upstream gap and was written against one signature. `target` looks the function
up and refuses, with one line naming the patch and the fix, when it is gone or its parameters changed: a silently
mismatched patch would do something else than what its docstring says. `record` lists what was applied, for
run_args.json (`patches_applied`).
"""

from __future__ import annotations

import inspect

from fsdp_recipes.errors import UserError

APPLIED: list[dict] = []  # in this process, in the order applied


class PatchTargetChanged(UserError):
    """The library function a patch replaces is missing or has another signature than the one it was written for."""


def target(owner, name: str, params: tuple[str, ...], *, patch: str, checked_on: str):
    """`owner.name`, provided its parameters are exactly `params`."""
    where = f"{getattr(owner, '__module__', '')}.{getattr(owner, '__qualname__', getattr(owner, '__name__', owner))}"
    fix = (f"Fix: install the versions it was checked on ({checked_on}), or update the patch in "
           f"fsdp_recipes/patches/ to the new code")
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
