"""`make plan RECIPE=<name or folder> GPUS=8 NODES=1 GPU=H100 ARGS="..."`: will the recipe fit, and the questions
that follow. A preflight that launches nothing.

    fsdp-recipes plan <recipe> --gpus 8 --nodes 1 --gpu H100 [--fit] [--comms] [--scale 1,4,64]
        [--time [--rows N] [--tokens-per-row T]] [--network ndr | --network-gbps G] [--mfu 0.4] [--<field> value ...]

1. Reads the recipe as the run does: the launcher's recipe lookup (a name or a folder), and every argument the
   planner does not know is an override of the recipe, parsed and range-checked by the run's own code
   (run_config.parse_args, value_checks), so an override the run would reject is the same one line here.
2. Validates the recipe as the launcher does (accelerate YAML, recipe YAML, wrap class and LoRA targets on a
   meta-device model) plus the topology: the world size covers the HSDP groups, a shard group stays inside
   one node, the GPU supports the recipe's dtype.
3. Prints the global batch (per-device batch x accumulation x data-parallel size) and the per-GPU memory
   budget (fsdp_recipes.planning.memory_budget) under the recipe's own strategy and under DDP.
4. States the decision rule: fits under DDP -> DDP; one node -> FSDP; several nodes -> HSDP.
5. On request (answers.py): what fits (fit.py), communication per step (comms.py, fabric.py), how long (duration.py).
6. Exits 1 with one line when the recipe does not fit (estimate above 90% of the GPU's memory; the rest is
   left for fragmentation), 2 for a configuration mistake, 0 when it fits.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import warnings
from pathlib import Path

from fsdp_recipes import speed
from fsdp_recipes.assets.tiny_assets import ensure_assets
from fsdp_recipes.config import (
    accelerate_yaml,
    mesh,
    model_check,
    model_found,
    recipes,
    run_config,
    value_checks,
    yaml_keys,
)
from fsdp_recipes.errors import UserError, cli
from fsdp_recipes.planning import answers, checkpointing, comms, fabric, memory_budget, mesh_lines
from fsdp_recipes.planning.memory_budget import GIB
from fsdp_recipes.train import kinds

# name -> (memory in GiB as the driver reports it, bf16 support); matched like flops.PEAK_BF16_DENSE_FLOPS.
GPUS = {
    "H100": (79.6, True), "H100-PCIE": (79.6, True), "H100-NVL": (93.1, True), "H200": (139.8, True),
    "GH200": (94.5, True), "B200": (178.4, True), "A100": (79.2, True), "A100-40GB": (39.4, True),
    "L40S": (44.4, True), "A10G": (22.1, True), "L4": (22.1, True), "V100": (31.7, False), "T4": (14.6, False),
}
HEADROOM = 0.9
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "auto": 2}


def gpu_spec(name: str) -> tuple[str, float, bool]:
    key = name.upper().replace(" ", "-")
    if key not in GPUS:
        raise UserError(f"unknown GPU '{name}'. Fix: GPU=<one of {', '.join(GPUS)}>.")
    return (key, *GPUS[key])


def load_recipe(name: str | recipes.Recipe, recipes_root: Path | None = None, overrides: list[str] | tuple = (),
                world_size: int | None = None):
    """(recipe dir, accelerate dict, parsed recipe args, model) with the launcher's checks applied. `name`: a recipe's
    name or folder, or the recipe the launcher loaded (config/recipes.py Recipe, with the run's overrides: not read
    again). `overrides`: the run's command-line overrides (`make finetune ARGS=...`), parsed and checked by the run's
    own code (run_config.parse_args, value_checks), so one the run would reject is the same one line here.
    `world_size`: the planned job's processes (default: the recipe's accelerate num_processes), which the trainer
    config's own layout checks see as the ranks would."""
    if isinstance(name, recipes.Recipe):
        loaded = dataclasses.replace(name, overrides=[*name.overrides, *overrides, "--use_cpu", "true"])
    else:
        loaded = recipes.load(str(recipes_root / name) if recipes_root else name, [*overrides, "--use_cpu", "true"])
    recipe, acc = loaded.folder, loaded.accelerate
    accelerate_yaml.check_accelerate_keys(loaded.accelerate_path, acc)
    speed.check_accelerate(acc, loaded.accelerate_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # use_cpu: the bf16 setting is validated against the named GPU below, not this machine
        world = world_size if world_size is not None else int(acc.get("num_processes", 1) or 1)
        cfg = run_config.parse_args(loaded.argv(), loaded.raw, world_size=world)
        # what run_checks.check_before_launch checks without this machine's GPUs or the model's files
        speed.check_config(cfg, installed=False)  # the packages: the training machine's, not this one's
        value_checks.check_values(cfg)
    if cfg.pack.tiny_assets:  # as run_checks.parse_and_check does: the tiny model is built locally, offline

        ensure_assets(quiet=True)
    model_args = cfg.model
    source = model_found.model_config_source(model_args.model_name_or_path, recipe)
    if source is None and (cfg.pack.continues_from or cfg.pack.smollm2_assets) and (
            recipe / "model_config.json").is_file():
        # another run's output (the SFT model a DPO recipe trains on) has its base model's architecture, which the
        # recipe ships, and so has the default's model before its first launch prepares it: the plan needs neither
        source = recipe / "model_config.json"
    if source is None:
        if model_found.looks_local(model_args.model_name_or_path):  # the launcher's line: no folder, an adapter
            model_found.check_local_model(model_args.model_name_or_path, cfg.pack.continues_from)
        raise UserError(f"recipe {recipe.name}: the config of {model_args.model_name_or_path} is not available offline. "
                        "Fix: save the model's config.json as model_config.json in the recipe folder.")
    model = model_check.meta_model(model_check.load_config(source))
    model_check.check_recipe_fits_model(model, acc, recipe / "accelerate.yaml", model_args,
                                        wrap_on_command_line=bool(loaded.launch_options),
                                        model_named=loaded.user_model is not None)
    return recipe, acc, cfg, model


def strategy_of(acc: dict, gpus: int, nodes: int) -> tuple[str, int]:
    """(strategy, shard-group size) the recipe's accelerate YAML gives on this topology."""
    world = gpus * nodes
    kind = acc.get("distributed_type")
    fsdp = acc.get("fsdp_config") or {}
    if kind == "NO":
        if world != 1:
            raise UserError(f"this recipe runs a single process (distributed_type: NO) but {world} GPUs were asked for. "
                            "Fix: GPUS=1 NODES=1.")
        return "single", 1
    if kind == "MULTI_GPU":
        return "DDP", 1
    sizes = accelerate_yaml.hsdp_sizes(acc)
    if sizes or str(fsdp.get("fsdp_sharding_strategy", "")).upper() == "HYBRID_SHARD":
        if nodes < 2:
            raise UserError("this recipe is HSDP (shard within a node, replicate across nodes) but NODES=1. "
                            "Fix: NODES=2 or more, or use a single-node FSDP recipe.")
        shard = sizes[1] if sizes else gpus
        if shard > gpus or gpus % shard:
            raise UserError(f"the HSDP shard group of {shard} GPUs does not fit inside a node of {gpus}. "
                            f"Fix: GPUS={shard} or set parallelism_config_dp_shard_size to a divisor of {gpus}.")
        return "HSDP", shard
    return "FSDP", world


# accelerate's FSDP1 strategies by name and by their 1-based number (FSDP_SHARDING_STRATEGY), and FSDP2's false
# spellings (str_to_bool): those that keep the gathered parameters from forward to backward (ZeRO-2 and unsharded)
KEEPS_GATHERED = {"SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD_ZERO2", "2", "3", "5",
                  "FALSE", "NO", "N", "OFF", "F", "0"}


def reshards_after_forward(acc: dict) -> bool:
    """False where the gathered parameters stay from forward to backward: FSDP2's fsdp_reshard_after_forward false
    (or a strategy name that keeps them), FSDP1's fsdp_sharding_strategy SHARD_GRAD_OP, NO_SHARD or
    HYBRID_SHARD_ZERO2, by name or number."""
    fsdp = acc.get("fsdp_config") or {}
    value = fsdp.get("fsdp_reshard_after_forward", fsdp.get("fsdp_sharding_strategy", True))
    if isinstance(value, bool):
        return value
    return str(value).strip().upper() not in KEEPS_GATHERED


def model_shape(model, model_args) -> memory_budget.ModelShape:
    """The planner's ModelShape of a meta-device model: its counts with the recipe's LoRA, and what the speed options
    decide (the 4-bit weights)."""
    return memory_budget.shape_of(model, model_args, **speed.planner_shape(model, model_args))


def mesh_split(acc: dict, world: int) -> tuple[int, int]:
    """(tp, cp) of the recipe's mesh (config/mesh.py), and a world they and dp_replicate divide: FSDP then shards
    over the rest, dp_shard x cp (accelerate's dp_shard_cp), so the planned GPU count sets dp_shard."""
    m = mesh.mesh_of(acc, "accelerate.yaml")
    if m is None or m.tp == m.cp == 1:
        return 1, 1
    if world % (m.dp_replicate * m.tp * m.cp):
        raise UserError(f"the recipe's mesh (tp {m.tp}, cp {m.cp}, dp_replicate {m.dp_replicate}) does not divide "
                        f"{world} GPUs. Fix: a GPU count that is a multiple of {m.dp_replicate * m.tp * m.cp}.")
    return m.tp, m.cp


def check_planned_mesh(acc: dict, path: Path, world: int, model_config, cfg) -> None:
    """config/mesh.py's checks as the launcher runs them (launch/checks.py), so a mesh the launcher refuses is its
    one line here: on the planned world, whose GPU count sets dp_shard (mesh_split), and on GPUs (the planned ones,
    whatever this machine has)."""
    m = mesh.mesh_of(acc, path)
    if m is None or world % (m.dp_replicate * m.tp * m.cp):
        return  # plain FSDP; or a world the mesh does not divide, which mesh_split names
    dp_shard = world // (m.dp_replicate * m.tp * m.cp)
    sizes = dict(acc["parallelism_config"], **{f"{mesh.PREFIX}dp_shard_size": dp_shard})
    planned = mesh.check_mesh(dict(acc, parallelism_config=sizes), path, world)
    mesh.check_mesh_fits(planned, path, getattr(model_config, "num_attention_heads", None),
                         getattr(model_config, "num_key_value_heads", None),
                         getattr(cfg.training, "max_length", None), cfg, on_gpus=True)


def setups(acc, training, model_args, gpus: int, nodes: int, on_cpu: bool = False,
           trainer: str = kinds.DEFAULT, generation: dict | None = None, cfg=None) -> dict[str, memory_budget.Setup]:
    """`cfg`: the parsed recipe, for the Setup fields the speed options decide from their own settings."""
    strategy, shard = strategy_of(acc, gpus, nodes)
    tp, cp = mesh_split(acc, gpus * nodes) if strategy in ("FSDP", "HSDP") else (1, 1)
    if tp * cp > 1:  # the FSDP group: the world over the replicas and the tp groups
        shard = gpus * nodes // (accelerate_yaml.hsdp_sizes(acc) or (1, 1))[0] // tp
    mixed = acc.get("mixed_precision", "no") in ("bf16", "fp16") or training.bf16 or training.fp16
    load = DTYPE_BYTES.get(str(model_args.dtype or "float32").replace("torch.", ""), 4)
    optim = next((v for k, v in memory_budget.OPTIMIZER_BYTES.items() if str(training.optim).startswith(k)), 8)
    kind = kinds.load(trainer)  # DPO: each pair is two sequences, and there is a reference model (memory_budget.py)
    common = dict(
        world=gpus * nodes, load_bytes=load, compute_bytes=2 if mixed else load, mixed_precision=mixed,
        tokens=training.per_device_train_batch_size * kind.sequence_length(training) * kind.SEQUENCES_PER_ROW,
        reference=("adapter" if model_args.use_peft else "copy") if "reference" in kind.extra_forwards(training) else "none",
        optimizer_bytes=optim,
        runtime_bytes=0 if on_cpu else 2 * GIB, reshard_after_forward=reshards_after_forward(acc),
        **(generation or {}), **speed.planner_setup(model_args, training, cfg),
    )
    out = {strategy: memory_budget.Setup(shard=shard, strategy=strategy, tp=tp, cp=cp, **common)}
    if strategy != "DDP":
        out["DDP"] = memory_budget.Setup(shard=1, strategy="DDP", **common)
    return out


def gib(n: int) -> str:
    return f"{n / GIB:,.1f}"


def table(budgets: dict[str, dict[str, int]], capacity: float) -> str:
    names = list(budgets)
    rows = [f"| component | {' | '.join(f'{n} (GiB/GPU)' for n in names)} |", "|---|" + "---:|" * len(names)]
    for part in next(iter(budgets.values())):
        cells = [gib(budgets[n].get(part, 0)) for n in names]  # a part only one layout has (a mesh's ring)
        label = part.replace("_", " ")
        rows.append(f"| {'**total**' if part == 'total' else label} | " + " | ".join(
            f"**{c}**" if part == "total" else c for c in cells) + " |")
    rows.append(f"| usable ({HEADROOM:.0%} of {capacity:.1f} GiB) | " + " | ".join(
        f"{capacity * HEADROOM:.1f}" for _ in names) + " |")
    return "\n".join(rows)


def decide(budgets: dict, nodes: int, usable: float) -> str:
    if budgets["DDP"]["total"] <= usable:
        return "DDP (the whole model, gradients and optimizer states fit one GPU: no sharding needed)"
    return "FSDP, sharded over the node" if nodes == 1 else "HSDP: shard within each node, replicate across nodes"


@dataclasses.dataclass
class Planned:
    """Everything one plan computes, for the report and the --fit/--comms/--time sections."""

    recipe: Path
    acc: dict
    cfg: run_config.RunConfig
    model: object
    shape: memory_budget.ModelShape
    runs: dict[str, memory_budget.Setup]
    budgets: dict[str, dict[str, int]]
    own: str
    gpu: str
    capacity: float  # GiB
    gpus: int
    nodes: int
    checkpointing: checkpointing.Choice | None = None

    @property
    def usable(self) -> float:
        return self.capacity * HEADROOM * GIB

    @property
    def fits(self) -> bool:
        return self.budgets[self.own]["total"] <= self.usable

    @property
    def setup(self) -> memory_budget.Setup:
        return self.runs[self.own]


def prepare(name: str | recipes.Recipe, gpus: int, nodes: int, gpu: str, recipes_root: Path | None = None,
            overrides: list[str] | tuple = (), capacity_gib: float | None = None) -> Planned:
    """`capacity_gib`: the GPU's memory as measured (the launcher's nvidia-smi), `gpu` then only its name."""
    if gpus < 1 or nodes < 1:
        raise UserError(f"GPUS={gpus} NODES={nodes}: both must be at least 1. Fix: the GPUs of a node and the nodes "
                        f"to plan for, e.g. GPUS=8 NODES=1 (fsdp-recipes plan: --gpus 8 --nodes 1).")
    gpu_key, capacity, bf16_ok = gpu_spec(gpu) if capacity_gib is None else (gpu, capacity_gib, True)
    recipe, acc, cfg, model = load_recipe(name, recipes_root, overrides, world_size=gpus * nodes)
    training, model_args = cfg.training, cfg.model
    if (training.bf16 or acc.get("mixed_precision") == "bf16" or model_args.dtype == "bfloat16") and not bf16_ok:
        raise UserError(f"recipe {recipe.name} trains in bf16, which the {gpu_key} does not support. "
                        "Fix: use an Ampere or newer GPU (A100, H100, ...), or set dtype/bf16 for fp16.")
    check_planned_mesh(acc, recipe / "accelerate.yaml", gpus * nodes, model.config, cfg)
    m = model_shape(model, model_args)
    speed.check_model_config(cfg, model.config)  # a setting against the model (YaRN against its trained length)
    runs = setups(acc, training, model_args, gpus, nodes, trainer=cfg.trainer,
                  generation=kinds.load(cfg.trainer).generation_setup(cfg, capacity), cfg=cfg)
    own = next(iter(runs))
    # activation checkpointing: each policy planned; the recipe's pin or the fastest that fits (checkpointing.py)
    choice = checkpointing.choose(cfg, m, runs[own], capacity * GIB, HEADROOM)
    runs = {k: checkpointing.setup_for(choice, s) for k, s in runs.items()}
    budgets = {k: memory_budget.budget(m, s) for k, s in runs.items()}
    return Planned(recipe, acc, cfg, model, m, runs, budgets, own, gpu_key, capacity, gpus, nodes, choice)


def plan(name: str, gpus: int, nodes: int, gpu: str, recipes_root: Path | None = None,
         overrides: list[str] | tuple = ()) -> tuple[str, bool, tuple]:
    """(the report, whether it fits, (strategy, total bytes per GPU, GPU memory in GiB))."""
    p = prepare(name, gpus, nodes, gpu, recipes_root, overrides)
    return report(p), p.fits, (p.own, p.budgets[p.own]["total"], p.capacity)


def report(p: Planned) -> str:
    training, model_args, pack, m = p.cfg.training, p.cfg.model, p.cfg.pack, p.shape
    gpus, nodes, own = p.gpus, p.nodes, p.own
    dp = mesh.data_parallel_size(gpus * nodes, p.setup)  # a mesh's tp and cp ranks share their rows
    global_batch = training.per_device_train_batch_size * training.gradient_accumulation_steps * dp
    params, active, trainable = answers.counts(m)
    lines = [
        f"recipe {p.recipe.name}: {type(p.model).__name__}, {params} parameters, " + (
            f"{active} active per token ({m.top_k} of {m.experts} experts: FLOPs and MFU count these; "
            "memory all), " if m.experts else "") +
        f"{trainable} trainable ({'LoRA' if model_args.use_peft else 'full fine-tuning'})",
        mesh_lines.header(p) if mesh_lines.Split.of(p.setup).meshed else
        f"topology {nodes} node(s) x {gpus} {p.gpu} ({p.capacity:.1f} GiB each); recipe strategy {own}, "
        f"parameters sharded over {p.runs[own].shard} GPU(s)",
        f"global batch {training.per_device_train_batch_size} per GPU x {training.gradient_accumulation_steps} "
        f"accumulation x {dp} data-parallel = {global_batch} "
        f"{kinds.load(p.cfg.trainer).ROWS} of up to "
        f"{kinds.load(p.cfg.trainer).sequence_length(training)} tokens",
        "",
        table(p.budgets, p.capacity),
        "",
        f"decision rule (fits under DDP -> DDP; one node -> FSDP; several nodes -> HSDP): "
        f"{mesh_lines.decision(p) if mesh_lines.Split.of(p.setup).meshed else decide(p.budgets, nodes, p.usable)}",
    ]
    s = p.runs[own]
    if s.tp * s.cp > 1:
        lines.append(f"mesh: tp {s.tp} x cp {s.cp}, FSDP over dp_shard x cp = {s.shard}: weights, gradients and "
                     f"optimizer states divided by tp x dp_shard x cp = {s.tp * s.shard}; each GPU holds 1/{s.cp} of a "
                     f"row's tokens ({s.local_tokens:,.0f}) and 1/{s.tp} of each layer's heads")
    if p.checkpointing:
        lines.append(checkpointing.line(p.checkpointing))
    lines += speed.planner_notes(p.cfg, p.model.config) + answers.context_warnings(p)
    host = memory_budget.host_bytes(m, s)
    if host:
        lines.append(f"host memory: {gib(host)} GiB pinned per GPU ({gib(host * gpus)} GiB per node of {gpus}): "
                     "the offloaded checkpoint inputs, not in the GPU table above")
    if "reference_model" in p.budgets[own]:
        ref = p.budgets[own]["reference_model"]
        lines.append(f"reference model ({p.cfg.trainer}): " + (
            "the base with the LoRA adapter disabled, no copy: 0 GiB/GPU" if model_args.use_peft else
            f"a second copy of the weights, sharded like the policy, no gradients or optimizer state: {gib(ref)} "
            f"GiB/GPU ({100 * ref / p.budgets[own]['total']:.0f}% of the total)"))
    budget = p.budgets[own]
    if p.runs[own].generation == "none" and kinds.load(p.cfg.trainer).samples(training):  # vLLM in server mode
        lines.append(f"generation ({p.cfg.trainer}): vLLM in server mode, on GPUs of its own (trl vllm-serve): not "
                     "counted on the training GPUs above")
    if "vllm_engine" in budget or "generation_kv_cache" in budget:
        s = p.runs[own]
        kv = memory_budget.budget(m, dataclasses.replace(s, generation="generate"))["generation_kv_cache"]
        lines.append(f"generation ({p.cfg.trainer}): " + (
            f"assumed vLLM in colocate mode, {training.vllm_gpu_memory_utilization:.0%} of each GPU: "
            f"{gib(budget['vllm_engine'])} GiB/GPU; without vLLM the policy's generate holds a KV cache of "
            f"{gib(kv)} GiB/GPU instead" if s.generation == "vllm" else
            f"the policy's generate: a KV cache of {s.generated_sequences} completions x "
            f"{s.generation_tokens:,} tokens, {gib(kv)} GiB/GPU"))
    if gpus * nodes < pack.min_gpus:  # the launcher's guard; the memory figures above are the real answer
        lines.append(f"note: the recipe declares min_gpus {pack.min_gpus}; its launcher refuses fewer "
                     f"(--min_gpus {gpus * nodes} overrides that)")
    if p.fits:
        lines.append(f"fits: {gib(p.budgets[own]['total'])} GiB of {p.capacity * HEADROOM:.1f} GiB usable per GPU")
    lines += gate_lines(pack, p.budgets[own]["total"] / GIB, p.capacity)
    return "\n".join(lines)


def gate_lines(pack, total_gib: float, capacity_gib: float) -> list[str]:
    """The recipe's acceptance gates beside the estimate (metrics/gates.py judges them at the end of the run). The
    memory gate's limit is said in GiB and named as the gate's, beside the plan's estimate: a share of the GPU's
    whole memory (the run's peak reserved / device total), not of the usable budget the "fits" line compares with."""
    gates = []
    if pack.mfu_min is not None:
        gates.append(f"MFU >= {100 * pack.mfu_min:g}% (mfu_min)")
    if pack.peak_memory_max_fraction is not None:
        limit = pack.peak_memory_max_fraction * capacity_gib
        side = "under it" if total_gib <= limit else "over it: the run would fail this gate"
        gates.append(f"peak memory <= {100 * pack.peak_memory_max_fraction:g}% of the GPU (peak_memory_max_fraction: "
                     f"the gate's limit {limit:,.1f} GiB of {capacity_gib:.1f}; this estimate: {total_gib:,.1f} GiB, "
                     f"{100 * total_gib / capacity_gib:.0f}%, {side})")
    if not gates:
        return []
    return [f"gates: {', '.join(gates)}" + ("; warn only (gates_warn_only)" if pack.gates_warn_only else
                                             "; a failed gate exits 3")]


def budget_markdown(name: str, recipes_root: Path, gpu: str = "H100", overrides: list[str] | tuple = ()) -> str:
    """The README table for a recipe's own hardware: its accelerate.yaml's GPUs and nodes, on `gpu` (its `gpu:` in
    accelerate_configs/recipes.yaml), with `overrides` (its `plan_args:`, shown as make plan's ARGS).
    scripts/sync_recipes.py puts it between markers."""
    recipe = recipes_root / name
    acc = yaml_keys.load_yaml(recipe / "accelerate.yaml")
    nodes = int(acc.get("num_machines", 1))
    gpus = max(int(acc.get("num_processes", 1)) // nodes, 1)
    report, fits, _ = plan(name, gpus, nodes, gpu, recipes_root, overrides)
    cmd = f"make plan RECIPE={name} GPUS={gpus} NODES={nodes} GPU={gpu}"
    if overrides:
        cmd += f' ARGS="{" ".join(map(str, overrides))}"'
    return f"```\n$ {cmd}\n{report}\n```\n"


def node_list(text: str) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise UserError(f"--scale {text}: expected node counts such as 1,4,64. Fix: --scale 1,4,64")
    return counts


@cli
def main(argv: list[str] | None = None) -> int:
    # allow_abbrev off: every word the planner does not know is the run's (`make finetune ARGS=...`), parsed by
    # run_config.parse_args as the run parses it, so a mistake there is the run's own one line.
    ap = argparse.ArgumentParser(prog="fsdp-recipes plan", description=__doc__, allow_abbrev=False,
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Any other --field value overrides the recipe, as in make finetune ARGS=.")
    ap.add_argument("recipe", help="a recipe name under recipes/ or a recipe folder")
    ap.add_argument("--gpus", type=int, default=8, help="GPUs per node")
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--gpu", default="H100", help=f"one of {', '.join(GPUS)}")
    ap.add_argument("--fit", action="store_true", help="largest batch, longest max_length, checkpointing, topology")
    ap.add_argument("--comms", action="store_true", help="bytes per collective per step, link, time, verdict")
    ap.add_argument("--scale", metavar="N,N,..", help="communication at these node counts (e.g. 1,4,64)")
    ap.add_argument("--time", action="store_true", help="steps, tokens and wall-clock time of the run")
    ap.add_argument("--rows", type=int, help="--time: dataset rows (default: counted when the dataset is local)")
    ap.add_argument("--tokens-per-row", type=float, help="--time: mean tokens per row")
    ap.add_argument("--network", help=f"between nodes: one of {', '.join(fabric.NETWORKS)} "
                                      f"(default {fabric.DEFAULT_NETWORK})")
    ap.add_argument("--network-gbps", type=float, help="between nodes: Gb/s per GPU, instead of --network")
    ap.add_argument("--mfu", type=float, default=comms.DEFAULT_MFU, help="assumed model FLOPs utilisation")
    args, overrides = ap.parse_known_args(argv)
    if not 0 < args.mfu <= 1:
        raise UserError(f"--mfu {args.mfu}: it must be in (0, 1]. Fix: e.g. --mfu 0.4")
    if args.rows is not None and args.rows < 1 or args.tokens_per_row is not None and args.tokens_per_row <= 0:
        raise UserError("--rows and --tokens-per-row must be positive. Fix: e.g. --rows 200000 --tokens-per-row 1200")
    scale = node_list(args.scale) if args.scale else None
    net = fabric.fabric(gpu_spec(args.gpu)[0], args.network, args.network_gbps)  # bad names before the slow part
    p = prepare(args.recipe, args.gpus, args.nodes, args.gpu, overrides=overrides)
    print(report(p))
    if args.fit:
        print("\n" + answers.fit_section(p))
    if args.comms:
        print("\n" + answers.comms_section(p, net, args.mfu)[0])
    if scale:
        print("\n" + answers.scale_section(p, net, args.mfu, scale))
    if args.time:
        print("\n" + answers.time_section(p, net, args.mfu, args.rows, args.tokens_per_row))
    if not p.fits:
        total = p.budgets[p.own]["total"]
        print(f"error: recipe {p.recipe.name} does not fit: {gib(total)} GiB per GPU under {p.own}, "
              f"{p.capacity * HEADROOM:.1f} GiB usable on a {p.gpu}. Fix: more GPUs or nodes, "
              "activation_checkpointing, a smaller per_device_train_batch_size or max_length, or LoRA.", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
