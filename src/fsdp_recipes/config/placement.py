"""Where a run's processes go on this machine, decided before any rank starts.

- A recipe that runs anywhere (`min_gpus: 0`, the default) takes the GPUs there are: one process per visible GPU,
  at most its accelerate YAML's count (which is for CPUs: 2 processes); the same global batch (the per-device batch
  grows as the processes shrink, so the run learns from the same sequences per step); and bf16 mixed precision
  (float32 master weights, bf16 compute) where the recipe trains in float32 because a CPU has no bf16 units. Each
  change is printed, and the ranks receive it as an ordinary override, so run_args.json records it.
- Every recipe is refused, with one line, when it would start more GPU processes on a node than the node has GPUs
  (torch would stop each extra rank at `cuda:<local rank>`, "invalid device ordinal", a traceback per rank).
- FSDP_RECIPES_DEVICE=cpu hides the GPUs from the ranks (CUDA_VISIBLE_DEVICES=""): the CPU run on a GPU machine.

A cluster wrapper that passes --num_processes or --num_machines (slurm/, k8s/) has placed the job itself: then only
the refusal applies (no batch or bf16 change either). A recipe or command line with `use_cpu: true` is left on CPU.

On CPU, a recipe with `cpu_bf16: auto` (the default's) trains with bf16 autocast (float32 master weights, bf16
matmuls) where the CPU has bf16 arithmetic (AVX-512 BF16 or AMX), and in float32 as written where it has neither:
measured on the 2-core AMD EPYC VM (avx512_bf16), the default's 48 steps 1.51x faster than in float32 (95.9 s against
145.3 s, bench/README.md; cpu_precision below).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from fsdp_recipes.config import hardware
from fsdp_recipes.config.argv import given, override
from fsdp_recipes.errors import UserError

ENV = "FSDP_RECIPES_DEVICE"


def device_setting() -> str:
    """FSDP_RECIPES_DEVICE: auto (unset; the GPUs there are) or cpu."""
    value = os.environ.get(ENV, "").strip().lower() or "auto"
    if value not in ("auto", "cpu"):
        raise UserError(f"{ENV}={os.environ[ENV]!r} is not a device setting. Fix: {ENV}=cpu (run on CPU even where "
                        f"there are GPUs) or unset it (auto: the GPUs there are).")
    return value


def gpus_here() -> int:
    """The GPUs the ranks will see. torch counts them (2-3 s) unless nvidia-smi or CUDA_VISIBLE_DEVICES show none:
    the hint is an upper bound, and a CPU build of torch on a GPU machine sees none."""
    if device_setting() == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the ranks inherit it: torch sees no GPU, the CPU path runs
        return 0
    hint = hardware.gpu_count_hint()
    return 0 if hint == 0 else hardware.gpu_count()


@dataclass
class Placement:
    processes: int | None = None  # --num_processes for `accelerate launch`; None keeps the YAML's
    overrides: list[str] = field(default_factory=list)  # recipe fields changed for the GPUs, before the user's
    notes: list[str] = field(default_factory=list)


def on_gpus(acc: dict) -> bool:
    return acc.get("distributed_type", "NO") != "NO" and not acc.get("use_cpu")


def runs_on_cpu(raw: dict, acc: dict, gpus: int, overrides: list[str]) -> bool:
    """No GPU here, or the recipe or the command says use_cpu."""
    return gpus == 0 or bool(acc.get("use_cpu")) or truthy(override(overrides, "use_cpu", raw.get("use_cpu")))


# TrainingArguments' own default per_device_train_batch_size, which placement needs before the recipe is parsed (the
# launcher's light path imports no transformers); tests/test_placement.py holds it against transformers'.
TRAINER_DEFAULT_BATCH = 8


def place(recipe: str, raw: dict, acc: dict, gpus: int, overrides: list[str], launch_args: list[str],
          bf16_ok: bool = True) -> Placement:
    """`raw`: the recipe YAML as written; `overrides`: the user's; `gpus`: gpus_here(); `bf16_ok`: the GPUs compute
    in bf16 (compute capability 8.0+)."""
    if runs_on_cpu(raw, acc, gpus, overrides) or not on_gpus(acc):
        return Placement()  # the user's `--use_cpu true` keeps the run on CPU, as written
    launch_args = [underscored(a) for a in launch_args]  # accelerate takes --num-processes as --num_processes
    machines = int(override(launch_args, "num_machines", acc.get("num_machines", 1)))
    processes = int(override(launch_args, "num_processes", acc.get("num_processes", 1)))
    per_node = -(-processes // max(machines, 1))
    placed_by_wrapper = any(a.split("=")[0] in ("--num_processes", "--num_machines") for a in launch_args)
    # As the recipe is written: a GPU recipe whose min_gpus a command line (or `make smoke`) lowers is still placed
    # by its own YAML, and refused if that does not fit
    portable = int(raw.get("min_gpus", 0) or 0) == 0
    if not portable or placed_by_wrapper or machines > 1:
        if per_node > gpus:
            raise UserError(
                f"recipe {recipe} starts {per_node} GPU process(es) on this node, which has {gpus} GPU(s). Fix: run "
                f"it on a node with {per_node} GPUs, or set num_processes to {gpus} x nodes in its accelerate.yaml "
                f"(or FSDP_RECIPES_LAUNCH_ARGS=\"--num_processes {gpus}\"), or test it with `make smoke "
                f"RECIPE={recipe}`.")
        return Placement()

    placed = Placement(processes=min(processes, gpus))
    to_bf16 = changed_precision(raw, overrides, bf16_ok)
    if placed.processes == processes and not to_bf16:
        return Placement()
    changed = []
    batch = int(override(overrides, "per_device_train_batch_size",
                         raw.get("per_device_train_batch_size", TRAINER_DEFAULT_BATCH)))
    if placed.processes != processes and not given(overrides, "per_device_train_batch_size"):
        if batch * processes % placed.processes == 0:
            per_device = batch * processes // placed.processes
            placed.overrides += ["--per_device_train_batch_size", str(per_device)]
            changed.append(f"per_device_train_batch_size {batch} -> {per_device} (the same {batch * processes} "
                           f"sequences per step)")
        else:
            changed.append(f"per_device_train_batch_size stays {batch}: {batch * placed.processes} sequences per step "
                           f"instead of {batch * processes} (set it to keep the recipe's)")
    if to_bf16:
        placed.overrides += ["--bf16", "true"]
        changed.append("bf16 false -> true (mixed precision: float32 master weights, bf16 compute)")
    instead = f" instead of accelerate.yaml's {processes}" if placed.processes != processes else ""
    placed.notes.append(
        f"{gpus} GPU(s) here and recipe {recipe} runs anywhere (min_gpus 0): {placed.processes} process(es) on "
        f"GPUs{instead}" + "".join(f"; {c}" for c in changed) + f". {ENV}=cpu runs it on CPU as written")
    return placed


def truthy(value) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes")


def underscored(arg: str) -> str:
    """`--num-processes=2` -> `--num_processes=2`: accelerate accepts both spellings of its options."""
    if not arg.startswith("--"):
        return arg
    name, sep, value = arg.partition("=")
    return "--" + name[2:].replace("-", "_") + sep + value


def changed_precision(raw: dict, overrides: list[str], bf16_ok: bool) -> bool:
    return bf16_ok and not raw.get("bf16") and not raw.get("fp16") and not given(overrides, "bf16", "fp16")


CPU_BF16 = ("auto", "false")


def cpu_precision(recipe: str, raw: dict, overrides: list[str], flags: list[str], smoke: bool = False) -> Placement:
    """A run on CPU: bf16 autocast where the recipe asks for it (`cpu_bf16: auto`) and the CPU has `flags`
    (hardware.cpu_bf16_flags()); the line that says which, either way. The user's --bf16 wins; fp16 is refused (a smoke
    run, the plumbing only, is told).
    Why autocast and not bf16 weights: the same speed (one step of the default 2.36 s against 2.42 s, float32 4.18 s,
    in a probe while another job ran; bench/README.md), and the optimizer keeps float32 weights. TrainingArguments
    takes bf16 on a CPU only with use_cpu, which the ranks are on anyway."""
    if truthy(override(overrides, "fp16", raw.get("fp16", False))):
        # accelerate makes its GradScaler for GPUs only, while FSDP's MixedPrecisionPolicy still casts the parameters
        # to float16 (accelerate 1.15): tiny-cpu-lora's entropy came out in float16 steps, 2,411 tokens/s against
        # 3,563 in float32 on the Intel Xeon (AMX) VM, 2026-11-29
        if smoke:
            return Placement(notes=[f"recipe {recipe}: fp16 on this CPU computes in float16 without a loss scaler "
                                    "(accelerate's is for GPUs): this smoke run checks the plumbing, not the numbers"])
        raise UserError(f"recipe {recipe}: fp16 on a CPU computes in float16 with no loss scaler (accelerate keeps its "
                        "scaler for GPUs), so gradients below float16's range are lost. Fix: --fp16 false --bf16 true "
                        "(bf16 compute, float32 master weights, no scaler needed) or --fp16 false (float32)")
    setting = str(override(overrides, "cpu_bf16", raw.get("cpu_bf16", "false"))).strip().lower()
    if setting not in CPU_BF16:
        raise UserError(f"cpu_bf16 {setting!r} is not a setting. Fix: cpu_bf16: auto (bf16 autocast on a CPU with "
                        f"AVX-512 BF16 or AMX, float32 elsewhere) or false (float32 as written).")
    if setting == "false" or raw.get("bf16") or raw.get("fp16") or given(overrides, "bf16", "fp16"):
        return Placement()
    if not flags:
        return Placement(notes=[f"recipe {recipe}: float32 on this CPU (cpu_bf16: auto, but it has neither AVX-512 "
                                "BF16 nor AMX, so bf16 would be emulated and slower)"])
    return Placement(overrides=["--bf16", "true", "--use_cpu", "true"],
                     notes=[f"recipe {recipe}: bf16 autocast on this CPU ({', '.join(flags)}): bf16 matmuls, float32 "
                            "master weights (cpu_bf16: auto; --cpu_bf16 false trains in float32)"])
