"""`make plan --fit`'s mesh: when FSDP over the node does not fit, because a row is too long for one GPU's
activations or a layer's share too large, the smallest job and mesh (dp_shard x tp x cp, config/mesh.py) that does.

The budget is the plain plan's (memory_budget.budget) with the mesh's fields: the FSDP group is dp_shard x cp
(accelerate shards over dp_shard_cp), tp splits every layer's weights and heads, cp each row's tokens. Candidates,
searched in this order, the first that fits answering:
    GPUs: one node, then 2, 3, ... nodes of `per_node` GPUs (fewest GPUs first)
    tp x cp: the smallest product first (each split adds communication: comms.py's ring hops and all-reduces), cp
        before tp at the same product (cp's K/V hops are smaller than tp's activation all-reduces for GQA models)
    tp: a divisor of the attention heads and the key/value heads (each rank whole heads), at most a node (tp's
        all-reduces stay on NVLink); cp: max_length a multiple of 2 x cp (torch's load balancing), tp x cp at most
        a node
"""

from __future__ import annotations

import dataclasses

from fsdp_recipes.planning.memory_budget import GIB, ModelShape, Setup, budget

SPLITS = (1, 2, 4, 8, 16, 32)


@dataclasses.dataclass(frozen=True)
class MeshAnswer:
    nodes: int
    per_node: int
    tp: int
    cp: int
    total: int  # bytes per GPU

    @property
    def world(self) -> int:
        return self.nodes * self.per_node

    @property
    def dp_shard(self) -> int:
        return self.world // (self.tp * self.cp)

    def describe(self) -> str:
        return (f"NODES={self.nodes} GPUS={self.per_node}: dp_shard {self.dp_shard} x tp {self.tp} x cp {self.cp} "
                f"({self.total / GIB:,.1f} GiB per GPU)")


def meshed(s: Setup, world: int, tp: int, cp: int) -> Setup:
    return dataclasses.replace(s, strategy="FSDP", world=world, shard=world // tp, tp=tp, cp=cp)


def splits(per_node: int, heads: int, kv_heads: int, max_length: int) -> list[tuple[int, int]]:
    """(tp, cp) pairs a node can hold, in the search's order."""
    pairs = [(tp, cp) for tp in SPLITS for cp in SPLITS
             if tp * cp <= per_node and per_node % (tp * cp) == 0 and heads % tp == 0 and kv_heads % tp == 0
             and max_length % (2 * cp if cp > 1 else 1) == 0]
    return sorted(pairs, key=lambda p: (p[0] * p[1], p[0]))


def propose(m: ModelShape, s: Setup, usable: float, per_node: int, heads: int, kv_heads: int, max_length: int,
            max_nodes: int = 128) -> MeshAnswer | None:
    """The first mesh in the search's order whose budget fits `usable` bytes per GPU; None up to max_nodes."""
    for nodes in range(1, max_nodes + 1):
        world = nodes * per_node
        for tp, cp in splits(per_node, heads, kv_heads, max_length):
            total = budget(m, meshed(s, world, tp, cp))["total"]
            if total <= usable:
                return MeshAnswer(nodes, per_node, tp, cp, total)
    return None


def accelerate_keys(a: MeshAnswer) -> str:
    """The recipe's accelerate YAML for it (config/mesh.py reads these keys)."""
    return (f"parallelism_config: {{parallelism_config_dp_shard_size: {a.dp_shard}, parallelism_config_tp_size: "
            f"{a.tp}, parallelism_config_cp_size: {a.cp}}}")
