"""A job: one recipe on NODES x GPUS, what every cluster launcher renders (cluster/registry.py).

The recipe's facts (its sharding, its minimum GPU count, its grace period) are read once here, and the node and GPU
counts are checked against them the same way for every launcher: a count the recipe's sharding cannot use is one
line before anything is written.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path
from signal import Signals

from fsdp_recipes import speed
from fsdp_recipes.config import recipes
from fsdp_recipes.config.preemption import grace_seconds
from fsdp_recipes.errors import UserError


@dataclasses.dataclass(frozen=True)
class RecipeFacts:
    """What a launcher needs from a recipe's two YAML files."""

    name: str
    trainer: str
    distributed_type: str
    fsdp_version: int
    sharding: str
    dp_replicate: int
    dp_shard: int | None
    min_gpus: int
    grace_s: int  # the recipe's preemption_grace_s: the ranks' save
    num_processes: int = 1  # its accelerate.yaml's: what a min_gpus 0 (CPU) recipe runs, one per GPU up to it on GPUs

    @property
    def hsdp(self) -> bool:
        """Hybrid sharding: shard inside a node, replicate across nodes (FSDP1 HYBRID_SHARD or FSDP2 dp_replicate)."""
        return self.distributed_type == "FSDP" and ("HYBRID" in self.sharding.upper() or self.dp_replicate > 1)


def recipe_facts(folder: Path) -> RecipeFacts:
    loaded = recipes.load(folder)
    acc = loaded.accelerate
    speed.check_accelerate(acc, loaded.accelerate_path)  # the YAML's rules a job would meet at launch
    fsdp = acc.get("fsdp_config") or {}
    par = acc.get("parallelism_config") or {}
    return RecipeFacts(
        name=folder.name,
        trainer=loaded.trainer,
        distributed_type=str(acc.get("distributed_type", "NO")),
        fsdp_version=int(fsdp.get("fsdp_version", 1)),
        sharding=str(fsdp.get("fsdp_sharding_strategy", "FULL_SHARD")),
        dp_replicate=int(par.get("parallelism_config_dp_replicate_size", 1)),
        dp_shard=int(par.get("parallelism_config_dp_shard_size", 0)) or None,
        min_gpus=loaded.early.min_gpus,
        grace_s=grace_seconds(loaded),
        num_processes=int(acc.get("num_processes", 1)),
    )


@dataclasses.dataclass(frozen=True)
class Job:
    """A recipe on `nodes` x `gpus` (per node), as one launcher will run it: the signal its scheduler sends to
    preempt and the seconds it allows before killing (`grace_s`, from the launcher's `grace_seconds`)."""

    recipe: RecipeFacts
    folder: Path  # as given: a name under recipes/ resolves to recipes/<name>
    nodes: int
    gpus: int
    launcher: str
    signal: Signals
    grace_s: int
    launch_extra: tuple[str, ...] = ()  # `accelerate launch` options this node count needs (the HSDP replicas)
    options: argparse.Namespace = dataclasses.field(default_factory=argparse.Namespace)  # the launcher's own flags

    @property
    def name(self) -> str:
        return self.recipe.name

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus

    def launch_args(self, machine_rank: str = "0", main_process_ip: str = "localhost",
                    main_process_port: str = "29500") -> str:
        """FSDP_RECIPES_LAUNCH_ARGS for one node of this job: the extra `accelerate launch` options with which the
        recipe's launch.sh learns its place (launch/launcher.py). A node's own values may be its scheduler's
        variables ("$SKYPILOT_NODE_RANK"), expanded by the shell on the node; k8s/entrypoint.sh and
        slurm/common.sh build the same options in the pod or the job step."""
        if self.nodes == 1:
            args = ["--num_processes", str(self.gpus)]
        else:
            args = ["--num_machines", str(self.nodes), "--machine_rank", machine_rank, "--main_process_ip",
                    main_process_ip, "--main_process_port", main_process_port, "--num_processes",
                    str(self.world_size), "--rdzv_backend", "c10d"]
        return " ".join([*args, *self.launch_extra])

    @property
    def command(self) -> str:
        """The command that regenerates this job, for the files' headers."""
        return f"fsdp-recipes job --launcher {self.launcher} {self.name} --nodes {self.nodes} --gpus {self.gpus}"


# how each scheduler's files ask for the GPUs (the local launcher's is a process count on this machine)
GPU_REQUEST = {"k8s": "nvidia.com/gpu: {gpus} per pod", "slurm": "--gpus-per-node={gpus}"}


def cpu_recipe_note(job: Job) -> str | None:
    """One line for a CPU recipe (min_gpus 0) made into a GPU job: what the files ask for, and what the run uses of
    it (the launcher puts one process per GPU, up to the accelerate.yaml's count: config/placement.py); None for a
    GPU recipe or the local launcher."""
    facts = job.recipe
    if facts.min_gpus > 0 or job.launcher not in GPU_REQUEST:
        return None
    n = facts.num_processes
    return (f"note: {facts.name} is a CPU recipe (min_gpus 0, {n} process(es) in its accelerate.yaml); these files "
            f"ask for {job.nodes} node(s) x {job.gpus} GPU(s) ({GPU_REQUEST[job.launcher].format(gpus=job.gpus)}), "
            f"and the launcher runs one process per GPU there, up to {n}"
            + (f": GPUS={n} asks for what it uses" if job.gpus > n else ""))


def check_topology(facts: RecipeFacts, nodes: int, gpus: int) -> tuple[str, ...]:
    """Refuse node/GPU counts the recipe's sharding cannot use; return extra `accelerate launch` options."""
    name, total = facts.name, nodes * gpus
    if nodes < 1 or gpus < 1:
        raise UserError(
            f"NODES and GPUS must be at least 1 (got NODES={nodes} GPUS={gpus}). "
            "Fix: --nodes 1 --gpus 8 (make: NODES=1 GPUS=8)."
        )
    if facts.distributed_type == "NO" and total > 1:
        raise UserError(
            f"recipe {name} runs one process (distributed_type: NO) and cannot use {nodes} node(s) x {gpus} GPU(s). "
            "Fix: NODES=1 GPUS=1."
        )
    if total < facts.min_gpus:
        raise UserError(
            f"recipe {name} needs at least {facts.min_gpus} GPUs and NODES={nodes} x GPUS={gpus} gives {total}. "
            f"Fix: raise NODES or GPUS so that NODES*GPUS >= {facts.min_gpus}."
        )
    if not facts.hsdp:
        return ()
    if nodes < 2:
        raise UserError(
            f"recipe {name} uses hybrid sharding (HSDP: shard inside a node, replicate across nodes) and needs "
            f"NODES >= 2, got NODES={nodes}. Fix: NODES=2 (or a FULL_SHARD recipe for one node)."
        )
    shard = facts.dp_shard
    if shard is None:  # FSDP1 HYBRID_SHARD: torch makes each node one shard group
        return ()
    if gpus % shard:
        raise UserError(
            f"recipe {name} shards the model over groups of {shard} GPUs (parallelism_config_dp_shard_size), which "
            f"must fit whole inside a node of {gpus} GPUs so sharding traffic stays on NVLink. "
            f"Fix: GPUS={shard} or a multiple of it."
        )
    # The recipe's replicate size was written for its own node count; this many nodes needs total/shard replicas.
    return ("--parallelism_config_dp_replicate_size", str(total // shard))


def slug(recipe: str) -> str:
    """A DNS label from the recipe name: dots and capitals are not allowed in pod and service names."""
    return re.sub(r"[^a-z0-9-]+", "-", recipe.lower()).strip("-")[:63].rstrip("-")
