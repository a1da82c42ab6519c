"""What `make plan` says of a recipe whose mesh has tensor or context parallel (config/mesh.py's tp or cp above 1):
how the model is split (the header), what the decision rule becomes (the rule's FSDP/HSDP choice is for recipes
without a mesh), and whether HSDP beside the mesh is one the launcher starts (config/mesh.py's checks decide,
through mesh_fit.refusal). A plain FSDP recipe's lines stay plan.py's.

The plan's Setup holds the mesh: `shard` is FSDP's group, dp_shard x cp (accelerate shards over dp_shard_cp), `tp`
and `cp` its other sizes, and the world over them all is dp_replicate (HSDP's replicas).
"""

from __future__ import annotations

import dataclasses

from fsdp_recipes import decoder
from fsdp_recipes.planning import mesh_fit
from fsdp_recipes.planning.memory_budget import GIB, budget


@dataclasses.dataclass(frozen=True)
class Split:
    """The sizes of a planned mesh, from the plan's Setup."""

    dp_replicate: int
    dp_shard: int
    tp: int
    cp: int

    @classmethod
    def of(cls, setup) -> Split:
        return cls(setup.world // (setup.shard * setup.tp), setup.shard // setup.cp, setup.tp, setup.cp)

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.cp

    @property
    def meshed(self) -> bool:
        return self.tp * self.cp > 1

    def short(self) -> str:
        """How the model is split, e.g. "tensor parallel over 8 x FSDP over dp_shard 2 = 16 GPUs"."""
        parts = [f"replicated over {self.dp_replicate} (HSDP)"] if self.dp_replicate > 1 else []
        if self.tp > 1:
            parts.append(f"tensor parallel over {self.tp}")
        parts.append(f"FSDP over dp_shard {self.dp_shard}" + (f" x cp {self.cp}" if self.cp > 1 else ""))
        return " x ".join(parts) + f" = {self.world} GPUs"

    def words(self) -> str:
        """short(), and what each split holds."""
        text = self.short()
        if self.tp > 1:
            text += (f": each layer's weights split over the {self.tp} tp ranks, FSDP shards that split over "
                     f"{self.dp_shard}, so weights, gradients and optimizer states are "
                     f"1/{self.tp * self.dp_shard * self.cp} a GPU")
        if self.cp > 1:
            text += f"; each row's tokens split over the {self.cp} cp ranks"
        return text

    def across_nodes(self, gpus: int) -> str:
        """A warning where a node of `gpus` cannot hold the tp x cp group (accelerate puts tp innermost, then cp)."""
        if self.tp * self.cp <= gpus:
            return ""
        return (f"; warning: tp x cp = {self.tp * self.cp} is more than a node's {gpus} GPUs, so the group spans "
                "nodes and its per-layer collectives cross the network (GPUS of at least tp x cp keeps them inside "
                "a node)")


def header(p) -> str:
    """The plan's second line: the topology and how the recipe's mesh splits the model."""
    split = Split.of(p.setup)
    return (f"topology {p.nodes} node(s) x {p.gpus} {p.gpu} ({p.capacity:.1f} GiB each); recipe strategy {p.own} "
            f"with a mesh: {split.words()}{split.across_nodes(p.gpus)}")


def first_clause(refusal: str) -> str:
    """The launcher's one line without its path and its fix: what it refuses."""
    reason = refusal.split(". Fix:")[0]
    return reason.split(": ", 1)[1] if reason.startswith("accelerate.yaml: ") else reason


def refusal(p, nodes: int, per_node: int, replicate: int = 1) -> str | None:
    """Whether the launcher starts the recipe's tp and cp kept on `nodes` x `per_node` GPUs, replicated `replicate`
    times (HSDP): its one line, or None."""
    s, config = p.setup, p.model.config
    return mesh_fit.refusal(p.acc, p.cfg, nodes * per_node, s.tp, s.cp, decoder.heads(config),
                            decoder.kv_heads(config), p.cfg.training.max_length or 1024, replicate=replicate)


def hsdp_refusal(p, nodes: int, per_node: int | None = None) -> str | None:
    """HSDP with the recipe's tp and cp kept: a shard group of dp_shard x cp inside each node, replicated over the
    `nodes`."""
    return refusal(p, nodes, per_node or p.gpus, replicate=nodes)


def hsdp_setup(p):
    """The recipe's Setup as HSDP with its tp and cp kept: FSDP's group the node's dp_shard x cp."""
    return dataclasses.replace(p.setup, strategy="HSDP", shard=p.gpus // p.setup.tp)


def decision(p) -> str:
    """The decision rule's line for a recipe with a mesh: DDP where a whole copy with whole rows fits one GPU (the
    DDP column, no mesh), else the recipe's mesh; across nodes, HSDP with the mesh kept where the launcher starts
    it, with its memory, or the launcher's reason where it does not."""
    if p.budgets["DDP"]["total"] <= p.usable:
        return ("DDP (the whole model, gradients and optimizer states, and whole rows, fit one GPU: the recipe's "
                "mesh is not needed for memory)")
    split = Split.of(p.setup)
    line = f"the recipe's mesh, {split.short()} (the rule's FSDP/HSDP choice is for recipes without tp or cp)"
    if p.nodes < 2 or split.dp_replicate > 1:
        return line
    if p.gpus % (split.tp * split.cp):
        return line + (f"; HSDP with the mesh kept needs nodes of a multiple of tp x cp = {split.tp * split.cp} "
                       f"GPUs, not {p.gpus}")
    refused = hsdp_refusal(p, p.nodes)
    if refused:
        return line + f"; HSDP with the mesh kept is refused by the launcher ({first_clause(refused)})"
    total = budget(p.shape, hsdp_setup(p))["total"]
    verdict = "fits" if total <= p.usable else "does not fit"
    return (line + f"; HSDP with the mesh kept (dp_replicate {p.nodes} x dp_shard {p.gpus // (split.tp * split.cp)} "
            f"x tp {split.tp} x cp {split.cp}, a shard group of {p.gpus // split.tp} in each node) {verdict}: "
            f"{total / GIB:,.1f} GiB per GPU")


def comms_scope(p, t, w) -> list[str]:
    """What `--comms` models of the recipe's mesh, and what it does not (comms.py's docstring has the counts'
    sources): said in the output, so that no FSDP-only figure reads as the mesh's."""
    if t.tp * t.cp == 1:
        return []
    tokens = w.micro_batch * w.max_length // t.cp
    lines = []
    if t.tp > 1:
        lines += [
            f"modelled for tp {t.tp}: FSDP's all-gathers and reduce-scatters over dp_shard x cp = {t.shard} only, "
            f"1/{t.tp} of each layer, in the weights' dtype ({w.gather_bytes} B a parameter gathered, {w.reduce_bytes} B a "
            "gradient: transformers' FSDP2 under tp has no mixed-precision policy), the embedding gathered again in "
            "the backward",
            f"modelled for tp {t.tp}, per micro-batch on the GPU's {tokens:,} tokens x {p.shape.hidden:,}: 2 "
            f"all-reduces a layer in the forward at {w.activation} B" +
            (f" (2 more in each of the {w.recomputed(p.shape.layers)} recomputed)" if w.recompute else "")
            + f", 5 in the backward at {w.residual} B (the residual stream's dtype), 1 each for the embedding and the "
            f"LM head's input, and the logits all-gathered at {w.activation} B: exposed (the next matmul waits for "
            "them), so added to the step rather than overlapped",
            "  these counts and dtypes were measured on CPU (bench/tp_cpu_collectives.py: tiny Mistral, tp 2 x "
            "dp_shard 2); "
            "NCCL's speed and any overlap on GPUs are not",
            # 7 a layer (2 forward, 5 backward), the embedding's and the LM head's, and 2 in each recomputed layer
            f"not modelled for tp: the latency of {7 * p.shape.layers + 2 + 2 * w.recomputed(p.shape.layers):,} "
            "all-reduces a micro-batch (a bandwidth bound only)" + (
                ", LoRA's r-wide all-reduces and its adapters' gradient sync over the dp ranks (counted as FSDP's "
                "reduce-scatter)" if p.cfg.model.use_peft else ""),
        ]
    if t.cp > 1:
        lines += [
            f"modelled for cp {t.cp}: FSDP over dp_shard x cp = {t.shard} at {w.gather_bytes} B, as without cp; the "
            f"ring passing each layer's K/V of the micro-batch's whole rows ({w.micro_batch * w.max_length:,} tokens; "
            f"each GPU computes {tokens:,}), 3 passes a layer (4 in a layer whose attention is recomputed) at "
            f"{w.activation} B, counted as overlapped with attention",
            "not modelled for cp: torch's default all-gather rotation (K/V gathered before the chunks' attention, "
            "partly exposed), the loss's and token counts' all-reduces (scalars), and the all-to-all form a CPU runs",
        ]
    return lines


def comms_warnings(p, t) -> list[str]:
    """A mesh across nodes: FSDP's group crosses the network; HSDP with the mesh kept, where the launcher starts
    it, is the fix, and where it does not its reason is said instead of proposing it."""
    split = Split.of(p.setup)
    if not split.meshed or t.nodes < 2 or split.dp_replicate > 1:
        return []
    said = (f"FSDP's all-gathers and reduce-scatters over dp_shard x cp = {t.shard} cross the network between the "
            f"{t.nodes} nodes (the tp x cp groups stay inside each node). ")
    if p.gpus % (split.tp * split.cp):
        return [said + f"HSDP with the mesh kept needs nodes of a multiple of tp x cp = {split.tp * split.cp} GPUs"]
    refused = hsdp_refusal(p, t.nodes)
    if refused:
        return [said + f"HSDP with the mesh kept is refused by the launcher ({first_clause(refused)}): the recipe's "
                       "layout is the one that runs"]
    return [said + f"Fix: HSDP with the mesh kept (parallelism_config_dp_replicate_size: {t.nodes}, "
                   f"parallelism_config_dp_shard_size: {p.gpus // (split.tp * split.cp)})"]
