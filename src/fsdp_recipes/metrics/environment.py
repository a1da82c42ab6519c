"""Where and with what a run ran: library versions, git commit, launcher (Slurm/Kubernetes) environment,
accelerate's settings, the device and the sharding. Recorded in run_args.json and metrics.json.
"""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

from fsdp_recipes import dist

PACKAGES = ("torch", "transformers", "trl", "peft", "accelerate", "datasets")



def versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for name in PACKAGES + ("fsdp-recipes",):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    if out.get("torch"):
        import torch

        # PyPI's CUDA wheels carry no build tag in their metadata (2.15.0); torch's own version names it (+cu132)
        out["torch"] = torch.__version__
    return out



def git_commit(cwd: Path | None = None) -> str | None:
    for where in (cwd, Path(__file__).resolve().parent):
        try:
            out = subprocess.run(
                ["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, timeout=5
            )
        except (OSError, subprocess.SubprocessError):
            return None
        if out.returncode == 0:
            return out.stdout.strip()
    return None



def launcher_env() -> dict:
    """What torchrun / accelerate launch told this process about the job."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    slurm_job_id, slurm_restart_count = dist.slurm_job() or (None, None)  # a requeue finds its own run (output_dir.py)
    return {
        "world_size": world,
        "num_nodes": max(1, world // max(1, local_world)),
        "local_world_size": local_world,
        "rank": dist.rank(),
        "local_rank": int(os.environ.get("LOCAL_RANK", 0)),
        "master_addr": os.environ.get("MASTER_ADDR"),
        "master_port": os.environ.get("MASTER_PORT"),
        "slurm_job_id": slurm_job_id,
        "slurm_restart_count": slurm_restart_count,
    }



def accelerate_env() -> dict[str, str]:
    """The accelerate/FSDP settings as `accelerate launch` exported them from the config file."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(("ACCELERATE_", "FSDP_"))}



def device_info() -> dict:
    import torch

    if torch.cuda.is_available():
        return {"type": "cuda", "name": torch.cuda.get_device_name(0), "count_per_node": torch.cuda.device_count()}
    name = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"type": "cpu", "name": name, "count_per_node": int(os.environ.get("LOCAL_WORLD_SIZE", 1))}



def mesh_info(parallelism_config=None) -> dict:
    """The device mesh accelerate built (its ParallelismConfig): each dimension's size, the axis names in the mesh's
    order (accelerate's dp_replicate, dp_shard, cp, sp, tp; only those above 1, as accelerate builds it), and how
    many ranks see the same rows (tp x cp x sp: the run report counts a row's tokens once per data-parallel rank,
    and MFU divides their FLOPs over every GPU of the mesh). Without one: a data-parallel world, every rank its own
    rows."""
    pc = parallelism_config
    if pc is None:
        from accelerate.state import AcceleratorState

        pc = getattr(AcceleratorState(), "parallelism_config", None) if AcceleratorState._shared_state else None
    if pc is None:
        return {"mesh": None, "ranks_per_row": 1}
    names, shape = pc._get_mesh() if pc.active_mesh_dims else ((), ())
    sizes = {"dp_replicate": pc.dp_replicate_size, "dp_shard": pc.dp_shard_size, "tp": pc.tp_size, "cp": pc.cp_size}
    return {"mesh": {**sizes, "axis_names": list(names), "shape": list(shape)},
            "ranks_per_row": pc.non_data_parallel_size}


def sharding_info() -> dict:
    """Sharding strategy, FSDP version and device mesh as accelerate resolved them (not as the YAML spelled them)."""
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    if not AcceleratorState._shared_state:  # no Accelerator yet (the run failed before the Trainer existed)
        return {"sharding_strategy": None, "fsdp_version": None, "mixed_precision": None, "mesh": None}
    state = AcceleratorState()
    pc = getattr(state, "parallelism_config", None)
    if pc is not None and getattr(pc, "tp_size", 1) > 1:  # sharded by transformers at load time, not by accelerate
        return {"sharding_strategy": f"TENSOR_PARALLEL (tp {pc.tp_size} x dp_shard {pc.dp_shard_size}, by "
                                     "transformers: train/tensor_parallel.py)",
                "fsdp_version": 2 if pc.dp_shard_size > 1 else None, "mixed_precision": str(state.mixed_precision),
                "mesh": mesh_info(pc)["mesh"]}
    if state.distributed_type != DistributedType.FSDP:
        kind = "DDP" if int(os.environ.get("WORLD_SIZE", 1)) > 1 else "NONE"
        return {"sharding_strategy": kind, "fsdp_version": None, "mixed_precision": str(state.mixed_precision),
                "mesh": None}
    plugin = state.fsdp_plugin
    if plugin.fsdp_version == 2:
        reshard = plugin.reshard_after_forward
        strategy = "FULL_SHARD" if reshard is True else "SHARD_GRAD_OP" if reshard is False else str(reshard)
        pc = getattr(state, "parallelism_config", None)
        if pc is not None and getattr(pc, "dp_replicate_size", 1) > 1:
            strategy = f"HYBRID_SHARD (replicate {pc.dp_replicate_size} x shard {pc.dp_shard_size})"
    else:
        strategy = getattr(plugin.sharding_strategy, "name", str(plugin.sharding_strategy))
    return {
        "sharding_strategy": strategy,
        "fsdp_version": plugin.fsdp_version,
        "mixed_precision": str(state.mixed_precision),
        "mesh": mesh_info()["mesh"],  # its sizes and axis names; MFU is over all world_size GPUs of it
    }
