"""How a room's registry builds a member from its module: the speed options (speed/), the evaluation metrics
(evaluation/scores/) and the cluster launchers (cluster/registry.py). The room's interface is a frozen dataclass whose
fields are the members a module provides; those without a default are required. A module lacking one, or holding a
value where the interface has a function, fails when the registry is built, with a message naming it, not in the
middle of a run. (train/kinds/ and data/formats/ have members of their own kind: a kind may take its members from a
module it shares with, a format depends on the layout it converts to.)"""

from __future__ import annotations

import dataclasses
from types import ModuleType

NOT_MEMBERS = ("name", "module")  # the fields the registry fills: the member's name and its module


def required_members(interface: type) -> list[str]:
    return [f.name for f in dataclasses.fields(interface) if f.name not in NOT_MEMBERS
            and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]


def register(registry: dict, interface: type, name: str, module: ModuleType):
    """`module` checked as the room's own members are (`interface.from_module`) and added to `registry` by `name`."""
    registry[name] = interface.from_module(name, module)
    return registry[name]


def members_of(interface: type, module: ModuleType, what: str, name: str, where: str) -> dict:
    """The interface's members that `module` defines, checked: `what` names the room's kind of member ("speed
    option") in the messages, `where` the file that defines the interface."""
    required = required_members(interface)
    missing = [member for member in required if not hasattr(module, member)]
    if missing:
        raise TypeError(f"{what} {name} ({module.__name__}) lacks {', '.join(missing)}: every {what.split()[-1]} "
                        f"provides {', '.join(required)} ({where})")
    fields = [f for f in dataclasses.fields(interface) if f.name not in NOT_MEMBERS and hasattr(module, f.name)]
    members = {f.name: getattr(module, f.name) for f in fields}
    not_functions = [f.name for f in fields if "Callable" in str(f.type) and not callable(members[f.name])]
    if not_functions:
        raise TypeError(f"{what} {name} ({module.__name__}): {', '.join(not_functions)} must be "
                        f"{'a function' if len(not_functions) == 1 else 'functions'} ({where})")
    return members
