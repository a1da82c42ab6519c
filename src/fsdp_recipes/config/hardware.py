"""What the machine has: GPU counts (torch-free where the launcher needs speed), the job's node count from
torchrun's environment, the recipe's min_gpus check, and the one-line GPU inventory for the run's log.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
from pathlib import Path

from fsdp_recipes.errors import UserError


# /proc/cpuinfo's names for bf16 arithmetic in hardware: AVX-512 BF16 (AMD Zen 4+, Intel Cooper Lake+) and AMX
# (Intel Sapphire Rapids+). Without them torch emulates bf16 matmuls, slower than float32.
CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_bf16_flags(cpuinfo: str | None = None) -> list[str]:
    """Which of CPU_BF16_FLAGS this CPU has ([] where /proc/cpuinfo is missing: macOS, or unreadable)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return []
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), [])
    return [f for f in CPU_BF16_FLAGS if f in flags]


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0



def bf16_supported() -> bool:
    """The visible GPUs compute in bf16 (compute capability 8.0+: A100, H100, ...; not V100 or T4)."""
    import torch

    return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)


def gpu_count_hint() -> int | None:
    """The GPUs this process may see, without importing torch (2-3 s): the ids in CUDA_VISIBLE_DEVICES when it is
    set, else the `GPU n:` lines of `nvidia-smi -L`, else 0; None when nvidia-smi fails, or is missing where the
    driver's /dev/nvidia<N> files exist. An upper bound (CUDA stops
    at the first invalid id): the launcher starts the ranks on it and counts with torch while they import."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip()])
    smi = shutil.which("nvidia-smi")
    if smi is None:
        # A container can have the driver's device files without nvidia-smi (NVIDIA_DRIVER_CAPABILITIES=compute):
        # then only torch can tell
        return None if glob.glob("/dev/nvidia[0-9]*") else 0
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return sum(line.startswith("GPU ") for line in out.splitlines())



def gpus_per_node(min_gpus: int, nodes: int) -> int:
    """min_gpus counts the whole job; each of its `nodes` needs its share (rounded up)."""
    return -(-min_gpus // max(nodes, 1))



def smoke_command(recipe: str, folder: Path | None = None) -> str:
    """How to smoke-test the recipe from here: `make smoke` in this repository (a folder under ./recipes beside a
    Makefile), else the folder's own launch.sh (a recipe copied elsewhere, which make cannot find by its name)."""
    if folder is None or (Path("Makefile").is_file() and Path(folder).absolute() == Path("recipes", recipe).absolute()):
        return f"make smoke RECIPE={recipe}"
    return f"FSDP_RECIPES_SMOKE=1 {Path(folder) / 'launch.sh'}"


def check_gpus(min_gpus: int, recipe: str, nodes: int = 1, folder: Path | None = None) -> None:
    """`folder`: the recipe's, for the smoke command the fix names (smoke_command)."""
    per_node = gpus_per_node(min_gpus, nodes)
    if per_node <= 0:  # a CPU recipe: no need to import torch to count
        return
    found = gpu_count()
    if per_node > found:
        need = f"{per_node} GPU(s)" + (f" per node (min_gpus {min_gpus} over {nodes} nodes)" if nodes > 1 else "")
        raise UserError(
            f"recipe {recipe} needs {need} and this machine has {found}. Fix: run it on a GPU node, or "
            f"test it on CPU with `{smoke_command(recipe, folder)}` (a tiny model of the same architecture, 2 "
            "processes)."
        )



def job_nodes() -> int:
    """Nodes of the job this rank belongs to (torchrun's WORLD_SIZE / LOCAL_WORLD_SIZE); 1 outside a launch."""
    return max(1, int(os.environ.get("WORLD_SIZE", 1)) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1))))



def nvidia_smi(*args: str) -> str | None:
    """nvidia-smi's output, or None when it is missing or fails."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        res = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout if res.returncode == 0 else None


def nvlink_summary(status: str | None) -> str:
    """One line from `nvidia-smi nvlink --status` (per GPU, a "GPU i: ..." line and one "Link j: <speed>" line
    per link, "<inactive>" when down): how many links each GPU has up, at what speed."""
    if not status:
        return "NVLink: not reported (nvidia-smi nvlink --status gave nothing)"
    up, speeds = [], set()
    for line in status.splitlines():
        line = line.strip()
        if line.startswith("GPU "):
            up.append(0)
        elif line.startswith("Link ") and up:
            value = line.split(":", 1)[1].strip()
            if value and "inactive" not in value.lower():
                up[-1] += 1
                speeds.add(value)
    if not up or not any(up):
        return f"NVLink: none active on {len(up)} GPU(s) (PCIe only)"
    counts = sorted(set(up))
    per_gpu = f"{counts[0]} links up on each" if len(counts) == 1 else f"{min(up)}-{max(up)} links up per GPU"
    return f"NVLink: {len(up)} GPUs, {per_gpu} ({', '.join(sorted(speeds))} per link)"


def gpu_inventory() -> str:
    """The GPUs, one line each, and one NVLink line; where nvidia-smi exists."""
    listing = nvidia_smi("--query-gpu=index,name,memory.total,driver_version", "--format=csv,noheader")
    if listing is None:
        return "GPUs: none (no nvidia-smi on PATH, or it failed); running on CPU"
    lines = [f"GPU {row.strip()}" for row in listing.strip().splitlines() if row.strip()]
    return "\n".join(lines + [nvlink_summary(nvidia_smi("nvlink", "--status"))])


def gpu_capabilities() -> list[tuple[int, int]] | None:
    """Compute capabilities of the GPUs this job may use, from nvidia-smi, so that a speed option the GPU cannot run
    is one line before any rank starts, without importing torch. None where nvidia-smi is missing or cannot say
    (drivers before 510 have no compute_cap field): the options' checks in each rank, with torch, decide then."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    cmd = [smi, "--query-gpu=compute_cap", "--format=csv,noheader"]
    if os.environ.get("CUDA_VISIBLE_DEVICES"):
        cmd += ["-i", os.environ["CUDA_VISIBLE_DEVICES"]]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
        caps = [tuple(int(x) for x in line.strip().split(".")) for line in out.stdout.splitlines() if line.strip()]
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    return caps if out.returncode == 0 and caps and all(len(c) == 2 for c in caps) else None
