"""Issue 43's GPU step (issue 45's plan, `scripts/device_run.sh qlora`): the 4-bit path on one CUDA GPU, within a
budget it keeps itself.

    python -m bench.qlora_gpu --results DIR --deadline-s 50        # on the GPU machine
    python -m bench.qlora_gpu --dry-run --results DIR             # on CPU: tiny shapes, plumbing only

Two parts, run side by side (the launch is a process of its own; the layer probe runs here meanwhile):

1. **layers** (priority 2 of issue 45: the planner against torch.cuda.max_memory_allocated): Llama 3.1 70B's
   layer shapes from recipes/llama-3.1-70b-qlora-2xh100 (its model_config.json, the published shape) at 1 and 2
   decoder layers, random weights, on one GPU. Every decoder linear becomes bitsandbytes' NF4 Linear4bit (bf16
   storage, nested scales, as the recipe loads it), LoRA r16 on the seven projections in bf16, activation
   checkpointing, AdamW; one step on the recipe's micro-batch (2 sequences of 4096 random tokens). Measured per
   layer count: the bytes the parameters and 4-bit scales hold (counted), torch's allocated bytes before the step and
   its peak through it. The difference between 2 layers and 1 is one layer's cost, put beside the planner's (the same
   budget for 2 layers less for 1: weights, gradients, optimizer states and activations of one layer; what the LM
   head and the rest cost is the same in both and cancels). No FSDP: one GPU, world size 1.
2. **default-4bit** (priority 1: the launch path on CUDA): recipes/smollm2-135m-qlora through the real launcher on
   the GPUs there are (one process per GPU up to 2, bf16, so a bf16 4-bit storage), SmolLM2-135M's architecture
   with random weights (first_contact.py's, no model download), 12 steps, the memory probe; checked: exit 0,
   completed, CUDA, the storage the pack set, the final save, merged/ written from the dequantised base, and the
   planner's estimate beside max_memory_allocated (first_contact.memory_truth).

Both stop inside --deadline-s (the launch is killed, its part recorded as "not finished"), and the JSON is written
after each part: qlora-gpu-<device>-<UTC time>.json in --results. The dry run (`--dry-run`) runs part 1 with tiny
shapes on CPU (counted bytes only: no device memory) and builds part 2's command without launching it (the 4-bit
launch path on CPU is tests/test_qlora.py's); a few seconds once the libraries are imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAYERS_RECIPE = "llama-3.1-70b-qlora-2xh100"
DEFAULT_4BIT = "smollm2-135m-qlora"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
DRY_TOKENS = (2, 64)  # the dry run's micro-batch: 2 sequences of 64 tokens


def recipe_settings():
    """(the 70B recipe's parsed config, its model config): LoRA, 4-bit and batch settings as the run reads them."""
    from fsdp_recipes.api import load_recipe, model_config, parse_args

    loaded = load_recipe(REPO / "recipes" / LAYERS_RECIPE, ["--use_cpu", "true"])  # parsed here, not on a GPU
    cfg = parse_args(loaded.argv(), loaded.raw, world_size=1)
    return cfg, model_config(REPO / "recipes" / LAYERS_RECIPE / "model_config.json")


def shaped(config, layers: int, dry: bool):
    """The recipe's model config at `layers` decoder layers; the dry run's tiny one (launch/smoke.py's shrink)."""
    import copy

    config = copy.deepcopy(config)
    if dry:
        from transformers import AutoTokenizer

        from fsdp_recipes.api import ensure_tiny_assets, shrink_model_config

        config = shrink_model_config(config, AutoTokenizer.from_pretrained(ensure_tiny_assets(quiet=True)["model"]))
    config.num_hidden_layers = layers
    return config


def quantize_decoder(model, nested: bool, device: str) -> None:
    """Every linear of the decoder layers as bitsandbytes' NF4 Linear4bit with bf16 storage and compute, quantized
    from its own weights on `device`, as transformers' bitsandbytes quantizer loads a recipe with load_in_4bit (the
    LM head and embeddings stay bf16)."""
    import bitsandbytes as bnb
    import torch

    for layer in model.model.layers:
        for name, lin in list(layer.named_modules()):
            if not isinstance(lin, torch.nn.Linear):
                continue
            q = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=lin.bias is not None,
                                  compute_dtype=torch.bfloat16, compress_statistics=nested, quant_type="nf4",
                                  quant_storage=torch.bfloat16, device="meta")
            q.weight = bnb.nn.Params4bit(lin.weight.data, requires_grad=False, quant_type="nf4",
                                         compress_statistics=nested, quant_storage=torch.bfloat16).to(device)
            parent, _, leaf = name.rpartition(".")
            setattr(layer.get_submodule(parent) if parent else layer, leaf, q)


def counted_bytes(model) -> dict[str, int]:
    """What the model's tensors hold, counted: 4-bit storage, its scales (absmax, and nested the absmax of those and
    the code books), and everything else by dtype."""
    import bitsandbytes as bnb

    out = {"packed_4bit": 0, "scales": 0, "other": 0, "trainable": 0}
    for p in model.parameters():
        size = p.numel() * p.element_size()
        if isinstance(p, bnb.nn.Params4bit):
            out["packed_4bit"] += size
            state = p.quant_state
            parts = [state.absmax, state.code]
            if state.nested:
                parts += [state.offset, state.state2.absmax, state.state2.code]
            out["scales"] += sum(t.numel() * t.element_size() for t in parts if t is not None)
        elif p.requires_grad:
            out["trainable"] += size
        else:
            out["other"] += size
    return out


def probe_layers(cfg, config, layers: int, dry: bool, device: str) -> dict:
    """One model of `layers` decoder layers in 4 bits with the recipe's LoRA: its counted bytes, torch's allocated
    bytes before one training step and the peak through it (CUDA; None on CPU), the step's loss and seconds."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model_args, training = cfg.model, cfg.training
    batch, length = DRY_TOKENS if dry else (training.per_device_train_batch_size, training.max_length)
    cuda = device == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base_alloc = torch.cuda.memory_allocated()
    torch.manual_seed(0)
    t0 = time.time()
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(shaped(config, layers, dry), dtype=torch.bfloat16)
    quantize_decoder(model, bool(model_args.use_bnb_nested_quant), device)
    model = get_peft_model(model, LoraConfig(r=model_args.lora_r, lora_alpha=model_args.lora_alpha,
                                             lora_dropout=model_args.lora_dropout,
                                             target_modules=list(model_args.lora_target_modules)))
    for p in model.parameters():  # TRL keeps a 4-bit model's adapters in bf16
        if p.requires_grad:
            p.data = p.data.to(torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    built_s = time.time() - t0
    before = torch.cuda.memory_allocated() - base_alloc if cuda else None
    ids = torch.randint(0, model.config.vocab_size, (batch, length), device=device)
    t0 = time.time()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=False)  # the gradients' memory stays counted, as in a run between steps
    if cuda:
        torch.cuda.synchronize()
    result = {"layers": layers, "tokens": batch * length, "counted_bytes": counted_bytes(model),
              "allocated_before_step_bytes": before,
              "peak_allocated_bytes": torch.cuda.max_memory_allocated() - base_alloc if cuda else None,
              "loss": float(loss.detach()), "build_s": round(built_s, 2), "step_s": round(time.time() - t0, 2)}
    del model, opt, loss
    if cuda:
        torch.cuda.empty_cache()
    return result


def planned(cfg, config, layers: int, dry: bool) -> dict[str, int]:
    """The planner's budget for the probe: one GPU, no FSDP, bf16 compute, the probe's micro-batch."""
    from fsdp_recipes.api import Setup, budget, four_bit_planner_setup, meta_model, model_shape

    shape = model_shape(meta_model(shaped(config, layers, dry)), cfg.model)
    batch, length = DRY_TOKENS if dry else (cfg.training.per_device_train_batch_size, cfg.training.max_length)
    setup = Setup(shard=1, world=1, strategy="single", load_bytes=2, compute_bytes=2,
                  mixed_precision=True, tokens=batch * length, checkpointed=True,
                  optimizer_bytes=8, runtime_bytes=0, **four_bit_planner_setup(cfg.model, None))
    return budget(shape, setup)


def per_layer(probes: list[dict], plans: list[dict]) -> dict:
    """One layer's cost: the 2-layer figures less the 1-layer ones, measured and planned, and their ratio."""
    one, two = probes
    p1, p2 = plans

    def diff(a, b):
        return None if a is None or b is None else b - a

    weights = diff(p1["weights"], p2["weights"])
    static = {k: two["counted_bytes"][k] - one["counted_bytes"][k] for k in one["counted_bytes"]}
    counted = sum(static.values())
    out = {"counted_bytes": static, "counted_total_bytes": counted, "planned_weights_bytes": weights,
           "counted_vs_planned_weights": counted / weights - 1 if weights else None,
           "planned_bytes": {k: p2[k] - p1[k] for k in p1}}
    peak = diff(one["peak_allocated_bytes"], two["peak_allocated_bytes"])
    planned_total = p2["total"] - p1["total"]
    out.update(measured_peak_bytes=peak, planned_total_bytes=planned_total,
               peak_vs_planned=(peak / planned_total - 1) if peak and planned_total else None,
               measured_before_step_bytes=diff(one["allocated_before_step_bytes"], two["allocated_before_step_bytes"]))
    return out


def default_command(work: Path, build: bool = True) -> list[str]:
    """The launch of part 2: the 4-bit default on the GPUs there are, random SmolLM2-135M weights (built unless
    `build` is off: the dry run names the folder only), 12 steps."""
    from bench.first_contact import launcher_cmd, random_smollm2

    model = random_smollm2(work) if build else work / "smollm2-135m-random"
    return launcher_cmd(DEFAULT_4BIT, "--model_name_or_path", str(model), "--max_steps", "12", "--logging_steps", "1",
                        "--measure_memory", "true", "--output_dir", str(work / "default-4bit"))


def judge_default(out: Path, rc: int | None) -> dict:
    """Part 2's verdicts from the run's own files (tests/test_bench_gpu.py checks them on written ones)."""
    from bench.first_contact import item, memory_truth, read_json, run_items

    metrics, run_args = read_json(out / "metrics.json"), read_json(out / "run_args.json")
    items = run_items("default in 4 bits", rc, metrics, run_args, on_gpu=True)
    args = (run_args or {}).get("model_args") or {}
    sft = (run_args or {}).get("sft_config") or {}
    items.append(item("default in 4 bits: bf16 storage under bf16",
                      args.get("load_in_4bit") is True and args.get("bnb_4bit_quant_storage") == "bfloat16"
                      and sft.get("bf16") is True,
                      f"load_in_4bit {args.get('load_in_4bit')}, storage {args.get('bnb_4bit_quant_storage')}, "
                      f"bf16 {sft.get('bf16')}"))
    merged = read_json(out / "merged" / "config.json") or {}
    items.append(item("default in 4 bits: merged/ is a plain model (the dequantised base + adapter)",
                      bool(merged) and "quantization_config" not in merged, f"merged config keys: {sorted(merged)[:8]}"))
    facts = {}
    if metrics:
        try:
            facts["memory_truth"] = memory_truth(run_args or {}, metrics, read_json(out / "memory_probe.rank0.json"),
                                                 metrics.get("world_size") or 1, True)
        except Exception as err:  # noqa: BLE001  a figure missing is reported, never fatal to the verdicts
            facts["memory_truth"] = {"error": f"{type(err).__name__}: {err}"}
        facts.update({k: metrics.get(k) for k in ("world_size", "steps", "wall_clock_s", "train_time_s",
                                                  "tokens_per_second_per_device", "mfu", "peak_memory")})
    return {"items": items, **facts}


def run(argv: list[str] | None = None) -> tuple[dict, Path]:
    from bench.gpu import layer_probe_record, layer_probe_start

    args, results, start = layer_probe_start(
        "qlora_gpu", __doc__, argv, "seconds for both parts (default 50)", "on CPU, tiny shapes, no launch: plumbing only",
        more=lambda ap: ap.add_argument("--work", type=Path, default=None,
                                        help="the launch's model and run (default: under --results)"))
    dry = args.dry_run
    work = args.work or results / "qlora-gpu-work"
    work.mkdir(parents=True, exist_ok=True)
    result, path, save = layer_probe_record("qlora_gpu", dry, results, start, deadline_s=args.deadline_s,
                                            layers=None, default_4bit=None)

    launch = None
    cmd = default_command(work, build=not dry)
    result["default_4bit"] = {"command": " ".join(cmd[1:])}
    if dry:
        result["default_4bit"]["status"] = "not launched: dry run (the 4-bit launch path on CPU is tests/test_qlora.py's)"
    else:  # started first: its imports and NCCL set-up overlap the layer probe
        env = dict(os.environ, PYTHONUNBUFFERED="1", FSDP_RECIPES_SUMMARY_GENERATIONS="0")
        log = open(work / "default-4bit.log", "w")
        launch = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                  start_new_session=True)
    try:
        cfg, config = recipe_settings()
        dev = "cpu" if dry else "cuda"
        probes, plans = [], []
        for layers in (1, 2):
            probes.append(probe_layers(cfg, config, layers, dry, dev))
            plans.append(planned(cfg, config, layers, dry))
        result["layers"] = {"recipe": LAYERS_RECIPE, "shape": "dry run: tiny" if dry else "published Llama 3.1 70B",
                            "probes": probes, "planned": plans, "per_layer": per_layer(probes, plans)}
    except Exception as err:  # noqa: BLE001  the other part still reports
        result["layers"] = {"error": f"{type(err).__name__}: {err}"}
    save()
    if launch is not None:
        import signal

        try:
            rc = launch.wait(timeout=max(1.0, args.deadline_s - (time.time() - start)))
        except subprocess.TimeoutExpired:
            os.killpg(launch.pid, signal.SIGKILL)
            launch.wait()
            rc = None
        result["default_4bit"].update(status="finished" if rc is not None else "not finished: --deadline-s",
                                      returncode=rc, **judge_default(work / "default-4bit", rc))
        save()
    return result, path


def main(argv: list[str] | None = None) -> int:
    result, path = run(argv)
    layers = result["layers"] or {}
    print(json.dumps({"per_layer": layers.get("per_layer"), "error": layers.get("error"),
                      "default_4bit": {k: v for k, v in (result["default_4bit"] or {}).items() if k != "items"}},
                     indent=1, default=str))
    for it in (result["default_4bit"] or {}).get("items", []):
        print(f"{it['result']:>5}  {it['item']}: {it['detail'][:160]}")
    print(f"written: {path}")
    failed = "error" in layers or any(it["result"] == "FAIL" for it in (result["default_4bit"] or {}).get("items", []))
    return 1 if failed or (result["default_4bit"] or {}).get("returncode", 0) is None else 0


if __name__ == "__main__":
    sys.exit(main())
