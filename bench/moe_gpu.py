"""Issue 59's GPU step (`scripts/device_run.sh moe`): the mixture-of-experts recipe's layer on one CUDA GPU with
grouped experts, against the planner, within a budget it keeps itself.

    python -m bench.moe_gpu --results DIR --deadline-s 50        # on the GPU machine
    python -m bench.moe_gpu --dry-run --results DIR             # on CPU: tiny shapes, plumbing only

Qwen3-30B-A3B's published shape (recipes/qwen3-30b-a3b-lora/model_config.json: hidden 2,048, 128 experts of 768,
8 per token) at 1 and 2 decoder layers, random bf16 weights, LoRA r16 on the attention and on both fused expert
tensors (PEFT's target_parameters: the merged copy the planner counts as `lora merged copies`), the adapters in fp32
under bf16 autocast (as accelerate upcasts them under FSDP's mixed precision), experts computed by `grouped_mm`
(speed/experts.py's pick on CUDA 8.0+), no activation checkpointing (so that every layer's MoE activations and merged
copy are held), AdamW; one step of the recipe's micro-batch (4 sequences of 4,096 random tokens). The loss is the
final hidden states' mean square: no LM head (its 151,936-entry logits are the same at 1 and 2 layers and would only
cost memory). Measured per layer count: torch's allocated bytes before the step and its peak through it, and in the
last layer's MoE block the bytes autograd saves (distinct storages: the activations the grouped kernel keeps, and
the merged copies of the experts). The 2-layer figures less the 1-layer ones are one layer's cost, put beside the
planner's: its budget for 2 layers less for 1 (weights, gradients, optimizer states, activations, merged copies).
Then one step's time with grouped_mm against eager (the per-expert loop) on the 1-layer model.

The JSON (moe-gpu-<device>-<UTC time>.json in --results) is written after each part. The dry run runs the same on CPU
with launch/smoke.py's tiny Qwen3-MoE, 8 experts of 32 (2 sequences of 64 tokens; no device memory, so the saved bytes and the counted
weights are what it compares); a few seconds once the libraries are imported. Not yet run on a GPU.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
RECIPE = "qwen3-30b-a3b-lora"
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
DRY_TOKENS = (2, 64)


def lora_args(rank: int = 16):
    """The recipe's LoRA (r 16, alpha 32) with the experts too, dropout 0 (PEFT refuses it on parameters)."""
    return SimpleNamespace(use_peft=True, lora_r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                           lora_target_modules=ATTENTION, lora_target_parameters=EXPERTS, lora_modules_to_save=None)


def shaped(layers: int, dry: bool):
    """The recipe's model config at `layers` decoder layers; the dry run's tiny one (launch/smoke.py's shrink)."""
    from fsdp_recipes.api import model_config

    config = model_config(REPO / "recipes" / RECIPE / "model_config.json")
    if dry:
        from transformers import AutoTokenizer

        from fsdp_recipes.api import ensure_tiny_assets, shrink_model_config

        config = shrink_model_config(config, AutoTokenizer.from_pretrained(ensure_tiny_assets(quiet=True)["model"]))
        config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size = 8, 2, 32  # eager: seconds
    config.num_hidden_layers = layers
    return config


def build(layers: int, dry: bool, device: str, kernel: str):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    args = lora_args()
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(shaped(layers, dry), dtype=torch.bfloat16,
                                                 experts_implementation=kernel)
    model = get_peft_model(model, LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=0.0,
                                             target_modules=ATTENTION, target_parameters=EXPERTS))
    for p in model.parameters():  # fp32 masters of the adapters, as accelerate upcasts trainable parameters
        if p.requires_grad:
            p.data = p.data.float()
    return model


def one_step(model, batch: int, length: int, device: str, saved: dict | None = None) -> float:
    """Forward (bf16 autocast), backward and AdamW on random tokens; `saved`: what autograd keeps in the last
    layer's MoE block, by distinct storage, parameters excluded: {storage: (bytes, kind)}. Kinds, told apart by
    size: "copy", 3-D with a whole expert tensor's elements (a merged copy of the experts; the kernels' transposed
    view of it counts whole); "factor", 3-D and r wide (PEFT's LoRA factors cast to bf16 for the merge); else
    "activation"."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    c = model.config  # gate_up (experts, 2 x intermediate, hidden), down (experts, hidden, intermediate)
    whole = {c.num_experts * 2 * c.moe_intermediate_size * c.hidden_size,
             c.num_experts * c.hidden_size * c.moe_intermediate_size}
    hooks = []
    if saved is not None:
        def pack(t):
            storage = t.untyped_storage()
            if storage.data_ptr() not in params:
                kind = "activation" if t.dim() != 3 else "copy" if t.numel() in whole else "factor"
                saved[storage.data_ptr()] = (storage.nbytes(), kind)
            return t

        context = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        block = model.base_model.model.model.layers[-1].mlp
        hooks = [block.register_forward_pre_hook(lambda *a: context.__enter__()),
                 block.register_forward_hook(lambda *a: context.__exit__(None, None, None))]
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(0, model.config.vocab_size, (batch, length), device=device)
    t0 = time.time()
    with torch.autocast(device, dtype=torch.bfloat16):
        hidden = model.base_model.model.model(input_ids=ids).last_hidden_state
    loss = hidden.float().pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=False)  # the gradients stay counted, as in a run between steps
    if device == "cuda":
        torch.cuda.synchronize()
    for h in hooks:
        h.remove()
    return time.time() - t0


def probe(layers: int, dry: bool, device: str) -> dict:
    """A model of `layers` layers: counted bytes, torch's allocated bytes before the step and its peak (CUDA), the
    bytes saved in the last MoE block (the merged copies apart), the kernel that ran."""
    import torch

    batch, length = DRY_TOKENS if dry else (4, 4096)
    cuda = device == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    model = build(layers, dry, device, "grouped_mm")
    before = torch.cuda.memory_allocated() - base if cuda else None
    saved: dict = {}
    seconds = one_step(model, batch, length, device, saved)
    merged = sorted(n for n, kind in saved.values() if kind == "copy")
    result = {"layers": layers, "tokens": batch * length, "kernel": model.config._experts_implementation,
              "counted_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
              "allocated_before_step_bytes": before,
              "peak_allocated_bytes": torch.cuda.max_memory_allocated() - base if cuda else None,
              "block_saved_bytes": sum(n for n, kind in saved.values() if kind == "activation"),
              "block_lora_factor_bytes": sum(n for n, kind in saved.values() if kind == "factor"),
              "block_merged_copies_bytes": merged,
              "step_s": round(seconds, 3)}
    del model
    if cuda:
        torch.cuda.empty_cache()
    return result


def planned(layers: int, dry: bool) -> tuple[dict, dict]:
    """The planner's budget for the probe (one GPU, no FSDP, bf16 compute, fp32 adapters, no checkpointing) and its
    per-token MoE activation term for one layer."""
    import dataclasses

    from fsdp_recipes.api import Setup, activations_per_token_per_layer, budget, meta_model, model_shape

    shape = model_shape(meta_model(shaped(layers, dry)), lora_args())
    batch, length = DRY_TOKENS if dry else (4, 4096)
    setup = Setup(shard=1, world=1, strategy="single", load_bytes=2, compute_bytes=2,
                  mixed_precision=True, tokens=batch * length, checkpointed=False, optimizer_bytes=8, runtime_bytes=0)
    dense_rest = dataclasses.replace(shape, experts=0, top_k=0, intermediate=0, lora_rank_width=0)
    moe_per_token = (activations_per_token_per_layer(shape, setup)
                     - activations_per_token_per_layer(dense_rest, setup))
    terms = {"moe_block_bytes_per_token": moe_per_token, "merged_copy_bytes": shape.merged_copy * 2}
    return budget(shape, setup), terms


def per_layer(probes: list[dict], plans: list[dict], terms: dict) -> dict:
    """One layer: the 2-layer figures less the 1-layer ones, measured and planned; the MoE block's saved bytes per
    token against the planner's term; its merged copies against the planner's copy."""
    one, two = probes
    p1, p2 = plans

    def diff(a, b):
        return None if a is None or b is None else b - a

    peak, planned_total = diff(one["peak_allocated_bytes"], two["peak_allocated_bytes"]), p2["total"] - p1["total"]
    block = two["block_saved_bytes"] / two["tokens"]
    return {"planned_bytes": {k: p2[k] - p1[k] for k in p1}, "counted_bytes": two["counted_bytes"] - one["counted_bytes"],
            "measured_peak_bytes": peak, "planned_total_bytes": planned_total,
            "peak_vs_planned": peak / planned_total - 1 if peak and planned_total else None,
            "measured_before_step_bytes": diff(one["allocated_before_step_bytes"], two["allocated_before_step_bytes"]),
            "moe_block_saved_bytes_per_token": block,
            "moe_block_planned_bytes_per_token": terms["moe_block_bytes_per_token"],
            "moe_block_vs_planned": block / terms["moe_block_bytes_per_token"] - 1,
            "merged_copies_bytes": sum(two["block_merged_copies_bytes"]),
            "merged_copy_planned_bytes": terms["merged_copy_bytes"]}


def run(argv: list[str] | None = None) -> tuple[dict, Path]:
    from bench.gpu import layer_probe_record, layer_probe_start

    args, results, start = layer_probe_start("moe_gpu", __doc__, argv, "seconds for every part (default 50)",
                                             "on CPU, tiny shapes: plumbing only")
    dry = args.dry_run
    results.mkdir(parents=True, exist_ok=True)
    result, path, save = layer_probe_record(
        "moe_gpu", dry, results, start, recipe=RECIPE, shape="dry run: tiny" if dry else "published Qwen3-30B-A3B",
        deadline_s=args.deadline_s, layers=None, kernels=None)
    dev = "cpu" if dry else "cuda"
    try:
        probes, plans = [], []
        for layers in (1, 2):
            probes.append(probe(layers, dry, dev))
            plan_, terms = planned(layers, dry)
            plans.append(plan_)
        result["layers"] = {"probes": probes, "planned": plans, "per_layer": per_layer(probes, plans, terms)}
    except Exception as err:  # noqa: BLE001  the timing part still reports
        result["layers"] = {"error": f"{type(err).__name__}: {err}"}
    save()
    timings = {}
    batch, length = DRY_TOKENS if dry else (4, 4096)
    for kernel in ("grouped_mm", "eager"):
        if time.time() - start > args.deadline_s - 10:
            timings[kernel] = "not run: --deadline-s"
            continue
        try:
            model = build(1, dry, dev, kernel)
            one_step(model, batch, length, dev)  # warm-up
            timings[kernel] = {"ran": model.config._experts_implementation,
                               "step_s": round(one_step(model, batch, length, dev), 4)}
            del model
        except Exception as err:  # noqa: BLE001
            timings[kernel] = f"{type(err).__name__}: {err}"
    result["kernels"] = timings
    save()
    return result, path


def main(argv: list[str] | None = None) -> int:
    result, path = run(argv)
    layers = result["layers"] or {}
    print(json.dumps({"per_layer": layers.get("per_layer"), "error": layers.get("error"),
                      "kernels": result["kernels"]}, indent=1, default=str))
    print(f"written: {path}")
    return 1 if "error" in layers or any(isinstance(v, str) and not v.startswith("not run")
                                         for v in (result["kernels"] or {}).values()) else 0


if __name__ == "__main__":
    sys.exit(main())
