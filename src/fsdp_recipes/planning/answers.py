"""The sections `make plan` adds on request: --fit (fit.py), --comms and --scale (comms.py), --time (duration.py).
Each takes the plain plan's result (plan.Planned) and prints its arithmetic next to its answer."""

from __future__ import annotations

import dataclasses

from fsdp_recipes import decoder
from fsdp_recipes.config import accelerate_yaml
from fsdp_recipes.config.mesh import data_parallel_size
from fsdp_recipes.errors import UserError
from fsdp_recipes.planning import checkpointing, comms, duration, fit, mesh_fit, mesh_lines
from fsdp_recipes.planning.fabric import Fabric
from fsdp_recipes.planning.memory_budget import GIB, budget
from fsdp_recipes.speed import yarn
from fsdp_recipes.train import kinds

NODE_GPUS = 8  # GPUs of an HGX/DGX board: the node size a topology answer uses when GPUS names fewer


def gib(n: float) -> str:
    return f"{n / GIB:,.2f}"


def boundary(a: fit.Answer, usable: float) -> str:
    if not a.value:
        return f"{a.what}: none fits ({a.note}: 1 needs {gib(a.next_bytes or 0)} GiB)"
    past = (f"; {a.value + 1:,} does not ({a.next_bytes:,} B = {gib(a.next_bytes)} GiB > {usable:,.0f} B)"
            if a.next_bytes is not None else "")  # None: the search stopped at its limit, which the note names
    return f"{a.what}: {a.value:,} fits ({a.fits_bytes:,} B = {gib(a.fits_bytes)} GiB){past}; {a.note}"


def sequence_length(p) -> int:
    """Tokens of one trained sequence as the plain plan counts them: the trainer kind's (max_length, or a sampling
    kind's planned prompt + max_completion_length: GRPOConfig and RLOOConfig have no max_length)."""
    return kinds.load(p.cfg.trainer).sequence_length(p.cfg.training)


def counts(m) -> tuple[str, str, str]:
    """(parameters, active per token, trainable) as the plan's first line says them: in billions (the trainable ones
    to 3 places) from 0.1B up, else in millions, so a tiny model's are no "0.00B parameters, 0.003B trainable"."""
    if m.params < 1e8:
        return f"{m.params / 1e6:.2f}M", f"{m.active / 1e6:.2f}M", f"{m.trainable / 1e6:.2f}M"
    trainable = f"{m.trainable / 1e9:.3f}B" if not 0 < m.trainable < 5e5 else f"{m.trainable / 1e6:.2f}M"
    return f"{m.params / 1e9:.2f}B", f"{m.active / 1e9:.2f}B", trainable


def context_warnings(p) -> list[str]:
    """One line where max_length passes the model's trained positions without YaRN (speed/yarn.beyond_context, as
    the launcher says it)."""
    line = yarn.beyond_context(p.cfg, getattr(p.model.config, "max_position_embeddings", 0), type(p.model).__name__)
    return [f"warning: {line}."] if line else []


def fit_section(p) -> str:
    t, s, m, usable = p.cfg.training, p.setup, p.shape, p.usable
    limit = getattr(p.model.config, "max_position_embeddings", None)
    # a row's tokens as the plain plan counts them (plan.setups): a DPO pair is 2 sequences; a sampling kind's
    # completion is a planned prompt + max_completion_length, and its config has no max_length
    kind = kinds.load(p.cfg.trainer)
    length, sequences = kind.sequence_length(t), kind.SEQUENCES_PER_ROW
    # the policy's generate holds per_device_train_batch_size x steps_per_generation completions (generation_setup)
    sampled_per_row = (getattr(t, "steps_per_generation", None) or 1) if s.generation == "generate" else 0
    if hasattr(t, "max_length"):
        note = f"at max_length {length:,}" + (f", {sequences} sequences a row" if sequences > 1 else "")
        longest = "  " + boundary(fit.length(m, s, t.per_device_train_batch_size, usable, limit, sequences), usable)
    else:
        prompt = length - t.max_completion_length
        note = f"at {length:,} tokens a completion (a prompt of {prompt:,} + max_completion_length)"
        longest = (f"  max_length: not a setting of {p.cfg.trainer} (a completion is planned as a prompt of {prompt:,} "
                   "tokens + max_completion_length: plan another with --max_completion_length N)")
    lines = [f"fit at {p.nodes} node(s) x {p.gpus} {p.gpu}, usable {usable:,.0f} B = {gib(usable)} GiB per GPU "
             f"({p.own}; each answer is the plain plan's total, and one step past it does not fit):",
             "  " + boundary(fit.batch(m, s, length, usable, sequences, note, sampled_per_row), usable),
             longest,
             "  " + fit.checkpointing(m, s, usable)]
    lines += ["  " + line for line in stricter_limit(p)]
    lines += ["  " + line for line in topology_answer(p)]
    lines += ["  " + line for line in mesh_answer(p)]
    return "\n".join(lines)


def stricter_limit(p) -> list[str]:
    """The answers above are against the usable budget; where the recipe's gates set a lower limit (the default's
    peak_memory_max_fraction 50%), say so, with the figure the plan's checkpointing pick used, so that an answer
    between the two does not read as safe for the gate."""
    capacity = p.capacity * GIB
    share, source = checkpointing.limit_share(p.cfg.pack, p.usable / capacity, p.capacity)
    if share * capacity >= p.usable:
        return []
    return [f"a lower limit: {gib(share * capacity)} GiB per GPU ({source}), which the activation-checkpointing pick "
            "uses; an answer above it fits the usable budget, not that limit"]


def mesh_answer(p) -> list[str]:
    """A mesh (tp, cp) where FSDP over the node does not fit, or the recipe has one (mesh_fit.py)."""
    m, s, usable = p.shape, p.setup, p.usable
    if p.fits and s.tp * s.cp == 1:
        return [f"mesh: none needed (FSDP over {p.gpus} fits)"]
    if s.tp * s.cp > 1:
        return recipe_mesh_answer(p)
    config = p.model.config
    flat = dataclasses.replace(s, tp=1, cp=1)
    alone = fit.smallest_fsdp_world(m, dataclasses.replace(flat, strategy="FSDP"), usable, p.gpus * 1024)
    heads, kv_heads = decoder.heads(config), decoder.kv_heads(config)  # GPT-NeoX: no num_key_value_heads
    max_length = sequence_length(p)

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


def recipe_mesh_answer(p) -> list[str]:
    """A recipe with a mesh keeps it (the search's other meshes would drop its tp or cp): here where it fits, else
    at the fewest nodes of at least tp x cp GPUs where it does and the launcher starts it."""
    m, s = p.shape, p.setup
    split = mesh_lines.Split.of(s)
    alone = fit.smallest_fsdp_world(m, dataclasses.replace(s, tp=1, cp=1, strategy="FSDP"), p.usable, p.gpus * 1024)
    versus = f"FSDP alone needs {alone} GPUs" if alone else "FSDP alone fits no GPU count (a row's activations)"
    if split.dp_replicate > 1:
        return [f"mesh: the recipe's own, {split.short()}; {versus}"]
    per_node = mesh_node(p.gpus, split.tp * split.cp)
    here = p.fits and p.gpus % (split.tp * split.cp) == 0  # a node too small for tp x cp: whole nodes proposed
    a = mesh_fit.MeshAnswer(p.nodes, p.gpus, s.tp, s.cp, p.budgets[p.own]["total"]) if here else next(
        (mesh_fit.MeshAnswer(n, per_node, s.tp, s.cp, t) for n in range(1, 129)
         if (t := fit.total(m, mesh_fit.meshed(s, n * per_node, s.tp, s.cp))) <= p.usable
         and mesh_lines.refusal(p, n, per_node) is None), None)
    if a is None:
        return [f"mesh: the recipe's tp {s.tp} x cp {s.cp} fits no job up to 128 nodes of {per_node} ({versus})"]
    lines = [f"mesh: {a.describe()}, the recipe's own mesh" + ("" if here else " on nodes that hold it") +
             f"; {versus}",
             f"  accelerate.yaml: {mesh_fit.accelerate_keys(a)}"]
    if a.cp > 1:
        lines.append(f"  recipe: {mesh_fit.recipe_keys(p.cfg.training, a.cp)} (context parallel splits whole "
                     "padded rows)")
    return lines


def mesh_node(gpus: int, step: int) -> int:
    """The node size a topology answer counts in: the planned node, at least an HGX board of 8, and at least the
    mesh's tp x cp (a multiple of it), which stays inside a node."""
    node = max(gpus, NODE_GPUS, step)
    return -(-node // step) * step


def topology_answer(p) -> list[str]:
    """The smallest topology that fits, for the recipe's strategy."""
    m, s, usable = p.shape, p.setup, p.usable
    if p.own == "HSDP":
        shard = fit.smallest_shard(m, s, usable, p.gpus)
        if s.cp > 1:  # a shard group of dp_shard x cp, dp_shard at least 2 (config/mesh.py refuses replicas of 1)
            shard = next((n for n in range(2 * s.cp, p.gpus // s.tp + 1, s.cp)
                          if fit.total(m, dataclasses.replace(s, shard=n)) <= usable), None)
        if shard is None:
            world = fit.smallest_fsdp_world(m, s, usable, p.gpus * 1024)
            alt = f"; one-dimensional FSDP over {world} GPUs would (see --comms)" if world else ""
            return [f"smallest topology: no node count fits under HSDP (per-GPU memory is set by the shard group, "
                    f"at most the {p.gpus} GPUs of a node; more nodes add replicas, not memory){alt}"]
        mesh = f", dp_shard {shard // s.cp} x cp {s.cp}" if s.cp > 1 else ""
        return [f"smallest topology: NODES=2 GPUS={shard * s.tp} (HSDP: a shard group of {shard}{mesh} in each node, "
                "replicated over the nodes; HSDP needs 2 nodes or more)"]
    if p.own in ("DDP", "single"):
        if p.fits:
            return [f"smallest topology: {p.own} holds a whole copy per GPU: any GPU count fits"]
        world = fit.smallest_fsdp_world(m, s, usable, p.gpus * 1024)
        alt = f"; FSDP over {world} GPUs would" if world else ""
        return [f"smallest topology: none under {p.own}: every GPU holds the whole model, whatever the count{alt}"]
    step = s.tp * s.cp  # a mesh's world is a multiple of tp x cp (fit.smallest_fsdp_world), inside a node
    node = mesh_node(p.gpus, step)  # GPUS names this node; a bigger answer is stated in nodes of the usual board
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
    if world <= node and world == step:
        return [f"smallest topology: GPUS={world} NODES=1 (the fewest the recipe's mesh runs on)"]
    if world <= node:
        fewer = world - step
        less = fit.total(m, dataclasses.replace(s, shard=fewer // s.tp, world=fewer))
        return [f"smallest topology: GPUS={world} NODES=1 (FSDP over {world}; {fewer} would need {gib(less)} GiB)"]
    nodes = -(-world // node)
    if step == 1:
        return [f"smallest topology: {world} GPUs: NODES={nodes} GPUS={node} (one-dimensional FSDP across nodes: "
                "see --comms for what that costs, and HSDP's memory for the alternative)"]
    # the mesh kept on whole nodes: tp x cp inside each, FSDP's dp_shard across them; HSDP only where it launches
    split = mesh_lines.Split(1, nodes * node // step, s.tp, s.cp)
    refused = mesh_lines.refusal(p, nodes, node)
    if refused:
        return [f"smallest topology: {world} GPUs, but the launcher refuses the recipe's mesh on NODES={nodes} "
                f"GPUS={node} ({mesh_lines.first_clause(refused)})"]
    hsdp = mesh_lines.hsdp_refusal(p, nodes, node)
    alt = ("; HSDP with the mesh kept is refused by the launcher" if hsdp else
           "; HSDP with the mesh kept is the alternative (see --comms)")
    return [f"smallest topology: {world} GPUs: NODES={nodes} GPUS={node} ({split.short()}: tp x cp inside each "
            f"node, FSDP's all-gathers across the nodes, see --comms{alt})"]


def topology(p, nodes: int | None = None, strategy: str | None = None) -> comms.Topology:
    fsdp = p.acc.get("fsdp_config") or {}
    nodes = nodes or p.nodes
    strategy = strategy or p.own
    tp, cp = p.setup.tp, p.setup.cp  # a mesh's, in every layout (scale_section offers only those it starts)
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
    gather, widths = s.compute_bytes, {}
    if s.tp > 1:  # transformers' FSDP2 without a mixed-precision policy: the weights' dtype (comms.py, measured);
        gather = s.load_bytes  # LoRA's adapters are fp32 (PEFT upcasts them), a full fine-tune's weights its load
        reduce = 4 if p.cfg.model.use_peft else s.load_bytes
        widths = dict(activation_bytes=s.compute_bytes, residual_bytes=s.load_bytes)
    # a micro-batch's sequences as the plain plan counts them (plan.setups): a DPO pair is 2 (chosen and rejected)
    kind = kinds.load(p.cfg.trainer)
    sequences = t.per_device_train_batch_size * kind.SEQUENCES_PER_ROW
    # the kind's forwards besides the trained sequence's (DPO's reference): FLOPs as the run report counts them, and
    # their all-gathers (comms.py)
    extra = tuple(kind.extra_forwards(t).items())
    return comms.Work(t.gradient_accumulation_steps, sequences, sequence_length(p),
                      gather, reduce, mfu, recompute=s.checkpointed, recompute_every=s.checkpoint_every,
                      attention_saved=s.checkpointed and s.checkpoint_ops, extra_forwards=extra,
                      lora=bool(p.cfg.model.use_peft), **widths)


def comms_section(p, f: Fabric, mfu: float) -> tuple[str, comms.Estimate]:
    if f.node is None:
        raise UserError(f"no interconnect figures for the {f.gpu} (its GPU-to-GPU links depend on the system). "
                        f"Fix: plan with a GPU of fsdp_recipes/planning/fabric.py's table, or add the {f.gpu} there.")
    t, w = topology(p), work(p, mfu)
    e = comms.estimate(p.shape, t, w, f)
    gather = f"all-gather at {w.gather_bytes} B/parameter, " if p.own in ("FSDP", "HSDP") else ""
    group = f"shard group {t.shard}" if p.own in ("FSDP", "HSDP") else "no sharding"
    if t.tp * t.cp > 1:
        group = f"the mesh {mesh_lines.Split.of(p.setup).short()}"
    lines = [f"communication per optimizer step, per GPU: {p.own}, {group}, {t.nodes} node(s) x {t.gpus}; "
             f"{w.accumulation} micro-batch(es) of {w.micro_batch} x {w.max_length:,} tokens{pairs(p)}; "
             f"{gather}gradients reduced at {w.reduce_bytes} B",
             "", comms.table(e), "",
             f"network between nodes: {f.network} = {f.network_gbps:g} GB/s per GPU per direction"
             + ("" if t.nodes > 1 else " (unused on one node)")]
    lines += mesh_lines.comms_scope(p, t, w)
    if kinds.load(p.cfg.trainer).samples(p.cfg.training):
        lines.append("sampling's own communication (the generate loop's gathers, or vLLM's weight sync) is not counted")
    lines += compute_lines(e, w, f, mfu)
    lines += [f"warning: {x}" for x in e.warnings + mesh_lines.comms_warnings(p, t)]
    return "\n".join(lines), e


def pairs(p) -> str:
    """What a micro-batch's sequences are where a row has several (DPO: 2 pairs are 4 sequences), else nothing."""
    n, rows = kinds.load(p.cfg.trainer).SEQUENCES_PER_ROW, p.cfg.training.per_device_train_batch_size
    return f" ({rows} rows of {n} sequences)" if n > 1 else ""


def extra_forwards_named(w: comms.Work) -> str:
    """The kind's forwards besides the trained sequence's that a FLOPs figure per token includes, briefly: DPO's
    "incl. the reference forward"; "" where there are none."""
    parts = [f"the {name} forward" if n == 1 else f"{n:g} {name} forwards" for name, n in w.extra_forwards if n > 0]
    return f"incl. {' and '.join(parts)}" if parts else ""


def compute_lines(e: comms.Estimate, w: comms.Work, f: Fabric, mfu: float) -> list[str]:
    if e.compute_s is None:
        return [f"compute: no dense bf16 peak for the {f.gpu}, so no time and no verdict"]
    named = extra_forwards_named(w)
    return [
        f"compute: {w.tokens:,} tokens x {e.flops_per_token / 1e9:,.2f} GFLOP/token"
        + (f" ({named})" if named else "") + " = "
        f"{w.tokens * e.flops_per_token / 1e15:,.4g} PFLOP at {mfu:.0%} MFU (assumed) of {f.peak_flops / 1e12:g} "
        f"TFLOP/s = {e.compute_s:,.2f} s",
        f"communication: {e.comm_s:,.2f} s at nominal link rates (a lower bound: no latency, no contention)",
        f"verdict: {e.verdict} (communication {e.comm_s:,.2f} s vs compute {e.compute_s:,.2f} s per step; the "
        "collectives overlap compute, so the step takes about the longer)" if not e.exposed_s else
        f"verdict: {e.verdict} (overlapped communication {e.overlapped_s:,.2f} s vs compute {e.compute_s:,.2f} s; "
        f"tp's {e.exposed_s:,.2f} s is exposed, on each layer's critical path: the step takes about "
        f"{max(e.overlapped_s, e.compute_s) + e.exposed_s:,.2f} s, the longer plus the exposed)",
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
    split = mesh_lines.Split.of(p.setup)
    if split.meshed and split.dp_replicate == 1:  # the mesh kept; HSDP beside it where the launcher starts it
        refused = p.gpus % (split.tp * split.cp) or mesh_lines.hsdp_refusal(p, 2)
        layouts = ["FSDP"] if refused else ["FSDP", "HSDP"]
    rows = ["| nodes | GPUs | layout | memory (GiB/GPU) | all-gather | reduce-scatter | all-reduce | "
            "communication (s) | compute (s) | bound |", "|---:|---:|---|---:|---|---|---|---:|---:|---|"]
    w = work(p, mfu)
    for n in node_counts:
        for layout in layouts:
            if layout == "HSDP" and n < 2:
                continue
            t = topology(p, n, layout)
            if layout == "HSDP":
                t = dataclasses.replace(t, shard=p.gpus // t.tp)
            e = comms.estimate(p.shape, t, w, f)
            mem = budget(p.shape, dataclasses.replace(p.setup, shard=t.shard, world=t.world, strategy=layout))
            by = {c.op: c for c in e.collectives}
            label = {"FSDP": f"FSDP over {t.shard}", "HSDP": f"HSDP {t.shard} x {n}", "DDP": f"DDP over {t.world}"}
            if split.meshed:
                label = {k: v + f", tp {t.tp} x cp {t.cp}" for k, v in label.items()}
            compute = f"{e.compute_s:,.2f}" if e.compute_s is not None else "n/a"
            rows.append(f"| {n} | {t.world} | {label[layout]} | {gib(mem['total'])} | {short(by.get('all-gather'))} | "
                        f"{short(by.get('reduce-scatter'))} | {short(by.get('all-reduce'))} | {e.comm_s:,.2f} | "
                        f"{compute} | {e.verdict} |")
    head = (f"scaling {p.recipe.name} over nodes of {p.gpus} {p.gpu}, network {f.network}: per GPU per optimizer step "
            f"({w.accumulation} x {w.micro_batch} x {w.max_length:,} tokens per GPU, so the global batch grows with "
            "the GPUs)")
    if split.meshed:
        head += (f"; the recipe's tp {split.tp} x cp {split.cp} kept in every layout" +
                 ("" if "HSDP" in layouts else ", and no HSDP row: the launcher refuses HSDP beside it") +
                 ("; tp's own collectives are in the communication column (exposed: added to the step, while the "
                  "bound compares the overlapped rest with compute)" if split.tp > 1 else ""))
    return head + "\n\n" + "\n".join(rows)


def time_section(p, f: Fabric, mfu: float, rows: int | None, tokens_per_row: float | None) -> str:
    t = p.cfg.training
    if not hasattr(t, "max_length"):  # a sampling kind: a dataset row is a prompt, and its steps sample first
        raise UserError(f"--time does not model {p.cfg.trainer}: a row is a prompt trained as num_generations "
                        "completions, and each step's sampling is not counted. Fix: time a short run (--max_steps 4; "
                        f"its report's wall_clock_s) and scale it to max_steps {t.max_steps}")
    max_length = sequence_length(p)
    sequences = kinds.load(p.cfg.trainer).SEQUENCES_PER_ROW  # a DPO pair runs 2 sequences, each cut at max_length
    longest = sequences * max_length
    cut = f"max_length {max_length:,}" + (f" a sequence, {sequences} a row" if sequences > 1 else "")
    data = None
    if rows is None:
        data = duration.local_stats(p.cfg, max_length)
        if data is None:
            raise UserError(f"the dataset {p.cfg.script.dataset_name} is not local, so its size is unknown here. "
                            "Fix: --rows N (and --tokens-per-row T for its mean length).")
        rows = data.rows
    if tokens_per_row is not None:
        source = f"{rows:,} rows, {tokens_per_row:,.1f} tokens per row (given, cut at {cut})"
        data = duration.Data(rows, min(tokens_per_row, longest), source)
    elif data is None:
        every = "row" if sequences == 1 else f"sequence ({sequences} a row)"
        data = duration.Data(rows, float(longest), f"{rows:,} rows (given); tokens per row unknown: every {every} "
                                                   f"max_length ({max_length:,}) long, the worst case")
    world = p.gpus * p.nodes
    dp = data_parallel_size(world, p.setup)  # a mesh's tp and cp ranks share their rows; all of them compute
    global_batch = t.per_device_train_batch_size * t.gradient_accumulation_steps * dp
    steps = duration.steps(rows, t.per_device_train_batch_size, dp, t.gradient_accumulation_steps,
                           t.num_train_epochs, t.max_steps)
    read = duration.rows_seen(rows, t.num_train_epochs, t.max_steps, global_batch)
    w = work(p, mfu)
    e = comms.estimate(p.shape, topology(p), w, f) if f.node is not None else None
    # attention at the rows' mean length, not max_length: rows are padded only to the longest in their batch
    per_sequence = data.tokens_per_row / sequences  # a row's tokens are its sequences'
    fpt = comms.flops_per_token(p.shape, per_sequence, w.extra_forwards, w.lora)
    d = duration.estimate(data, steps, read, fpt, world, f.peak_flops if e else None, mfu,
                          e.overlapped_s if e else 0.0, e.exposed_s if e else 0.0)
    run = f"max_steps {t.max_steps}" if t.max_steps > 0 else f"{t.num_train_epochs:g} epoch(s)"
    lines = [f"how long: {data.source}",
             f"  steps: {steps:,} ({run}, global batch {global_batch} = {t.per_device_train_batch_size} x "
             f"{t.gradient_accumulation_steps} x {dp})",
             f"  tokens: {d.tokens:,} ({read:,} rows read x {data.tokens_per_row:,.1f}), "
             f"{fpt / 1e9:,.2f} GFLOP/token ("
             + "; ".join(x for x in (extra_forwards_named(w), f"attention at {per_sequence:,.0f} tokens") if x) + ")"]
    if d.seconds is None:
        lines.append(f"  time: unknown (no dense bf16 peak or interconnect figures for the {f.gpu})")
    else:
        lines.append(f"  time: {span(d.seconds)} = {steps:,} steps x {d.step_seconds:,.3g} s (per step the "
                     f"longer of compute at {mfu:.0%} MFU, an assumption until a GPU run measures it, and "
                     f"communication {e.overlapped_s:,.2f} s" + (f", plus tp's exposed {e.exposed_s:,.2f} s)"
                                                                  if e.exposed_s else ")"))
    return "\n".join(lines)
