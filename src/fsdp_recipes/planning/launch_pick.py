"""What the launcher asks the planner: activation checkpointing's `auto` resolved for the GPUs of this machine, by
the plan `make plan` makes (plan.prepare), over the recipe the launcher loaded (not read again)."""

from __future__ import annotations

from fsdp_recipes.config import hardware
from fsdp_recipes.config.recipes import Recipe
from fsdp_recipes.errors import UserError
from fsdp_recipes.planning import plan
from fsdp_recipes.planning.memory_budget import GIB


def gpu_memory_gib() -> float | None:
    """The smallest GPU here, in GiB as the driver reports it (nvidia-smi's MiB / 1024, as plan.GPUS lists them)."""
    out = hardware.nvidia_smi("--query-gpu=memory.total", "--format=csv,noheader,nounits")
    sizes = [float(line) for line in (out or "").split() if line.replace(".", "", 1).isdigit()]
    return min(sizes) / 1024 if sizes else None


def checkpointing_pick(recipe: Recipe, gpus: int) -> tuple[str, str]:
    """The launcher's `auto`: (the policy, why) for the recipe as the ranks will run it on `gpus` GPUs per node of
    this machine's kind, planned as `make plan` plans, with its overrides and the measured memory."""
    capacity = gpu_memory_gib()
    if capacity is None:
        return "full", "nvidia-smi reported no GPU memory to plan against: TRL's default"
    nodes = int(recipe.accelerate.get("num_machines", 1) or 1)
    try:
        planned = plan.prepare(recipe, gpus, nodes, "GPU", capacity_gib=capacity)
    except UserError as err:
        return "full", f"the planner could not plan this recipe ({err}): TRL's default"
    choice = planned.checkpointing
    total = choice.totals[choice.pick]
    limit = f"{choice.limit / GIB:,.1f} GiB per GPU ({choice.limit_source})"
    return choice.pick, (f"the fastest that fits: {total / GIB:,.1f} of {limit} on {gpus} x {capacity:,.1f} GiB"
                         if total <= choice.limit else f"none fits {limit}; the least memory, {total / GIB:,.1f} GiB")
