"""What `make plan --comms` and the memory plan count for a tensor-parallel mesh, measured on CPU: one forward and
backward of the tiny Mistral on tp 2 x dp_shard 2 (4 forked gloo ranks, train/tensor_parallel.py's setup, as the
pack's ranks load a tp model), the weights fp32 under bf16 autocast (the tp recipe's dtype: float32, bf16: true),
and again with a bf16 LoRA base, without and with LoRA dropout.

    python -m bench.tp_cpu_collectives        # ~40 s on 2 cores; writes bench/results/tp-cpu-collectives-<UTC>.json

Recorded on rank 0, forward and backward apart: every collective the step dispatches (op, dtype, shape, count), by
a TorchDispatchMode (DTensor's functional all-reduces and all-gathers, FSDP2's all-gathers and reduce-scatters); and
the distinct storages autograd saves in the forward that still hold bytes once it ends, the bf16 ones shaped like a
weight's 1/tp shard summed apart (autocast's copies of fp32 weights, kept for the backward; a bf16 LoRA base has
only its fp32 adapters' r-wide copies). Layer 1's are also listed by the module that saved them (the innermost one
running) and the op that made them: the LoRA count's tensor-by-tensor evidence. planning/comms.py and
memory_budget.py cite the figures; docs/planner.md ("Meshes") works them out by hand.
"""

from __future__ import annotations

import collections
import json
import os
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_recipes import api

TP, DP = 2, 2
ROWS, LENGTH = 3, 11  # 33 tokens: no activation shares a weight's shape
# (name, load dtype, LoRA dropout): the tp recipe's fp32 full fine-tune, a bf16 base with LoRA on every linear (its
# fp32 adapters under autocast), and the same with dropout (on CPU torch keeps the scaled noise in the input's dtype,
# fp32 here; a GPU's fused dropout keeps a bool mask)
KINDS = (("full_fp32", torch.float32, 0.0), ("lora_bf16_base", torch.bfloat16, 0.0),
         ("lora_bf16_base_dropout", torch.bfloat16, 0.05))


class Collectives(TorchDispatchMode):
    """Counts the c10d ops dispatched under it: (op, dtype, shape of the first tensor) -> calls."""

    def __init__(self):
        super().__init__()
        self.seen = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if "c10d" in name and "wait_tensor" not in name and "wrap_tensor" not in name:
            first = args[0]
            while isinstance(first, (list, tuple)):
                first = first[0]
            self.seen[(name, str(first.dtype), tuple(first.shape))] += 1
        return func(*args, **(kwargs or {}))

    def rows(self) -> list:
        return [[*key, n] for key, n in sorted(self.seen.items())]


def weight_shards(model) -> set[tuple[int, ...]]:
    """Each linear weight's shape on a tp rank (FSDP's dp shard gathered), and its transpose (a matmul saves W^T)."""
    from torch.distributed.tensor import DTensor

    shapes = set()
    for name, p in model.named_parameters():
        if p.dim() == 2:
            full = list(p.shape)
            placements = p.placements if isinstance(p, DTensor) else ()
            for mesh_dim, placement in enumerate(placements):  # the tp dimension's Shard divides by tp
                if placement.is_shard() and p.device_mesh.mesh_dim_names[mesh_dim] == "tp":
                    full[placement.dim] //= TP
            shapes |= {tuple(full), tuple(reversed(full))}
    return shapes


def rank_main(rank: int, world: int, port: int, model_dir: str, out: str) -> None:
    import torch.distributed as dist
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), ACCELERATE_USE_PARALLELISM_CONFIG="true",
                      PARALLELISM_CONFIG_TP_SIZE=str(TP), PARALLELISM_CONFIG_DP_SHARD_SIZE=str(DP))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    config = api.tensor_parallel_config(api.set_up_tensor_parallel())
    ids = torch.randint(4, 268, (ROWS, LENGTH), generator=torch.Generator().manual_seed(0))
    result = {"tokens_per_rank": ROWS * LENGTH, "tp": TP, "dp_shard": DP}
    for kind, dtype, dropout in KINDS:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, distributed_config=config)
        if kind.startswith("lora"):
            model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                     lora_dropout=dropout))
        shards, saved, where, inner = weight_shards(model), {}, ["root"], ["layer"]
        layers = model.base_model.model.model.layers if kind.startswith("lora") else model.model.layers
        for i, layer in enumerate(layers):  # which decoder layer each saved tensor is saved in
            layer.register_forward_pre_hook(lambda module, args, i=i: where.__setitem__(0, f"layer {i}"))
            layer.register_forward_hook(lambda module, args, out: where.__setitem__(0, "root"))
        for name, module in layers[1].named_modules():  # which module of layer 1 saves it: the innermost running
            if name:
                module.register_forward_pre_hook(lambda module, args, name=name: inner.append(name))
                module.register_forward_hook(lambda module, args, out: inner.pop() and None)

        def pack(t):
            from torch.distributed.tensor import DTensor

            local = t.to_local() if isinstance(t, DTensor) else t
            # one entry a storage: keyed by the storage itself, not its address, which a storage FSDP frees after a
            # layer's forward (resized to 0) hands on to a later tensor (that one was lost when keyed by address)
            saved.setdefault(local.untyped_storage()._cdata, (where[0], local, inner[-1]))
            return t

        forward, backward = Collectives(), Collectives()
        with forward, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        with backward:
            loss.backward()
        # after the forward: FSDP has freed its gathered parameters' storage (resized to 0), so what still holds
        # bytes is what autograd keeps; a weight-shaped bf16 one is a copy (fp32 weights) or the gathered bf16
        # parameter itself (a bf16 base: FSDP frees it, 0 bytes)
        copies = [t.untyped_storage().nbytes() for _, t, _ in saved.values()
                  if t.dtype == torch.bfloat16 and tuple(t.shape) in shards and t.untyped_storage().nbytes()]
        # the rest, per token: what a decoder layer keeps for its backward (layer 1: neither end), by dtype and
        # width (the last dimension), and what the root keeps (the final norm's, the LM head's, the loss's)
        activations, by_module = collections.defaultdict(collections.Counter), collections.defaultdict(dict)
        for place, t, module in saved.values():
            if t.untyped_storage().nbytes() and not (t.dtype == torch.bfloat16 and tuple(t.shape) in shards):
                key = f"{str(t.dtype).removeprefix('torch.')} x {t.shape[-1] if t.dim() else 1}"
                activations[place][key] += t.untyped_storage().nbytes() / (ROWS * LENGTH)
                if place == "layer 1":  # which module saved it, and what autograd recorded making it
                    made_by = type(t.grad_fn).__name__ if t.grad_fn is not None else "no grad_fn"
                    by_module[module][f"{key} ({made_by})"] = (by_module[module].get(f"{key} ({made_by})", 0)
                                                               + t.untyped_storage().nbytes() / (ROWS * LENGTH))
        result[kind] = {"forward": forward.rows(), "backward": backward.rows(),
                        "bf16_weight_copies_saved": len(copies), "bf16_weight_copy_bytes": sum(copies),
                        "layer_1_activations_per_token": dict(sorted(activations["layer 1"].items())),
                        "layer_1_activation_bytes_per_token": sum(activations["layer 1"].values()),
                        "layer_1_activations_per_token_by_module": dict(sorted(by_module.items())),
                        "root_activations_per_token": dict(sorted(activations["root"].items()))}
    if rank == 0:
        Path(out).write_text(json.dumps(result, indent=1) + "\n")
    dist.destroy_process_group()


def main() -> int:
    import torch.multiprocessing as mp

    model_dir = str(api.ensure_tiny_assets(quiet=True)["model"])
    stamp = time.strftime("%Y-%m-%dT%H%MZ", time.gmtime())
    out = Path(__file__).parent / "results" / f"tp-cpu-collectives-{stamp}.json"
    mp.start_processes(rank_main, args=(TP * DP, api.free_port(), model_dir, str(out)), nprocs=TP * DP,
                       start_method="fork")
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
