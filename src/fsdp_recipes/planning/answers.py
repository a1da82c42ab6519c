"""The sections `make plan` adds on request: --fit (fit.py), --comms and --scale (comms.py), --time (duration.py).
Each takes the plain plan's result (plan.Planned) and prints its arithmetic next to its answer."""

from __future__ import annotations

import dataclasses

from fsdp_recipes.config import accelerate_yaml
from fsdp_recipes.errors import UserError
from fsdp_recipes.planning import comms, duration, fit, mesh_fit
from fsdp_recipes.planning.fabric import Fabric
from fsdp_recipes.planning.memory_budget import GIB, budget

NODE_GPUS = 8  # GPUs of an HGX/DGX board: the node size a topology answer uses when GPUS names fewer


def gib(n: float) -> str:
    return f"{n / GIB:,.2f}"


def boundary(a: fit.Answer, usable: float) -> str:
    if not a.value:
        return f"{a.what}: none fits ({a.note}: 1 needs {gib(a.next_bytes or 0)} GiB)"
    past = (f"; {a.value + 1:,} does not ({a.next_bytes:,} B = {gib(a.next_bytes)} GiB > {usable:,.0f} B)"
            if a.next_bytes is not None else "")  # None: the search stopped at its limit, which the note names
    return f"{a.what}: {a.value:,} fits ({a.fits_bytes:,} B = {gib(a.fits_bytes)} GiB){past}; {a.note}"


def fit_section(p) -> str:
    t, s, m, usable = p.cfg.training, p.setup, p.shape, p.usable
    limit = getattr(p.model.config, "max_position_embeddings", None)
    lines = [f"fit at {p.nodes} node(s) x {p.gpus} {p.gpu}, usable {usable:,.0f} B = {gib(usable)} GiB per GPU "
             f"({p.own}; each answer is the plain plan's total, and one step past it does not fit):",
             "  " + boundary(fit.batch(m, s, t.max_length or 1024, usable), usable),
             "  " + boundary(fit.length(m, s, t.per_device_train_batch_size, usable, limit), usable),
             "  " + fit.checkpointing(m, s, usable)]
    kept = f" (the recipe's tp {s.tp} x cp {s.cp} kept)" if s.tp * s.cp > 1 else ""
    lines += ["  " + line + kept for line in topology_answer(p)]
    lines += ["  " + line for line in mesh_answer(p)]
    return "\n".join(lines)


def mesh_answer(p) -> list[str]:
    """A mesh (tp, cp) where FSDP over the node does not fit, or the recipe has one (mesh_fit.py)."""
    m, s, usable = p.shape, p.setup, p.usable
    if p.fits and s.tp * s.cp == 1:
        return [f"mesh: none needed (FSDP over {p.gpus} fits)"]
    config = p.model.config
    flat = dataclasses.replace(s, tp=1, cp=1)
    alone = fit.smallest_fsdp_world(m, dataclasses.replace(flat, strategy="FSDP"), usable, p.gpus * 1024)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    max_length = p.cfg.training.max_length or 1024

    def launchable(world: int, tp: int, cp: int) -> bool:  # only meshes the launcher starts (config/mesh.py)
        return mesh_fit.refusal(p.acc, p.cfg, world, tp, cp, heads, kv_heads, max_length) is None

    a = mesh_fit.propose(m, flat, usable, p.gpus, heads, kv_heads, max_length, launchable=launchable)
    versus = f"FSDP alone needs {alone} GPUs" if alone else "FSDP alone fits no GPU count (a row's activations)"
    if a is None:
        return [f"mesh: none the launcher starts fits up to 128 nodes of {p.gpus} ({versus})"]
    lines = [f"mesh: {a.describe()}; {versus}", f"  accelerate.yaml: {mesh_fit.accelerate_keys(a)}"]
    if a.cp > 1:
        lines.append(f"  recipe: {mesh_fit.recipe_keys(p.cfg.training, a.cp)} (context parallel splits whole "
                     "padded rows)")
    return lines


def topology_answer(p) -> list[str]:
    """The smallest topology that fits, for the recipe's strategy."""
    m, s, usable = p.shape, p.setup, p.usable
    if p.own == "HSDP":
        shard = fit.smallest_shard(m, s, usable, p.gpus)
        if shard is None:
            world = fit.smallest_fsdp_world(m, s, usable, p.gpus * 1024)
            alt = f"; one-dimensional FSDP over {world} GPUs would (see --comms)" if world else ""
            return [f"smallest topology: no node count fits under HSDP (per-GPU memory is set by the shard group, "
                    f"at most the {p.gpus} GPUs of a node; more nodes add replicas, not memory){alt}"]
        return [f"smallest topology: NODES=2 GPUS={shard} (HSDP: a shard group of {shard} in each node, "
                "replicated over the nodes; HSDP needs 2 nodes or more)"]
    if p.own in ("DDP", "single"):
        if p.fits:
            return [f"smallest topology: {p.own} holds a whole copy per GPU: any GPU count fits"]
        world = fit.smallest_fsdp_world(m, s, usable, p.gpus * 1024)
        alt = f"; FSDP over {world} GPUs would" if world else ""
        return [f"smallest topology: none under {p.own}: every GPU holds the whole model, whatever the count{alt}"]
    node = max(p.gpus, NODE_GPUS)  # GPUS names this node; a bigger answer is stated in nodes of the usual board
    world = fit.smallest_fsdp_world(m, s, usable, node * 1024)
    if world is None:
        return [f"smallest topology: none up to {node * 1024} GPUs"]
    if world == 1:
        try:  # FSDP1 + LoRA on one process cannot save checkpoints: the launcher refuses it
            accelerate_yaml.check_fsdp_with_peft(p.acc, p.cfg.model.use_peft, p.recipe / "accelerate.yaml", 1)
        except UserError:
            return ["smallest topology: GPUS=2 NODES=1 (1 GPU holds it, but the launcher refuses FSDP1 "
                    "LoRA on one process: see docs/training.md)"]
        return ["smallest topology: GPUS=1 NODES=1"]
    step = s.tp * s.cp  # a mesh's world is a multiple of tp x cp (fit.smallest_fsdp_world)
    if world <= node and world == step:
        return [f"smallest topology: GPUS={world} NODES=1 (the fewest the recipe's mesh runs on)"]
    if world <= node:
        fewer = world - step
        less = fit.total(m, dataclasses.replace(s, shard=fewer // s.tp, world=fewer))
        return [f"smallest topology: GPUS={world} NODES=1 (FSDP over {world}; {fewer} would need {gib(less)} GiB)"]
    nodes = -(-world // node)
    return [f"smallest topology: {world} GPUs: NODES={nodes} GPUS={node} (one-dimensional FSDP across nodes: "
            "see --comms for what that costs, and HSDP's memory for the alternative)"]


def topology(p, nodes: int | None = None, strategy: str | None = None) -> comms.Topology:
    fsdp = p.acc.get("fsdp_config") or {}
    nodes = nodes or p.nodes
    strategy = strategy or p.own
    tp, cp = (p.setup.tp, p.setup.cp) if strategy == p.own else (1, 1)
    shard = {"FSDP": p.gpus * nodes // tp, "HSDP": p.setup.shard}.get(strategy, 1)
    reshard = fsdp.get("fsdp_reshard_after_forward", True)
    if str(fsdp.get("fsdp_sharding_strategy", "")).upper() == "SHARD_GRAD_OP":  # FSDP1's ZeRO-2
        reshard = False
    return comms.Topology(strategy, p.gpus, nodes, shard, int(fsdp.get("fsdp_version", 1)), bool(reshard), tp, cp)


def work(p, mfu: float) -> comms.Work:
    t, s = p.cfg.training, p.setup
    master = 4 if s.mixed_precision else s.load_bytes
    # FSDP under accelerate's bf16 policy reduces in bf16 (param_dtype = reduce_dtype); DDP in the gradients' dtype
    reduce = s.compute_bytes if p.own in ("FSDP", "HSDP") and s.mixed_precision else master
    return comms.Work(t.gradient_accumulation_steps, t.per_device_train_batch_size, t.max_length or 1024,
                      s.compute_bytes, reduce, mfu, recompute=s.checkpointed,
                      attention_saved=s.checkpointed and s.checkpoint_ops)


def comms_section(p, f: Fabric, mfu: float) -> tuple[str, comms.Estimate]:
    if f.node is None:
        raise UserError(f"no interconnect figures for the {f.gpu} (its GPU-to-GPU links depend on the system). "
                        f"Fix: plan with a GPU of fsdp_recipes/planning/fabric.py's table, or add the {f.gpu} there.")
    t, w = topology(p), work(p, mfu)
    e = comms.estimate(p.shape, t, w, f)
    gather = f"all-gather at {w.gather_bytes} B/parameter, " if p.own in ("FSDP", "HSDP") else ""
    group = f"shard group {t.shard}" if p.own in ("FSDP", "HSDP") else "no sharding"
    lines = [f"communication per optimizer step, per GPU: {p.own}, {group}, {t.nodes} node(s) x {t.gpus}; "
             f"{w.accumulation} micro-batch(es) of {w.micro_batch} x {w.max_length:,} tokens; {gather}gradients "
             f"reduced at {w.reduce_bytes} B",
             "", comms.table(e), "",
             f"network between nodes: {f.network} = {f.network_gbps:g} GB/s per GPU per direction"
             + ("" if t.nodes > 1 else " (unused on one node)")]
    lines += compute_lines(e, w, f, mfu)
    lines += [f"warning: {x}" for x in e.warnings]
    return "\n".join(lines), e


def compute_lines(e: comms.Estimate, w: comms.Work, f: Fabric, mfu: float) -> list[str]:
    if e.compute_s is None:
        return [f"compute: no dense bf16 peak for the {f.gpu}, so no time and no verdict"]
    return [
        f"compute: {w.tokens:,} tokens x {e.flops_per_token / 1e9:,.2f} GFLOP/token = "
        f"{w.tokens * e.flops_per_token / 1e15:,.4g} PFLOP at {mfu:.0%} MFU (assumed) of {f.peak_flops / 1e12:g} "
        f"TFLOP/s = {e.compute_s:,.2f} s",
        f"communication: {e.comm_s:,.2f} s at nominal link rates (a lower bound: no latency, no contention)",
        f"verdict: {e.verdict} (communication {e.comm_s:,.2f} s vs compute {e.compute_s:,.2f} s per step; the "
        "collectives overlap compute, so the step takes about the longer)",
    ]


def span(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:,.1f} s"
    return f"{seconds / 60:,.1f} min" if seconds < 3600 else f"{seconds / 3600:,.2f} h"


def short(c: comms.Collective | None) -> str:
    if c is None:
        return "-"
    where = "network" if c.link.startswith("network") else c.link.split(" (")[0]
    return f"{c.sent / 1e9:,.2f} GB, {where}"


def scale_section(p, f: Fabric, mfu: float, node_counts: list[int]) -> str:
    """The same recipe and per-GPU batch at each node count: one-dimensional FSDP over every GPU against HSDP
    (the recipe's own layout where it is DDP)."""
    if f.node is None:
        raise UserError(f"no interconnect figures for the {f.gpu}. Fix: another --gpu (see fabric.py).")
    layouts = ["DDP"] if p.own in ("DDP", "single") else ["FSDP", "HSDP"]
    rows = ["| nodes | GPUs | layout | memory (GiB/GPU) | all-gather | reduce-scatter | all-reduce | "
            "communication (s) | compute (s) | bound |", "|---:|---:|---|---:|---|---|---|---:|---:|---|"]
    w = work(p, mfu)
    for n in node_counts:
        for layout in layouts:
            if layout == "HSDP" and n < 2:
                continue
            t = topology(p, n, layout)
            if layout == "HSDP":
                t = dataclasses.replace(t, shard=p.gpus)
            e = comms.estimate(p.shape, t, w, f)
            mem = budget(p.shape, dataclasses.replace(p.setup, shard=t.shard, world=t.world, strategy=layout))
            by = {c.op: c for c in e.collectives}
            label = {"FSDP": f"FSDP over {t.shard}", "HSDP": f"HSDP {t.shard} x {n}", "DDP": f"DDP over {t.world}"}
            compute = f"{e.compute_s:,.2f}" if e.compute_s is not None else "n/a"
            rows.append(f"| {n} | {t.world} | {label[layout]} | {gib(mem['total'])} | {short(by.get('all-gather'))} | "
                        f"{short(by.get('reduce-scatter'))} | {short(by.get('all-reduce'))} | {e.comm_s:,.2f} | "
                        f"{compute} | {e.verdict} |")
    head = (f"scaling {p.recipe.name} over nodes of {p.gpus} {p.gpu}, network {f.network}: per GPU per optimizer step "
            f"({w.accumulation} x {w.micro_batch} x {w.max_length:,} tokens per GPU, so the global batch grows with "
            "the GPUs)")
    return head + "\n\n" + "\n".join(rows)


def time_section(p, f: Fabric, mfu: float, rows: int | None, tokens_per_row: float | None) -> str:
    t = p.cfg.training
    max_length = t.max_length or 1024
    data = None
    if rows is None:
        data = duration.local_stats(p.cfg, max_length)
        if data is None:
            raise UserError(f"the dataset {p.cfg.script.dataset_name} is not local, so its size is unknown here. "
                            "Fix: --rows N (and --tokens-per-row T for its mean length).")
        rows = data.rows
    if tokens_per_row is not None:
        source = f"{rows:,} rows, {tokens_per_row:,.1f} tokens per row (given, cut at max_length {max_length:,})"
        data = duration.Data(rows, min(tokens_per_row, max_length), source)
    elif data is None:
        data = duration.Data(rows, float(max_length), f"{rows:,} rows (given); tokens per row unknown: every row "
                                                      f"max_length ({max_length:,}) long, the worst case")
    world = p.gpus * p.nodes
    dp = world // (p.setup.tp * p.setup.cp)  # a mesh's tp and cp ranks share their rows; all of them compute
    global_batch = t.per_device_train_batch_size * t.gradient_accumulation_steps * dp
    steps = duration.steps(rows, t.per_device_train_batch_size, dp, t.gradient_accumulation_steps,
                           t.num_train_epochs, t.max_steps)
    read = duration.rows_seen(rows, t.num_train_epochs, t.max_steps, global_batch)
    e = comms.estimate(p.shape, topology(p), work(p, mfu), f) if f.node is not None else None
    # attention at the rows' mean length, not max_length: rows are padded only to the longest in their batch
    fpt = comms.flops_per_token(p.shape, data.tokens_per_row)
    d = duration.estimate(data, steps, read, fpt, world, f.peak_flops if e else None, mfu, e.comm_s if e else 0.0)
    run = f"max_steps {t.max_steps}" if t.max_steps > 0 else f"{t.num_train_epochs:g} epoch(s)"
    lines = [f"how long: {data.source}",
             f"  steps: {steps:,} ({run}, global batch {global_batch} = {t.per_device_train_batch_size} x "
             f"{t.gradient_accumulation_steps} x {dp})",
             f"  tokens: {d.tokens:,} ({read:,} rows read x {data.tokens_per_row:,.1f}), "
             f"{fpt / 1e9:,.2f} GFLOP/token (attention at {data.tokens_per_row:,.0f} tokens)"]
    if d.seconds is None:
        lines.append(f"  time: unknown (no dense bf16 peak or interconnect figures for the {f.gpu})")
    else:
        lines.append(f"  time: {span(d.seconds)} = {steps:,} steps x {d.step_seconds:,.3g} s (per step the "
                     f"longer of compute at {mfu:.0%} MFU, an assumption until a GPU run measures it, and "
                     f"communication {e.comm_s:,.2f} s)")
    return "\n".join(lines)
