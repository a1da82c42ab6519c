"""Cluster launchers: one module each (local.py, slurm.py, k8s.py), one interface, and one registry, LAUNCHERS.

Every launcher runs the same thing on each node: the recipe's launch.sh (the pack's launcher), told its place in
the job through FSDP_RECIPES_LAUNCH_ARGS (extra `accelerate launch` options: --num_machines, --machine_rank, the
rendezvous). What differs is how a scheduler is asked to start it, and how it preempts it. A launcher module
provides (ClusterLauncher below checks it when the registry is built, at import, or when `register` adds one):
    DESCRIPTION                 one line for `fsdp-recipes job --help`
    SIGNAL                      the signal its scheduler sends to preempt a job: one the ranks save on
                                (config/preemption.py SIGNALS)
    grace_seconds(grace_s)      the seconds it allows between that signal and its kill, for a recipe whose ranks
                                save within grace_s (its preemption_grace_s)
    render(job)                 file name -> text: what is submitted (cluster/job.py Job: the recipe's facts,
                                nodes x GPUs, the signal and grace above, the launcher's own options, and
                                launch_args(), each node's FSDP_RECIPES_LAUNCH_ARGS)
    submit_command(job, out)    the command that submits the files rendered into the folder `out`
    OUTPUT_DIR                  where the files go without --out (<OUTPUT_DIR>/<recipe>/)
Optional, with the defaults of ClusterLauncher: add_arguments(parser) (its own flags, in job.options) and
check(job) (what it refuses, in one line, before anything is written).

Adding a launcher: that module and its name in NAMES (docs/architecture.md, "Adding a cluster launcher").
"""

from __future__ import annotations

import dataclasses
import importlib
import signal
from collections.abc import Callable
from types import ModuleType

from fsdp_recipes.config.preemption import SIGNALS
from fsdp_recipes import registry as pack_registry
from fsdp_recipes.registry import members_of

NAMES = ("local", "slurm", "k8s")  # modules of this folder


def _no_arguments(parser) -> None:
    return None


def _no_check(job) -> None:
    return None


@dataclasses.dataclass(frozen=True)
class ClusterLauncher:
    """What `fsdp-recipes job` asks of a launcher. Built from the launcher's module by `from_module`: a missing
    member, or a preemption signal the ranks would not save on, fails there, not when a job is rendered."""

    name: str
    DESCRIPTION: str
    SIGNAL: signal.Signals
    grace_seconds: Callable
    render: Callable
    submit_command: Callable
    OUTPUT_DIR: str
    add_arguments: Callable = _no_arguments
    check: Callable = _no_check
    module: ModuleType | None = None

    @classmethod
    def from_module(cls, name: str, module: ModuleType) -> ClusterLauncher:
        members = members_of(cls, module, "cluster launcher", name, "fsdp_recipes/cluster/registry.py")
        if members["SIGNAL"] not in SIGNALS:
            raise TypeError(f"cluster launcher {name} ({module.__name__}) preempts with {members['SIGNAL']!r}, which "
                            f"the ranks do not save on: use one of {', '.join(s.name for s in SIGNALS)} "
                            f"(fsdp_recipes/config/preemption.py)")
        return cls(name=name, module=module, **members)


LAUNCHERS: dict[str, ClusterLauncher] = {
    name: ClusterLauncher.from_module(name, importlib.import_module(f"fsdp_recipes.cluster.{name}")) for name in NAMES
}


def register(name: str, module: ModuleType) -> ClusterLauncher:
    """Add a launcher that lives outside this folder (a site's own scheduler): checked as the built-in ones are."""
    return pack_registry.register(LAUNCHERS, ClusterLauncher, name, module)


def load(name: str) -> ClusterLauncher:
    return LAUNCHERS[name]


def names() -> tuple[str, ...]:
    return tuple(LAUNCHERS)
