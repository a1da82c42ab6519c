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
    launchable: a candidate the launcher would refuse (config/mesh.py's check_mesh and check_mesh_fits: cp for SFT
        only, tp not beside cp, tp not beside LoRA's modules_to_save or fsdp_config's checkpointing and offload) is
        skipped; a cp mesh is checked with the recipe keys it needs (cp_recipe_keys), which the answer names
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Callable

from fsdp_recipes.config import mesh
from fsdp_recipes.errors import UserError
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
            max_nodes: int = 128, launchable: Callable[[int, int, int], bool] | None = None) -> MeshAnswer | None:
    """The first mesh in the search's order whose budget fits `usable` bytes per GPU; None up to max_nodes.
    `launchable(world, tp, cp)`: whether the launcher would start that mesh (refusal below); None: any."""
    for nodes in range(1, max_nodes + 1):
        world = nodes * per_node
        for tp, cp in splits(per_node, heads, kv_heads, max_length):
            if launchable is not None and not launchable(world, tp, cp):
                continue
            total = budget(m, meshed(s, world, tp, cp))["total"]
            if total <= usable:
                return MeshAnswer(nodes, per_node, tp, cp, total)
    return None


def accelerate_keys(a: MeshAnswer) -> str:
    """The recipe's accelerate YAML for it (config/mesh.py reads these keys)."""
    return (f"parallelism_config: {{parallelism_config_dp_shard_size: {a.dp_shard}, parallelism_config_tp_size: "
            f"{a.tp}, parallelism_config_cp_size: {a.cp}}}")


def cp_recipe_keys(training, cp: int) -> dict:
    """The recipe (SFT) keys a cp mesh needs (config/mesh.check_context_parallel): whole padded rows, padded to a
    multiple of 2 x cp; padding_free named only where the recipe turns it on."""
    keys = {"packing": False, "pad_to_multiple_of": 2 * cp}
    if getattr(training, "padding_free", False):
        keys["padding_free"] = False
    return keys


def recipe_keys(training, cp: int) -> str:
    keys = cp_recipe_keys(training, cp)
    return ", ".join(f"{k}: {str(v).lower() if isinstance(v, bool) else v}" for k, v in keys.items())


def refusal(acc: dict, cfg, world: int, tp: int, cp: int, heads: int, kv_heads: int, max_length: int,
            replicate: int = 1) -> str | None:
    """The launcher's one line against the recipe on a dp_shard x tp x cp mesh of `world` GPUs (config/mesh.py's
    checks, as launch/checks.py runs them), with a cp mesh's recipe keys applied; None when it would start.
    `replicate`: HSDP's dp_replicate (the mesh replicated over that many shard groups)."""
    path = "accelerate.yaml"
    sizes = {f"{mesh.PREFIX}dp_shard_size": world // (replicate * tp * cp), f"{mesh.PREFIX}tp_size": tp,
             f"{mesh.PREFIX}cp_size": cp}
    if replicate > 1:
        sizes[f"{mesh.PREFIX}dp_replicate_size"] = replicate
    proposed = dict(acc, distributed_type="FSDP", parallelism_config=sizes)
    recipe = cfg
    if cfg is not None and cp > 1:  # checked as the answer proposes it: the cp keys set
        recipe = SimpleNamespace(trainer=cfg.trainer, model=cfg.model,
                                 training=SimpleNamespace(**cp_recipe_keys(cfg.training, cp)))
    try:  # on_gpus: the planned GPUs run the ring form, whatever this machine has
        mesh.check_mesh_fits(mesh.check_mesh(proposed, path, world), path, heads, kv_heads, max_length, recipe,
                             on_gpus=True)
    except UserError as err:
        return str(err)
    return None
