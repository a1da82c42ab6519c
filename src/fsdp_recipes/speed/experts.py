"""`experts_implementation` (its own setting, `ExpertsArguments` in config/option_registry.py): how a
mixture-of-experts model computes its experts, transformers 5's `set_experts_implementation`.

transformers 5 stores an MoE layer's experts as stacked 3-D weights and computes them by a registered kernel:
`eager` (a Python loop over the experts that received tokens), `grouped_mm` (one grouped matrix multiply per
projection over the tokens sorted by expert: torch's `grouped_mm`, CUDA compute capability 8.0+; torch 2.11+ also
has a CPU kernel), `batched_mm` (each token's expert weights gathered, then one batched multiply: memory grows with
tokens x expert size, meant for small batches), and kernels from the hub (`deepgemm`, `sonicmoe`: CUDA only).

`auto`, the default, picks grouped_mm on CUDA 8.0+; eager on older CUDA (where transformers' grouped_mm would fall back
to its per-expert loop anyway, and batched_mm's gathered weights would not fit a real batch); on CPU, `CPU_CHOICE`
(all three run there in torch 2.13 and give the same loss; measured below). The choice is made in each rank, once the
device is known, and recorded in run_args.json (`speed_options.experts`: requested, ran, why) and on the console.
A dense model has no experts: auto leaves it alone, a named kernel is one line.

Measured 2026-11-28 on the 2-core CPU VM (torch 2.13.0+cpu, transformers 5.23.0; one thread, the machine shared,
load average 8): forward and backward of one Qwen3-MoE layer, hidden 256, 8 experts of 128, top-2, 2,048 tokens,
best of 5, two rounds: grouped_mm 154 and 169 ms, eager 202 and 247 ms, batched_mm 8.6 and 9.9 s (it gathers a
weight copy per token). tests/test_experts_speed.py holds the three to the same loss and gradients on a tiny
Qwen3-MoE with LoRA on its experts.

`expert_parallel_size` (its second setting): expert parallelism, each rank holding 1/N of a layer's experts and the
tokens sent to them by all-to-all. Refused above 1, in one line, because no release this pack allows trains it the
way the pack trains (checkpoints, preemption, exact resume). Tried 2026-11-29 on 2 gloo CPU processes (torch
2.13.0+cpu, transformers 5.23.0, accelerate 1.15.0), a tiny Qwen3-MoE:
- accelerate 1.15 (the newest release) has no expert dimension: its ParallelismConfig is dp_replicate x dp_shard x
  tp x cp (x sp), and its FSDP2 plugin shards each decoder layer whole, all experts together;
- transformers 5.23's own, `from_pretrained(distributed_config=DistributedConfig(fsdp_size=2, ep_size=2))`, loads
  the experts sharded on the expert dimension over an (efsdp, ep) mesh and TRAINS: 4 AdamW steps with the same
  losses, bit for bit, as `DistributedConfig(fsdp_size=2)` alone, 16 all-to-alls in the forwards (eager and
  grouped_mm alike). But the model is sharded at load time, outside accelerate, and transformers' Trainer then
  refuses any checkpoint with optimizer state: "ValueError: Resuming is not supported for models sharded at load
  time (`DistributedConfig`), so their optimizer state cannot be checkpointed. Pass `save_only_model=True` or
  `save_strategy='no'`." (transformers 5.23.0 and 5.24.0, the newest, alike). A run that cannot save its optimizer
  cannot be preempted and resumed, and the pack's FSDP2 path (accelerate's plugin, its sharded checkpoints and
  save checks) would not be the one training.
"""

from __future__ import annotations

from fsdp_recipes.errors import UserError

FIELDS = ("experts_implementation", "expert_parallel_size")
AUTO = "auto"
GROUPED_MIN_CAPABILITY = (8, 0)  # torch's grouped_mm on CUDA (transformers' _can_use_grouped_mm)
CPU_CHOICE = "grouped_mm"  # the fastest of the three on CPU (the docstring's measurement)
CUDA_ONLY = ("deepgemm", "sonicmoe")
KNOWN = (AUTO, "eager", "grouped_mm", "batched_mm", *CUDA_ONLY)  # transformers 5.23's kernels


def requested(cfg) -> str:
    return cfg.option("experts").experts_implementation


def enabled(cfg) -> bool:
    """Always: auto decides per device, and a MoE run records what ran (a dense model records nothing)."""
    return True


def choices() -> list[str]:
    """auto, and the kernels the installed transformers registers (eager is its built-in)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    return [AUTO, "eager", *sorted(ALL_EXPERTS_FUNCTIONS.keys())]


def check_config(cfg) -> None:
    ep = cfg.option("experts").expert_parallel_size
    if ep < 1:
        raise UserError(f"expert_parallel_size {ep}: must be 1 or more. Fix: expert_parallel_size: 1.")
    if ep > 1:
        raise UserError(f"expert_parallel_size {ep}: no release this pack allows trains expert parallelism resumably: "
                        "accelerate 1.15's FSDP2 has no expert mesh dimension, and transformers 5.23's "
                        f"DistributedConfig(ep_size={ep}) trains but its Trainer refuses to checkpoint the optimizer "
                        "of a model sharded at load time (\"Resuming is not supported for models sharded at load "
                        "time\"; 5.24 too). Fix: expert_parallel_size: 1 (FSDP2 shards the experts with their layer); "
                        "it waits for an accelerate with an expert dimension or a transformers Trainer that "
                        "checkpoints such a model.")
    value = requested(cfg)
    if value not in KNOWN and value not in choices():  # transformers imported only for a name the pack lacks
        raise UserError(f"experts_implementation: {value} is not one of transformers' experts kernels. Fix: use one "
                        f"of {', '.join(choices())} (auto picks per device).")


def smoke(field, gpus: int) -> tuple[list[str], str | None]:
    value = str(field("experts_implementation", AUTO))
    if value in CUDA_ONLY and not gpus:
        return ["--experts_implementation", AUTO], f"experts: {value} needs CUDA -> auto"
    return [], None


def resolve(value: str, device_type: str, capability: tuple[int, int] | None = None) -> tuple[str, str]:
    """(the kernel to run, why) for the requested value on this device."""
    if device_type == "cuda" and value == "grouped_mm" and capability and capability < GROUPED_MIN_CAPABILITY:
        raise UserError(f"experts_implementation: grouped_mm needs CUDA compute capability 8.0+; this GPU has "
                        f"{capability[0]}.{capability[1]} (transformers would run its per-expert loop instead). "
                        "Fix: experts_implementation: auto (eager here).")
    if value in CUDA_ONLY and device_type != "cuda":
        raise UserError(f"experts_implementation: {value} is a CUDA kernel and this run is on {device_type}. Fix: "
                        "experts_implementation: auto.")
    if value != AUTO:
        return value, "as the recipe says"
    if device_type == "cuda":
        cap = f"{capability[0]}.{capability[1]}" if capability else "unknown"
        if capability and capability >= GROUPED_MIN_CAPABILITY:
            return "grouped_mm", f"auto: CUDA compute capability {cap} >= 8.0"
        return "eager", f"auto: CUDA compute capability {cap} < 8.0, no grouped_mm kernel"
    if device_type == "cpu":
        return CPU_CHOICE, "auto: CPU (eager, grouped_mm and batched_mm all run; grouped_mm measured fastest)"
    return "eager", f"auto: {device_type}"


def has_experts(model) -> bool:
    """Some module of `model` computes experts through transformers' kernels (its class is decorated with
    use_experts_implementation, which gives it `_apply_gate`)."""
    modules = model.modules() if callable(getattr(model, "modules", None)) else ()
    return any(hasattr(type(m), "_apply_gate") and hasattr(m, "config") for m in modules)


def transformers_model(model):
    """The PreTrainedModel inside PEFT's wrapper, if any."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def prepare_trainer(trainer, cfg) -> dict | None:
    """Before accelerate wraps the model: the kernel set on the model, printed, and recorded (None for a dense
    model under auto)."""
    import torch

    value, model = requested(cfg), transformers_model(trainer.model)
    if not has_experts(model):
        if value != AUTO:
            raise UserError(f"experts_implementation: {value} is for mixture-of-experts models, and "
                            f"{type(model).__name__} has no experts. Fix: remove it (auto).")
        return None
    device = trainer.accelerator.device
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    kernel, why = resolve(value, device.type, capability)
    model.set_experts_implementation(kernel)
    ran = model.config._experts_implementation
    trainer.accelerator.print(f"[train] experts: {ran} ({why})")
    return {"requested": value, "ran": ran, "why": why}
