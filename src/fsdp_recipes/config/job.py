"""The job a launcher is one node of: the `accelerate launch` options a cluster wrapper passes
(FSDP_RECIPES_LAUNCH_ARGS: "--num_machines 2 --machine_rank 1 --main_process_ip node1 ..."), its machines and
processes, which node this is (the grace period: config/preemption.py). Read here only: the launcher and the summary ask."""

from __future__ import annotations

import os
import shlex

from fsdp_recipes.config.argv import override


def launch_args() -> list[str]:
    return shlex.split(os.environ.get("FSDP_RECIPES_LAUNCH_ARGS", ""))


def job_machines(acc: dict) -> int:
    return int(override(launch_args(), "num_machines", acc.get("num_machines", 1)))


def job_processes(acc: dict) -> int:
    return int(override(launch_args(), "num_processes", acc.get("num_processes", 1)))


def machine_rank() -> str:
    return str(override(launch_args(), "machine_rank", "0"))


def first_node() -> bool:
    return machine_rank() == "0"

