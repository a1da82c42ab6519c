"""Per optimizer step, per GPU: the bytes each collective moves, the link it runs on, the time that takes, and the
compute time at an assumed MFU; whether the step is compute- or communication-bound. `make plan ARGS=--comms`.

What runs, per optimizer step of k = gradient_accumulation_steps micro-batches (accelerate 1.15, transformers 5.23):
- FSDP / HSDP (FSDP2's fully_shard, FSDP1's FULL_SHARD): every micro-batch all-gathers each decoder layer in its
  forward and, with reshard_after_forward (the recipes' setting), again in its backward; the root unit
  (embeddings, final norm, LM head) is gathered once per micro-batch, since FSDP2 never reshards the root after
  forward (torch's FSDPState._lazy_init). Gradients are reduce-scattered only on the last micro-batch: the Trainer
  runs the others under accelerate's no_sync (FSDP2: set_requires_gradient_sync(False)). So: all-gather x2 (layers)
  per micro-batch + reduce-scatter x1 per step, the count in the FSDP paper (Zhao et al. 2023, section 3.2).
  accelerate's bf16 policy sets param_dtype = reduce_dtype = bf16: both move 2 bytes per parameter.
  FSDP2 reduce-scatters only parameters that have gradients (LoRA: the adapters). FSDP1 with use_orig_params
  reduce-scatters the whole flat gradient of a unit that holds any trainable parameter (frozen parts as zeros).
- HSDP: the reduce-scatter runs in the shard group (inside a node), then each GPU all-reduces its gradient shard
  (1/shard of the gradients) with its replicas across nodes.
- DDP: one all-reduce of every trainable gradient per step (no_sync on the others), in the gradients' dtype.
- A tensor-parallel mesh (train/tensor_parallel.py: transformers' FSDP2 over dp_shard, its tp plan over tp): FSDP
  gathers and reduce-scatters over the dp_shard group only, each tensor 1/tp of the layer, in the weights' own dtype
  (transformers' fully_shard gets no mixed-precision policy: fp32 for a full fine-tune, which config/mesh.py
  requires, bf16 for a bf16 LoRA base); the embedding, resharded after the forward, is gathered again in the
  backward. tp's own collectives, per micro-batch, on the GPU's tokens (its 1/cp share) x hidden: 2 all-reduces a
  layer in the forward (the row-wise o_proj and down_proj outputs) at the compute width, 5 in the backward (the
  input gradients of the column-wise q, k, v, gate and up projections, one each) in the residual stream's dtype
  (the weights'), one each outside the layers (the vocab-split embedding's output, the LM head's input gradient),
  and an all-gather of the column-wise LM head's logits at the compute width; a recomputed layer adds its forward
  two. Measured on CPU (bench/tp_cpu_collectives.py, 2026-11-29: tiny Mistral, tp 2 x dp_shard 2, fp32 weights
  under bf16 autocast, collectives recorded by dispatch): forward 8 bf16 all-reduces of tokens x hidden (4 layers
  x 2), 1 fp32 (the embedding's) and 1 logits all-gather; backward 21 fp32 all-reduces (4 layers x 5 + 1); FSDP's
  all-gathers and reduce-scatters fp32, 1/tp of a layer. Not modelled: LoRA's r-wide
  all-reduces (its A on the row-wise projections), a LoRA first layer's 3 attention input gradients it skips
  (frozen embedding), and the adapters' gradient sync over the dp ranks (counted as FSDP's reduce-scatter).
  tp's collectives sit on each layer's critical path (the next matmul waits for them), so they are counted as
  exposed: added to the step, not overlapped with compute as FSDP's prefetched all-gathers are.
- A trainer kind's extra forwards (train/kinds' extra_forwards: forwards per trained token besides the trained
  sequence's own): each full-sequence forward of a micro-batch all-gathers every decoder layer once more, a row
  "all-gather (<name>)", scaled by its count per token: DPO's and KTO's reference (full fine-tuning: its own sharded
  copy, the same size; LoRA: the policy with the adapter disabled, its own layers again), KTO's "kl_policy" and
  GRPO's "old_policy" (the policy). A reference copy's root unit (embeddings, final norm, LM head; at most one
  gather a forward) is left out. Sampling ("generation"), a generate loop whose gathers depend on the decode length
  and on vLLM, is not modelled.

Bytes each GPU sends (and receives) for a collective over n GPUs of a payload of S bytes, by NCCL's ring algorithm:
all-gather and reduce-scatter (n-1)/n x S, all-reduce 2(n-1)/n x S (NCCL's "bus bandwidth" factors, nccl-tests
doc/PERFORMANCE.md). Time = those bytes / the slowest link the ring crosses, per GPU per direction
(fsdp_recipes.planning.fabric); latency (a few microseconds per ring step) is left out, which flatters very large
groups. Tree and NVLS algorithms can do better; a lower bound at nominal rates is what this is.

Compute per step: model FLOPs per token (fsdp_recipes.metrics.flops: 6N trainable + 4N frozen + attention at the
worst-case length max_length, plus the kind's extra forwards by flops.extra_forward_flops, as the run report counts
them: 2N + attention's forward third each) x tokens, at an assumed MFU of the dense bf16 peak. MFU counts model
FLOPs, so an activation-checkpointing recompute is inside the assumed figure, not added. FSDP overlaps its
collectives with compute (prefetching the next layer), so a step takes about the longer of the two:
communication-bound when the collectives' time exceeds the compute time.
"""

from __future__ import annotations

import dataclasses

from fsdp_recipes.metrics import flops
from fsdp_recipes.planning.fabric import Fabric
from fsdp_recipes.planning.memory_budget import ModelShape

DEFAULT_MFU = 0.40  # an assumption, not a measurement: no run of this pack has reached a GPU yet


@dataclasses.dataclass(frozen=True)
class Topology:
    strategy: str  # "FSDP" | "HSDP" | "DDP" | "single"
    gpus: int  # per node
    nodes: int
    shard: int  # FSDP/HSDP shard-group size
    fsdp_version: int = 2
    reshard_after_forward: bool = True
    tp: int = 1  # a mesh's tensor-parallel group (inside a node), config/mesh.py
    cp: int = 1  # its context-parallel group (inside a node)

    @property
    def world(self) -> int:
        return self.gpus * self.nodes


@dataclasses.dataclass(frozen=True)
class Work:
    """Per-GPU work of one optimizer step."""

    accumulation: int
    micro_batch: int  # sequences per GPU per micro-batch
    max_length: int
    gather_bytes: int  # bytes per parameter all-gathered (the compute width under mixed precision)
    reduce_bytes: int  # bytes per gradient element reduced
    mfu: float = DEFAULT_MFU
    recompute: bool = False  # activation checkpointing: a checkpointed layer's forward runs again in the backward
    recompute_every: int = 1  # every k-th layer is checkpointed (the every_<k> policies; 1: all of them)
    # the `ops` policy: each checkpointed layer saves its attention output, so its recompute skips SDPA (and cp's
    # ring) and re-runs the projections and the MLP (tp's all-reduces) only
    attention_saved: bool = False
    activation_bytes: int | None = None  # a matmul output (the compute width); None: gather_bytes
    residual_bytes: int | None = None  # the residual stream between layers (the weights' dtype); None: gather_bytes
    # the trainer kind's forwards per trained token besides its own, by name (train/kinds' extra_forwards)
    extra_forwards: tuple[tuple[str, float], ...] = ()
    lora: bool = False  # the reference is the base with the adapter disabled (flops.extra_forward_weights)

    def recomputed(self, layers: int) -> int:
        """Layers whose forward runs again: 0, k, 2k, ... (memory_budget's count)."""
        return -(-layers // self.recompute_every) if self.recompute else 0

    @property
    def activation(self) -> int:
        return self.activation_bytes or self.gather_bytes

    @property
    def residual(self) -> int:
        return self.residual_bytes or self.gather_bytes

    @property
    def tokens(self) -> int:
        return self.accumulation * self.micro_batch * self.max_length


@dataclasses.dataclass(frozen=True)
class Collective:
    op: str  # all-gather | reduce-scatter | all-reduce
    group: int  # GPUs in the collective
    payload: int  # bytes of the full tensors, summed over the step's calls
    sent: int  # bytes each GPU sends per step: the ring factor x payload
    link: str
    gbps: float  # GB/s per GPU per direction
    exposed: bool = False  # on the critical path (tp's): added to the step, not overlapped with compute

    @property
    def seconds(self) -> float:
        return self.sent / (self.gbps * 1e9)


@dataclasses.dataclass(frozen=True)
class Estimate:
    collectives: list[Collective]
    compute_s: float | None  # None: no bf16 peak for the GPU
    flops_per_token: float
    warnings: list[str]

    @property
    def comm_s(self) -> float:
        return sum(c.seconds for c in self.collectives)

    @property
    def exposed_s(self) -> float:
        """Communication the step waits for (tp's), on top of the longer of compute and the overlapped rest."""
        return sum(c.seconds for c in self.collectives if c.exposed)

    @property
    def overlapped_s(self) -> float:
        return self.comm_s - self.exposed_s

    @property
    def verdict(self) -> str:
        if self.compute_s is None:
            return "unknown (no dense bf16 peak for this GPU)"
        return "communication-bound" if self.overlapped_s > self.compute_s else "compute-bound"


def ring_bytes(op: str, n: int, payload: int) -> int:
    """What one GPU sends in a ring collective over n GPUs (NCCL's bus-bandwidth factors)."""
    if n <= 1:
        return 0
    factor = 2 * (n - 1) / n if op == "all-reduce" else (n - 1) / n
    return int(round(factor * payload))


def link(f: Fabric, group: int, spans_nodes: bool) -> tuple[str, float]:
    """The slowest link a ring over `group` GPUs crosses."""
    if spans_nodes:
        return f"network ({f.network})", f.network_gbps
    node = f.node
    if node is None:
        raise ValueError(f"no intra-node figures for {f.gpu}")
    if group <= node.domain:
        return node.link, node.gbps
    return f"PCIe (beyond the {node.domain}-GPU {node.link} domain)", node.pcie


def matmul_params(m: ModelShape) -> tuple[int, int]:
    """(trainable, frozen) parameters that take part in a token's matmuls: all but the input embedding (a lookup) and
    the experts it is not routed to (ModelShape.active); a tied LM head still multiplies, so it counts once."""
    n = m.active - m.embedding + (m.embedding if m.tied else 0)  # a mixture of experts: the routed top_k only
    trainable = n if m.trainable == m.params else m.trainable
    return trainable, n - trainable


def flops_per_token(m: ModelShape, length: float, extra_forwards: tuple[tuple[str, float], ...] = (),
                    lora: bool = False) -> float:
    """Training FLOPs per token, the kind's extra forwards included (the run report's rule, metrics/flops.py)."""
    trainable, frozen = matmul_params(m)
    # flops_per_token's attention term is 12 x layers x heads x head_dim x length; heads x head_dim is q_dim
    return (flops.flops_per_token(trainable, frozen, m.layers, 1, m.q_dim, length)
            + flops.extra_forward_flops(dict(extra_forwards), trainable, frozen, lora, m.layers, 1, m.q_dim, length))


def extra_gathers(m: ModelShape, t: Topology, w: Work, name: str, gbps: float) -> list[Collective]:
    """Each extra full-sequence forward's all-gathers per step: every layer once per micro-batch, times the forwards
    per trained token (the module docstring); none for sampling, which is not modelled."""
    out = []
    for forward, per_token in w.extra_forwards:
        if forward == "generation" or per_token <= 0:
            continue
        payload = round(per_token * (w.accumulation * m.layers * m.layer_params * w.gather_bytes // t.tp))
        out.append(Collective(f"all-gather ({forward})", t.shard, payload, ring_bytes("all-gather", t.shard, payload),
                              name, gbps))
    return out


def reduced_params(m: ModelShape, t: Topology) -> int:
    """Gradient elements the step reduces (see the module docstring for FSDP1's whole flat units)."""
    if t.strategy in ("FSDP", "HSDP") and t.fsdp_version == 1 and m.trainable != m.params:
        outside = m.trainable - m.layer_trainable * m.layers  # trainable parameters in the root unit
        return (m.layer_params * m.layers if m.layer_trainable else 0) + (m.root_params if outside > 0 else 0)
    return m.trainable


def mesh_collectives(m: ModelShape, t: Topology, w: Work, f: Fabric) -> list[Collective]:
    """A mesh's own collectives per optimizer step, each group inside a node where the node holds tp x cp
    (accelerate's mesh puts tp innermost, then cp): context parallel's ring passes each layer's K and V chunks round
    the cp ranks, once in the forward and twice in the backward (K and V again, and their gradients), once more in
    a checkpointed layer's recompute where it re-runs attention (the full and every_k policies; ops saves
    attention's output); a ring pass sends (cp - 1)/cp of the row's K and V (as an all-gather does). Tensor
    parallel's all-reduces and logits all-gather as the module docstring counts them (measured on CPU), each
    2 (tp - 1)/tp (all-reduce) or (tp - 1)/tp (all-gather) of the GPU's tokens' (their 1/cp share) activations."""
    out = []
    rows = w.accumulation * w.micro_batch * w.max_length  # tokens of the rows a cp group shares, per step
    if t.cp > 1:
        passes = 3 * m.layers + (0 if w.attention_saved else w.recomputed(m.layers))
        payload = passes * rows * 2 * m.kv_dim // t.tp * w.activation
        name, gbps = link(f, t.cp * t.tp, spans_nodes=t.cp * t.tp > t.gpus)
        out.append(Collective("ring K/V (cp)", t.cp, payload, ring_bytes("all-gather", t.cp, payload), name, gbps))
    if t.tp > 1:
        local = rows // t.cp * m.hidden  # the GPU's tokens x hidden: one all-reduce's elements
        forward = 2 * (m.layers + w.recomputed(m.layers)) * w.activation  # o_proj, down_proj (and recomputed)
        backward = (m.layers * 5 + 2) * w.residual  # q, k, v, gate, up input gradients; embedding, LM head input
        payload = local * (forward + backward)
        name, gbps = link(f, t.tp, spans_nodes=t.tp > t.gpus)
        out.append(Collective("all-reduce (tp)", t.tp, payload, ring_bytes("all-reduce", t.tp, payload), name, gbps,
                              exposed=True))
        logits = rows // t.cp * m.vocab * w.activation  # the column-wise LM head's output, gathered whole
        out.append(Collective("all-gather logits (tp)", t.tp, logits, ring_bytes("all-gather", t.tp, logits), name,
                              gbps, exposed=True))
    return out


def estimate(m: ModelShape, t: Topology, w: Work, f: Fabric) -> Estimate:
    out: list[Collective] = []
    warnings: list[str] = []
    grads = reduced_params(m, t) * w.reduce_bytes // t.tp
    if t.strategy in ("FSDP", "HSDP") and t.shard > 1:
        spans = t.strategy == "FSDP" and t.nodes > 1  # 1-D FSDP over several nodes
        name, gbps = link(f, t.shard, spans)
        per_layer = 2 if t.reshard_after_forward else 1
        again = m.embedding if t.tp > 1 and not m.tied else 0  # transformers reshards it after the forward
        gathered = (w.accumulation * (per_layer * m.layers * m.layer_params + m.root_params + again) * w.gather_bytes
                    // t.tp)
        out.append(Collective("all-gather", t.shard, gathered, ring_bytes("all-gather", t.shard, gathered), name, gbps))
        out += extra_gathers(m, t, w, name, gbps)
        out.append(Collective("reduce-scatter", t.shard, grads, ring_bytes("reduce-scatter", t.shard, grads), name,
                              gbps))
        if spans and t.tp * t.cp > 1:
            pass  # a mesh's layout across nodes: mesh_lines.comms_warnings says what the launcher allows instead
        elif spans:
            warnings.append(
                f"one-dimensional FSDP across {t.nodes} nodes: every layer's all-gathers and the reduce-scatter cross "
                f"the network ({f.network_gbps:g} GB/s per GPU) instead of {f.node.link if f.node else 'the node'}. "
                "Fix: HSDP (shard within a node, replicate across nodes: accelerate_configs/hsdp_multinode.yaml)")
        elif f.node is not None and t.shard > f.node.domain:
            warnings.append(
                f"the shard group of {t.shard} GPUs is larger than the {f.node.domain}-GPU {f.node.link} domain of a "
                f"{f.gpu}: its collectives run over PCIe ({f.node.pcie:g} GB/s per GPU). Fix: a shard group of "
                f"{f.node.domain} (HSDP inside the node), or GPUs with a larger NVLink domain")
    if t.strategy == "HSDP":
        replicas = t.world // t.shard
        shard_grads = grads // t.shard
        name, gbps = link(f, replicas, spans_nodes=True)
        out.append(Collective("all-reduce", replicas, shard_grads, ring_bytes("all-reduce", replicas, shard_grads),
                              name, gbps))
    if t.strategy == "DDP" and t.world > 1:
        name, gbps = link(f, t.world, spans_nodes=t.nodes > 1)
        out.append(Collective("all-reduce", t.world, grads, ring_bytes("all-reduce", t.world, grads), name, gbps))
    out += mesh_collectives(m, t, w, f)
    fpt = flops_per_token(m, w.max_length, w.extra_forwards, w.lora)
    # a data-parallel rank's rows are computed by its tp x cp GPUs together
    compute = w.tokens * fpt / (t.tp * t.cp) / (f.peak_flops * w.mfu) if f.peak_flops else None
    return Estimate(out, compute, fpt, warnings)


def gb(n: float) -> str:
    return f"{n / 1e9:,.2f}"


def table(e: Estimate) -> str:
    rows = ["| collective | GPUs | payload per step (GB) | sent per GPU (GB) | link | GB/s per GPU | seconds |",
            "|---|---:|---:|---:|---|---:|---:|"]
    for c in e.collectives:
        rows.append(f"| {c.op}{' (exposed)' if c.exposed else ''} | {c.group} | {gb(c.payload)} | {gb(c.sent)} | "
                    f"{c.link} | {c.gbps:g} | {c.seconds:.3f} |")
    if not e.collectives:
        rows.append("| none (one GPU, or nothing sharded) | | | | | | 0.000 |")
    return "\n".join(rows)
