"""GPU benchmark ladder: tokens/s per GPU, MFU and peak memory of fine-tuning, rung by rung.

    python -m bench.gpu [--sizes 1b,8b] [--gpus 1,all] [--methods full,lora] [--results bench/results]
    python -m bench.gpu --dry-run      # the same ladder on CPU, tiny model: plumbing only

UNTESTED ON A GPU. This module has only run in `--dry-run` mode, on a 2-core CPU machine. Its GPU path (bf16,
NCCL, Liger, inductor, float8, the memory figures) has never run; until a GPU session runs it, no GPU figure
exists, and none is written anywhere in this repository.

What runs. A Mistral (MistralForCausalLM) built from a config with random weights, nothing downloaded, saved once
per size with save_pretrained (bf16) and loaded by every rung from those files:

- `1b`: hidden 2048, intermediate 8192, 16 layers, 32 heads (8 key/value heads, head_dim 64), vocabulary 32768,
  untied embeddings: 1,107,363,840 parameters (1,040,254,976 without the input embedding, which is what the FLOPs
  count uses).
- `8b`: Ministral-8B's shape, hidden 4096, intermediate 12288, 36 layers, 32 heads (8 key/value, head_dim 128),
  vocabulary 131072, untied: 8,019,808,256 parameters (7,482,937,344 without the input embedding).
- `llama3-8b`: Llama-3-8B's shape, hidden 4096, intermediate 14336, 32 layers, 32 heads (8 key/value, head_dim 128),
  vocabulary 128256, untied, rope theta 500000: 8,030,261,248 parameters, the anchor's model (issue 45: NeMo
  Automodel's Llama-3-8B LoRA at sequence 4096, 12,473 tokens/s/GPU). Mistral's module layout is Llama's.

Counted on the meta device with flops.count_params (tests/test_bench_gpu.py checks both). Sequence length 4096,
bf16 mixed precision with fp32 master weights (accelerate's FSDP2 upcasts trainable parameters), AdamW (fused, the
Trainer's default). The tokenizer is the pack's tiny one (for TRL's pad token); the data are token ids drawn
directly.

Methods (`--methods`, default full): `full` trains every parameter. `lora` trains the LoRA adapters of the recipe
LORA_RECIPE (llama-3.1-8b-lora: r 16, alpha 32, dropout 0.05 on all seven projections of every layer; read from its
sft.yaml, so the benchmark follows the recipe), with the frozen weights in bf16. 8B full fine-tuning cannot fit one
GPU (below); 8B LoRA is estimated at 26-40 GiB (98 GiB without checkpointing), so `--sizes 8b --methods lora
--gpus 1` measures the 8B model on one GPU with the method the pack's 8B-and-larger LoRA recipes use. Its MFU counts
4N for the frozen weights (flops.py).

Data: a synthetic SFT set of pre-tokenized conversations (`input_ids`, loss on every token) whose lengths are
lognormal, median 800 tokens and sigma 0.9, clipped to [16, 4096], seeded: mean about 1,126 tokens, 10th and 90th
percentiles about 252 and 2,535, about 3.5% of the conversations cut at 4096. Ids are uniform over the vocabulary
(the cost of a step does not depend on which ids they are). `--dry-run` scales the same distribution to its 128
tokens.

Layouts: one GPU (FSDP2 with world size 1) and, where the machine has more than one, all of them (`--gpus`).

Rungs, each its own `accelerate launch` (FSDP2, a YAML generated from accelerate_configs/fsdp2_1node.yaml with
num_processes, reshard_after_forward and mixed precision set) of bench_gpu_worker.py, which drives the entry
point's trainer (run_config.parse_args and train/build.py trainer_for, as bench_overhead.py does: TRL's SFTTrainer,
its fused LM head and metrics, the pack's run report, completion-marker and preemption callbacks):

  0   baseline: TRL SFTTrainer defaults: padded batches of 8 (per_device_train_batch_size's default), no packing,
      SDPA, TRL's default activation checkpointing (full, non-reentrant), bf16, reshard_after_forward True.
  1   activation checkpointing off, or the planner's pick: `activation_checkpointing_policy` the first of none,
      every_4, every_2, ops, full whose memory estimate (memory_budget, as `make plan`) fits FIT_FRACTION of the
      GPU (none in a CPU plumbing run): no recomputed forward where memory allows (speed/activation_checkpointing.py).
  2   Liger kernels: `use_liger_kernel: true` (RMSNorm, SwiGLU, RoPE; TRL keeps its own fused LM head, so Liger's
      fused cross-entropy is off). Skipped, with the reason, without CUDA or liger_kernel.
  3   variable-length packing: `packing: true` + `padding_free: true` (TRL's "bfd": one flattened row with
      position_ids, no attention mask), 2 packed rows of 4096 tokens per step, `attn_implementation: auto` (the
      attention option's: packed_varlen, torch's variable-length kernel, on CUDA with torch >= 2.10; SDPA on CPU;
      the JSON's speed_options record which one ran).
  4   regional torch.compile, accelerate's: the rung's accelerate YAML gets `dynamo_config` (backend INDUCTOR,
      dynamo_use_regional_compilation, dynamo_use_dynamic), so accelerate compiles each decoder layer in place
      before fully_shard (torchtitan's per-block recipe) exactly as a recipe with those YAML lines would. On top
      of Liger, Liger's RoPE is left to the compiler (bench_gpu_worker.py says why).
  5   torchao float8 training: the recipe setting `float8: true` (float8.py: tensorwise dynamic scaling,
      pad_inner_dim, every nn.Linear but the LM head), as a recipe adopting it would run. Skipped, with the
      reason, without torchao, below compute capability 8.9, or under LoRA (the pack refuses float8 with LoRA).
  6a  selective activation checkpointing (`ops`: TRL's policy, save the attention outputs, recompute the rest);
  6b  FSDP2 reshard_after_forward False.
  7a  checkpoint offload (issue 60): `activation_checkpointing_offload: true` with every layer checkpointed: the
      saved layer inputs in pinned host memory (speed/checkpoint_offload.py); its cost in tokens/s against 6a-6b.
  7b  a long row: max_length x LONG_ROW (32,768 on the GPU, 1,024 in a CPU plumbing run), one row a step from TRL's
      `wrapped` packing without padding-free (full causal attention over the whole row, as one long document), the
      planner's checkpointing pick; 7c the same row with every layer checkpointed and offloaded. Not comparable in
      tokens/s with the rungs above (attention grows with the row), so never built on; offload needs CUDA (torch
      has no pinned allocator on a CPU machine): skipped, with the reason, in a plumbing run.

Cumulative: each rung starts from the fastest rung measured so far in its ladder (tokens/s per GPU) and makes its
one change; a rung that failed, was skipped or was slower is not built on. So 6a-6b compare checkpointing and
resharding on top of the best configuration found by 0-4. "Tuned" in the table is the fastest measured rung.

A rung whose estimated memory (memory_budget.budget, the arithmetic of `make plan`) exceeds FIT_FRACTION of the GPU
is skipped with the estimate as the reason (`--no-fit-check` runs it anyway): 8B full fine-tuning needs about 16
bytes per parameter for fp32 weights, gradients and AdamW states, about 120 GiB, so on one GPU, even an H200, every
8B full fine-tuning rung is skipped. A rung that crashes, runs out of memory or times out is recorded as
`{"status": "failed", "error": ...}` (the run report's error, else the last error line of its log) and the ladder
goes on. With `--deadline-s`, a rung with less than `min_rung_s` left (twice that if it compiles) is skipped as
"time budget"; `--resume <JSON>` in a later command carries the measured and failed rungs of that file and runs the
rest on top of the fastest of them.

Figures come from the run's own metrics.json (run_report.RunReport): tokens/s per GPU (non-padding tokens), MFU
(flops.flops_per_token over flops.peak_flops, dense bf16 peak, also for the float8 rung; attention at the
token-weighted mean document length), peak memory (torch.cuda.max_memory_allocated and max_memory_reserved, max
over ranks, of the measured steps; the peaks up to the end of warm-up are kept beside them). Warm-up is excluded:
at the end of step `--warmup` (default 4: the first steps compile, allocate and tune) the worker synchronizes the
device, records and resets the memory peaks, and restarts the report's training clock and token counters, and it
synchronizes again before the report reads the clock at the end; so tokens/s and MFU cover only the `--steps`
measured steps (default 16). Not included:
process start, imports, model load, data preparation, FSDP wrapping, saving (no final save is made), evaluation.

Output: bench/results/bench-gpu-<device-slug>-<date>T<HHMM>Z[-<sizes>].json (device, GPU count, versions, date, every
rung's configuration, figures, command and log tail; written after every rung, so a killed run keeps what it
measured) and a markdown table with the speed-up over rung 0 and whether the issue's goals were met: tuned
tokens/s >= 1.5x rung 0 (every ladder), and >= 45% MFU for 1B full fine-tuning on one GPU. A goal is only ever
marked met or not met from measured figures.

`--dry-run`: the same ladder on CPU processes (CUDA hidden), a tiny Mistral (hidden 64, 2 layers), sequence 128,
1 warm-up and 2 measured steps, fp32, 1 process; Liger is skipped (it needs CUDA), float8 runs on torch's
reference CPU float8 matmul where torchao is installed, and compile uses the AOT_EAGER backend (dynamo and
AOTAutograd, no inductor). It tests the plumbing only: its JSON says `"plumbing_only": true` and its table says its
figures are not benchmarks.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.gpu_worker import WARMUP_FILE
from bench.ladder_goals import GOAL_MFU_1B_1GPU, GOAL_SPEEDUP, ladder_title, method_of
from fsdp_recipes.api import CHECKPOINTING_POLICIES, SPEED_OPTIONS, checkpointing_setup_fields

REPO = Path(__file__).resolve().parents[1]
ACCELERATE_TEMPLATE = REPO / "accelerate_configs" / "fsdp2_1node.yaml"
GIB = 1024**3

# MistralConfig fields per size; the docstring states the parameter counts (checked by the tests).
SIZES = {
    "1b": dict(vocab_size=32768, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, head_dim=64),
    "8b": dict(vocab_size=131072, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128),
    # Llama-3-8B's published shape (rope theta 500000), in Mistral's module layout, which is Llama's: issue 45's anchor,
    # NeMo Automodel's Llama-3-8B LoRA at seq 4096, is quoted for this shape (8,030,261,248 parameters)
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=500000.0),
    "tiny": dict(vocab_size=268, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=2, head_dim=32),  # --dry-run only
}
# Lognormal conversation lengths at max_length 4096; scaled linearly for other lengths.
LENGTHS = dict(median=800, sigma=0.9, min=16, max=4096)
METHODS = ("full", "lora")
# The LoRA ladder's adapters: this recipe's lora_* settings (the pack's 8B LoRA recipe), read from its sft.yaml.
LORA_RECIPE = REPO / "recipes" / "llama-3.1-8b-lora"

GPU_RUN = dict(max_length=4096, warmup=4, steps=16, baseline_batch=8, pack_rows=2, dtype="bfloat16",
               rung_timeout_s=360, deadline_s=None, min_rung_s=90)
DRY_RUN = dict(max_length=128, warmup=1, steps=2, baseline_batch=8, pack_rows=2, dtype="float32",
               rung_timeout_s=120, deadline_s=None, min_rung_s=5)
# A compiled rung needs longer for inductor's cold compile: this many times min_rung_s left, and its timeout scaled.
COMPILE_MIN_TIME_FACTOR = 2
COMPILE_TIMEOUT_FACTOR = 1.5
# memory_budget's allowance for the CUDA context, NCCL buffers and allocator slack, which max_memory_allocated does not
# see: the table compares the estimate without it with the measured peak (issue 17, step 2)
RUNTIME_BYTES = 2 * GIB
FIT_FRACTION = 0.92  # run a rung only if memory_budget's estimate is within this share of the GPU: allocator slack

LONG_ROW = 8  # rungs 7b-7c: rows this many times max_length
LONG_ROW_CHANGE = dict(long_row=LONG_ROW, packing=True, packing_strategy="wrapped", padding_free=False, attn="sdpa",
                       batch=1, activation_checkpointing="pick")
BASELINE = dict(packing=False, attn="sdpa", batch="baseline", liger=False, compile=False, float8=False,
                activation_checkpointing="full", reshard_after_forward=True, method="full")  # method: the ladder's
# Ordered by expected gain (issue 57): checkpointing off first (the largest, where memory allows: the recomputed
# forward is a third of a checkpointed step), then fused kernels, variable-length packing, compile, float8; each rung
# is named by the recipe settings it composes.
RUNGS = [
    dict(id="0", name="TRL defaults, padded", change={}),
    dict(id="1", name="activation_checkpointing_policy: the planner's pick",
         change=dict(activation_checkpointing="pick")),
    dict(id="2", name="use_liger_kernel: true", change=dict(liger=True)),
    # padding-free rows and the attention option's `auto` (speed/attention.py): torch's variable-length kernel on
    # CUDA (packed_varlen), no block-diagonal mask; the rung's speed_options record what ran
    dict(id="3", name="padding_free: true + attn_implementation: auto",
         change=dict(packing=True, padding_free=True, attn="auto", batch="pack")),
    dict(id="4", name="regional torch_compile", change=dict(compile=True)),
    dict(id="5", name="float8: true", change=dict(float8=True)),
    dict(id="6a", name="activation_checkpointing_policy: ops", change=dict(activation_checkpointing="ops")),
    dict(id="6b", name="fsdp_reshard_after_forward: false", change=dict(reshard_after_forward=False)),
    # issue 60's one-GPU levers: checkpoint offload, then a row LONG_ROW times as long, without and with it
    dict(id="7a", name="activation_checkpointing_offload: true",
         change=dict(activation_checkpointing="full", offload=True)),
    dict(id="7b", name="a long row (wrapped packing): the planner's pick", change=LONG_ROW_CHANGE),
    dict(id="7c", name="a long row + activation_checkpointing_offload: true",
         change=dict(LONG_ROW_CHANGE, activation_checkpointing="full", offload=True)),
]


# ---- model and data -----------------------------------------------------------------------------------------------

def mistral_config(size: str, max_length: int = 4096):
    from transformers import MistralConfig

    return MistralConfig(**SIZES[size], max_position_embeddings=max(max_length, 4096), sliding_window=None,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=3)


def lora_settings() -> dict:
    """The lora_* fields of LORA_RECIPE's sft.yaml: r, alpha, dropout, target modules."""
    import yaml

    raw = yaml.safe_load((LORA_RECIPE / "sft.yaml").read_text())
    return {k: v for k, v in raw.items() if k.startswith("lora_")}


def param_counts(size: str, method: str = "full") -> dict[str, int]:
    """flops.count_params of the model built on the meta device (no memory, no weights), with LORA_RECIPE's
    adapters added for `lora` (TRL's get_peft_config, as the entry point builds them)."""
    import torch
    from transformers import AutoModelForCausalLM

    from fsdp_recipes.api import count_params

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(mistral_config(size))
        if method == "lora":
            from peft import get_peft_model
            from trl import ModelConfig, get_peft_config

            model = get_peft_model(model, get_peft_config(ModelConfig(use_peft=True, **lora_settings())))
    return count_params(model)


def build_model(size: str, out: Path, device: str, dtype: str, max_length: int) -> Path:
    """Random weights (transformers' own init, seed 0) saved with save_pretrained, plus the tiny tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fsdp_recipes.api import ensure_tiny_assets

    if (out / "config.json").is_file():  # built by an earlier invocation with the same --work
        return out
    tok = AutoTokenizer.from_pretrained(ensure_tiny_assets(quiet=True)["model"])
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(mistral_config(size, max_length), dtype=getattr(torch, dtype))
    partial = out.with_name(out.name + ".partial")  # renamed when complete: a killed build leaves no model behind
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    tok.save_pretrained(partial)
    partial.rename(out)
    del model
    if device == "cuda":  # give the rungs the memory back (this process keeps only its CUDA context)
        import gc

        gc.collect()
        torch.cuda.empty_cache()
    return out


def synthetic_lengths(n: int, max_length: int = 4096, seed: int = 0) -> list[int]:
    """Lognormal conversation lengths (LENGTHS at 4096, scaled to max_length), clipped to [min, max_length]."""
    scale = max_length / LENGTHS["max"]
    rng = random.Random(seed)
    lo = max(2, round(LENGTHS["min"] * scale))
    mu = math.log(LENGTHS["median"] * scale)
    return [min(max_length, max(lo, round(rng.lognormvariate(mu, LENGTHS["sigma"])))) for _ in range(n)]


def length_stats(lengths: list[int]) -> dict:
    s = sorted(lengths)
    q = lambda p: s[min(len(s) - 1, int(p * len(s)))]  # noqa: E731
    return {"n": len(s), "min": s[0], "p10": q(0.1), "median": q(0.5), "mean": sum(s) / len(s), "p90": q(0.9),
            "max": s[-1], "fraction_at_max": sum(x == s[-1] for x in s) / len(s)}


# ---- the device ---------------------------------------------------------------------------------------------------

def device_facts(dry_run: bool) -> dict:
    import torch

    from fsdp_recipes.api import device_info

    if dry_run or not torch.cuda.is_available():
        return {"type": "cpu", "name": device_info()["name"], "count": 1, "capability": None, "memory_bytes": None}
    props = torch.cuda.get_device_properties(0)
    return {"type": "cuda", "name": props.name, "count": torch.cuda.device_count(),
            "capability": [props.major, props.minor], "memory_bytes": props.total_memory}


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def no_cuda(name: str) -> None:
    """A GPU benchmark asked for where torch sees no GPU: the pack's one-line form, exit 2 (a usage mistake)."""
    print(f"error: {name}: no CUDA device here. Fix: --dry-run tests the plumbing on CPU.", file=sys.stderr)
    raise SystemExit(2)


def layer_probe_start(name: str, doc: str, argv: list[str] | None, deadline_help: str, dry_help: str,
                      more=lambda ap: None) -> tuple[argparse.Namespace, Path, float]:
    """The command line of a one-GPU layer probe (bench/qlora_gpu.py, bench/moe_gpu.py): --dry-run, --results,
    --deadline-s and the probe's `more`; refused without CUDA unless --dry-run. (args, the results folder, start)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help=dry_help)
    ap.add_argument("--results", type=Path, default=None, help="default bench/results; --dry-run: runs/results")
    more(ap)
    ap.add_argument("--deadline-s", type=float, default=50.0, help=deadline_help)
    args = ap.parse_args(argv)
    start = time.time()
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        no_cuda(name)
    return args, args.results or REPO / ("runs/results" if args.dry_run else "bench/results"), start


def layer_probe_record(name: str, dry: bool, results: Path, start: float, **fields):
    """What a one-GPU layer probe (bench/qlora_gpu.py, bench/moe_gpu.py) writes: its result, headed by the device,
    versions and date, then `fields`; the path <name>-<device>-<UTC time>.json in `results`; and `save`, which writes
    it with the seconds since `start` (after each part: a probe stopped at its deadline keeps what it measured)."""
    from fsdp_recipes.api import file_stamp, now_iso, versions, write_json_atomic

    device = device_facts(dry)
    result = {"benchmark": name, "date": now_iso(), "dry_run": dry, "device": device, "versions": versions(), **fields}
    path = results / f"{name.replace('_', '-')}-{slug(device['name'])}-{file_stamp(result['date'])}.json"

    def save() -> None:
        write_json_atomic(path, {**result, "duration_s": round(time.time() - start, 1)})

    return result, path, save


# ---- rungs --------------------------------------------------------------------------------------------------------

def resolve(settings: dict, sizes: dict, device: dict) -> dict:
    """Concrete settings: batch size and attention implementation filled in."""
    s = dict(settings)
    if s["batch"] in ("baseline", "pack"):
        s["batch"] = sizes["baseline_batch"] if s["batch"] == "baseline" else sizes["pack_rows"]
    return s  # attn "auto" goes to the pack as it is: its attention option picks (speed/attention.py)


def row_length(s: dict, sizes: dict) -> int:
    """The rung's max_length: the ladder's, or LONG_ROW times it for a long-row rung."""
    return sizes["max_length"] * s.get("long_row", 1)


def why_skip(rung: dict, s: dict, device: dict) -> str | None:
    """The reason a rung cannot run here, or None."""
    cuda = device["type"] == "cuda"
    if rung["change"].get("offload") and not cuda:
        return ("needs CUDA: offload copies saved activations to pinned host memory, which torch cannot allocate "
                "on a CPU machine (speed/checkpoint_offload.py)")
    if rung["change"].get("liger"):
        if not cuda:
            return "needs CUDA (Liger's kernels are Triton GPU kernels); this is a CPU plumbing run"
        if importlib.util.find_spec("liger_kernel") is None:
            return "liger_kernel is not importable (pip install liger-kernel; scripts/device_wheels.sh carries it)"
    if rung["change"].get("float8"):  # on CPU it runs (torch's reference float8 matmul): plumbing only
        if s["method"] == "lora":
            return "float8 is for full fine-tuning: the pack refuses it under LoRA (speed/float8.py check_config)"
        if importlib.util.find_spec("torchao") is None:
            return "torchao is not importable (pip install torchao; scripts/device_wheels.sh carries it)"
        if cuda and tuple(device["capability"]) < SPEED_OPTIONS["float8"].module.MIN_CAPABILITY:
            return f"float8 needs compute capability >= 8.9, this GPU has {device['capability'][0]}." \
                   f"{device['capability'][1]}"
    return None


def memory_parts(size: str, s: dict, processes: int, max_length: int, tokens: int | None = None) -> dict[str, int]:
    """Bytes per GPU by memory_budget's components (the arithmetic `make plan` prints), at `tokens` per micro-batch
    (default the worst case, every row max_length long); selective checkpointing adds the saved attention outputs
    to full checkpointing's activations."""
    from types import SimpleNamespace

    import torch
    from transformers import AutoModelForCausalLM

    from fsdp_recipes.api import Setup, budget, model_shape

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(mistral_config(size))
    lora = s["method"] == "lora"
    shape = model_shape(model, SimpleNamespace(use_peft=lora, lora_modules_to_save=None,
                                                          **(lora_settings() if lora else {})))
    tokens = tokens or s["batch"] * max_length
    setup = Setup(shard=processes, world=processes, strategy="FSDP",  # FSDP2 at world size 1 too
                  load_bytes=2, compute_bytes=2, mixed_precision=True, tokens=tokens,
                  optimizer_bytes=8, runtime_bytes=RUNTIME_BYTES,
                  reshard_after_forward=s["reshard_after_forward"],
                  checkpoint_offload=bool(s.get("offload")),
                  **checkpointing_setup_fields(policy_name(s["activation_checkpointing"])))
    return budget(shape, setup)


def policy_name(value: str) -> str:
    """activation_checkpointing_policy's name for a ladder setting ("selective": the JSONs before issue 57)."""
    return "ops" if value == "selective" else value


def planner_pick(size: str, s: dict, processes: int, max_length: int, device: dict) -> str:
    """Rung 1's policy: the first, fastest first, whose estimate fits the GPU as the fit check wants; on CPU none."""
    if device["type"] != "cuda":
        return "none"
    for name in CHECKPOINTING_POLICIES:
        if memory_estimate(size, {**s, "activation_checkpointing": name}, processes, max_length) \
                <= FIT_FRACTION * device["memory_bytes"]:
            return name
    return "full"


def memory_estimate(size: str, s: dict, processes: int, max_length: int) -> int:
    """memory_parts' total at the worst case: what the fit check compares with the GPU."""
    return memory_parts(size, s, processes, max_length)["total"]


def dynamo_config(backend: str) -> dict:
    """Regional compilation as accelerate does it, and as a recipe's accelerate YAML would ask for it: with FSDP2,
    accelerate (1.15, Accelerator._prepare_fsdp2 -> compile_regions_fsdp2) compiles each repeated block (the decoder
    layers) in place before fully_shard, torchtitan's per-block recipe, setting dynamo's flags for compile under
    activation checkpointing. Dynamic: every packed row has another length, and a static first compile would be
    followed by a second, dynamic one."""
    return {"dynamo_backend": backend, "dynamo_use_regional_compilation": True, "dynamo_use_dynamic": True}


def accelerate_yaml(path: Path, processes: int, reshard: bool, mixed_precision: str,
                    dynamo: dict | None = None) -> Path:
    import yaml

    cfg = yaml.safe_load(ACCELERATE_TEMPLATE.read_text())
    cfg.update(num_processes=processes, mixed_precision=mixed_precision)
    cfg["fsdp_config"]["fsdp_reshard_after_forward"] = reshard
    if dynamo:
        cfg["dynamo_config"] = dynamo
    path.write_text(yaml.safe_dump(cfg))
    return path


def sft_args(s: dict, model_dir: Path, data_dir: Path, out_dir: Path, sizes: dict, bf16: bool) -> list[str]:
    """The entry point's flags for one rung. Everything not named here is TRL's / transformers' default."""
    b = lambda v: "true" if v else "false"  # noqa: E731
    total = sizes["warmup"] + sizes["steps"]
    args = ["--model_name_or_path", str(model_dir), "--dataset_name", str(data_dir), "--output_dir", str(out_dir),
            "--use_peft", b(s["method"] == "lora"), "--tiny_assets", "false", "--save_merged_model", "false",
            "--auto_resume", "false",
            "--dtype", sizes["dtype"], "--bf16", b(bf16), "--attn_implementation", s["attn"],
            "--max_length", str(row_length(s, sizes)), "--per_device_train_batch_size", str(s["batch"]),
            "--packing", b(s["packing"]), *(["--padding_free", "true"] if s.get("padding_free") else []),
            *(["--packing_strategy", s["packing_strategy"]] if s.get("packing_strategy") else []),
            *(["--activation_checkpointing_offload", "true"] if s.get("offload") else []),
            "--use_liger_kernel", b(s["liger"]), "--float8", b(s["float8"]),
            "--activation_checkpointing_policy", policy_name(s["activation_checkpointing"]),
            "--max_steps", str(total), "--logging_steps", str(total), "--eval_strategy", "no",
            "--save_strategy", "no", "--report_to", "none", "--disable_tqdm", "true"]
    if s["method"] == "lora":
        for key, value in lora_settings().items():
            args += [f"--{key}", *map(str, value if isinstance(value, list) else [value])]
    return args


LAUNCHER_ERRORS = ("ChildFailedError", "CalledProcessError")  # torchrun's and accelerate's wrappers of the real one


def error_line(log: str, metrics: dict | None) -> str:
    """The run report's error, else the log's last Python exception line that is not the launchers' wrapper of it,
    else the log's last line."""
    if metrics and metrics.get("error"):
        return metrics["error"].splitlines()[0][:400]
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    for ln in reversed(lines):
        m = re.match(r"^[\w.]*(Error|Exception|Interrupt)\b", ln)
        if m and not any(w in m.group(0) for w in LAUNCHER_ERRORS):
            return ln[:400]
    return lines[-1][:400] if lines else "no output"


def figures(metrics: dict, sizes: dict, warmup_peaks: dict | None = None) -> dict:
    """The headline figures, read from the run's metrics.json (which covers the measured steps only) and the peaks
    the worker recorded up to the end of warm-up (model load, compilation; bench_gpu_worker.WARMUP_FILE)."""
    pm = metrics["peak_memory"]
    wp = warmup_peaks or {}
    tok = metrics["tokens"]
    gib = lambda v: v / GIB if v is not None else None  # noqa: E731
    return {
        "tokens_per_s_per_gpu": metrics["tokens_per_second_per_device"],
        "tokens_per_s": metrics["tokens_per_second"],
        "mfu": metrics["mfu"],
        "mfu_note": metrics["mfu_note"],
        "peak_allocated_gib": gib(pm["device_allocated_bytes"]),
        "peak_reserved_gib": gib(pm["device_reserved_bytes"]),
        "warmup_peak_allocated_gib": gib(wp.get("device_allocated_bytes")),
        "warmup_peak_reserved_gib": gib(wp.get("device_reserved_bytes")),
        "warmup_host_rss_gib": gib(wp.get("host_rss_bytes")),
        "compiled_graphs": wp.get("compiled_graphs"),  # dynamo's unique graphs by the end of warm-up, rank 0
        "host_rss_gib": gib(pm["host_rss_bytes"]),
        "measured_steps": sizes["steps"],
        "warmup_steps_excluded": sizes["warmup"],
        "measured_time_s": metrics["train_time_s"],
        "non_padding_tokens": tok["non_padding"],
        "padded_tokens": tok["padded"],
        "padding_fraction": 1 - tok["non_padding"] / tok["padded"] if tok["padded"] else None,
        "flops_per_token": metrics["flops_per_token"],
        "flops_seq_len": metrics["flops_seq_len"],  # sum(n^2) / sum(n): the attention term's length
    }


def run_rung(cmd: list[str], env: dict, log_path: Path, timeout_s: float) -> tuple[int | None, str]:
    """One launch in its own process group; on timeout the whole group is killed. (return code or None, log)."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
    return rc, log_path.read_text(errors="replace")


def ladder(lad: dict, ctx: dict, selected: list[str], on_update) -> None:
    """The selected rungs of one (size, processes) ladder, filled into `lad`, each from the fastest measured so far.
    Rungs that `--resume` carries from an earlier file of the same ladder go in as they were (and count for the
    fastest so far), unless --rungs names them again."""
    sizes, device, work = ctx["sizes"], ctx["device"], ctx["work"]
    size, processes, method = lad["size"], lad["processes"], method_of(lad)
    label = f"{size}{'' if method == 'full' else ' ' + method} x{processes}"  # in the progress lines
    tag = f"{size}-{processes}" + ("" if method == "full" else f"-{method}")  # in the work folder's file names
    carried = ctx["carried"].get((size, processes, method), {})
    best = None  # (tokens/s per GPU, settings, rung id) of the fastest measured rung
    model_dir, build_error = None, None

    def faster(rec: dict):  # best, after a measured rung (measured now or carried); a long row is not comparable
        tps = rec["figures"]["tokens_per_s_per_gpu"]
        if rec["config"].get("long_row"):
            return best
        return (tps, rec["config"], rec["id"]) if best is None or tps > best[0] else best

    for rung in RUNGS:
        prev = carried.get(rung["id"])
        if prev is not None and not (ctx["rungs_named"] and rung["id"] in selected and not ctx.get("keep_carried")):
            lad["rungs"].append({**prev, "carried_from": prev.get("carried_from") or ctx["resume_from"]})
            if prev["status"] == "measured":
                best = faster(prev)
            print(f"[bench-gpu] {label} rung {rung['id']} ({rung['name']}): {prev['status']} in "
                  f"{ctx['resume_from']}, carried over", flush=True)
            continue
        if rung["id"] not in selected:
            continue
        base = best[1] if best else BASELINE
        s = resolve({**base, **rung["change"], "method": method}, sizes, device)
        if s["activation_checkpointing"] == "pick":
            s["activation_checkpointing"] = planner_pick(size, s, processes, row_length(s, sizes), device)
        rec = {"id": rung["id"], "name": rung["name"], "built_on": best[2] if best else None, "config": s}
        lad["rungs"].append(rec)
        elapsed = time.time() - ctx["t0"]
        reason = why_skip(rung, s, device)
        deadline = ctx["deadline_s"]
        need = sizes["min_rung_s"] * (COMPILE_MIN_TIME_FACTOR if s["compile"] else 1)
        if reason is None and deadline is not None and deadline - elapsed < need:
            # a rung that starts with less left is killed before it measures anything (start, load, warm-up)
            reason = (f"time budget: {elapsed:.0f} s of --deadline-s {deadline:.0f} spent, under {need:.0f} s left "
                      f"for this rung (--resume <this JSON> runs the rest)")
        if reason is None and device["type"] == "cuda" and ctx["fit_check"]:
            est = memory_estimate(size, s, processes, row_length(s, sizes))
            rec["memory_estimate_gib"] = est / GIB
            if est > FIT_FRACTION * device["memory_bytes"]:
                reason = (f"estimated {est / GIB:.0f} GiB per GPU > {FIT_FRACTION:.0%} of "
                          f"{device['memory_bytes'] / GIB:.0f} GiB (memory_budget, as `make plan`; --no-fit-check "
                          f"runs it anyway)")
        if reason is not None:
            rec.update(status="skipped", reason=reason)
            print(f"[bench-gpu] {label} rung {rung['id']} ({rung['name']}): skipped: {reason}", flush=True)
            on_update()
            continue
        if model_dir is None and build_error is None:
            try:
                model_dir = build_model(size, work / f"model-{size}", ctx["build_device"], sizes["dtype"],
                                        sizes["max_length"] * LONG_ROW)  # positions for a long-row rung too
            except Exception as err:  # e.g. out of memory building 8B: every rung of this size fails with it
                build_error = f"building the {size} model failed: {type(err).__name__}: {str(err).splitlines()[0]}"
        if build_error is not None:
            rec.update(status="failed", error=build_error)
            print(f"[bench-gpu]   failed: {build_error}", flush=True)
            on_update()
            continue
        out_dir = work / f"run-{tag}-{rung['id']}"
        shutil.rmtree(out_dir, ignore_errors=True)  # never read a metrics.json left by an earlier invocation
        rec["dynamo_config"] = dynamo_config("AOT_EAGER" if ctx["dry_run"] else "INDUCTOR") if s["compile"] else None
        yaml_path = accelerate_yaml(work / f"accelerate-{tag}-{rung['id']}.yaml", processes,
                                    s["reshard_after_forward"], "no" if ctx["dry_run"] else "bf16",
                                    rec["dynamo_config"])
        worker = ["--warmup", str(sizes["warmup"]), "--"]
        args = sft_args(s, model_dir, ctx["data_dir"], out_dir, sizes, bf16=not ctx["dry_run"])
        if not s["compile"]:  # the probe's saved-tensor hooks would be traced by dynamo; it runs in warm-up only
            args += ["--measure_memory", "true"]
        if rung["id"] in ctx["inject_failure"]:  # tests: a setting the entry point rejects
            args += ["--no_such_setting", "1"]
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(yaml_path),
               "--num_processes", str(processes), "--main_process_port", "0",
               "-m", "bench.gpu_worker", *worker, *args]
        rec["command"] = " ".join(cmd)
        timeout = sizes["rung_timeout_s"] * (COMPILE_TIMEOUT_FACTOR if s["compile"] else 1)
        if deadline is not None:
            timeout = min(timeout, deadline - (time.time() - ctx["t0"]))
        env = dict(ctx["env"], TORCH_LOGS="graph_breaks,recompiles") if s["compile"] else ctx["env"]
        print(f"[bench-gpu] {label} rung {rung['id']} ({rung['name']}): running", flush=True)
        t = time.time()
        rc, log = run_rung(cmd, env, work / f"log-{tag}-{rung['id']}.txt", timeout)
        rec["wall_s"] = time.time() - t
        rec["log_tail"] = log.splitlines()[-30:]
        mpath = out_dir / "metrics.json"
        metrics = json.loads(mpath.read_text()) if mpath.is_file() else None
        rec["metrics_json"] = metrics
        apath = out_dir / "run_args.json"
        if apath.is_file():  # what the speed options did: float8's converted layers, the attention that ran, ...
            rec["speed_options"] = json.loads(apath.read_text()).get("speed_options")
        ok = rc == 0 and metrics and metrics["status"] == "completed" and (metrics["tokens_per_second"] or 0) > 0
        if ok:
            rec["status"] = "measured"
            wpath = out_dir / WARMUP_FILE
            rec["figures"] = figures(metrics, sizes, json.loads(wpath.read_text()) if wpath.is_file() else None)
            ppath = out_dir / "memory_probe.rank0.json"  # the planner per component, at the first step's tokens
            if ppath.is_file():
                probe = json.loads(ppath.read_text())
                rec["memory_probe"] = probe
                rec["memory_estimate_parts_at_probe_tokens"] = memory_parts(
                    size, s, processes, row_length(s, sizes), probe.get("tokens_per_micro_batch"))
            best = faster(rec)
            print(f"[bench-gpu]   {rec['figures']['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU in {rec['wall_s']:.0f} s",
                  flush=True)
        else:
            why = f"timed out after {timeout:.0f} s" if rc is None else error_line(log, metrics)
            rec.update(status="failed", error=why, returncode=rc)
            print(f"[bench-gpu]   failed: {why}", flush=True)
        on_update()
    lad["goals"] = goals(lad, ctx["dry_run"])
    on_update()


def goals(lad: dict, dry_run: bool) -> dict:
    """The issue's goals, from measured figures only."""
    # a long row's tokens/s is not comparable with the ladder's rows (rungs 7b-7c): never the tuned rung
    measured = [r for r in lad["rungs"] if r["status"] == "measured" and not r.get("config", {}).get("long_row")]
    base = next((r for r in measured if r["id"] == "0"), None)
    tuned = max(measured, key=lambda r: r["figures"]["tokens_per_s_per_gpu"], default=None)
    out = {"tuned_rung": tuned["id"] if tuned else None}
    if dry_run:
        why = "not evaluated: plumbing run (CPU, tiny model); its figures are not benchmarks"
        return {**out, "speedup": why, "mfu": why}
    if base is None or tuned is None:
        out["speedup"] = "not evaluated: rung 0 was not measured"
    else:
        x = tuned["figures"]["tokens_per_s_per_gpu"] / base["figures"]["tokens_per_s_per_gpu"]
        out["speedup"] = f"{'met' if x >= GOAL_SPEEDUP else 'not met'}: {x:.2f}x (goal >= {GOAL_SPEEDUP}x)"
    if lad["size"] != "1b" or lad["processes"] != 1 or method_of(lad) != "full":
        out["mfu"] = "not applicable (the MFU goal is for 1B full fine-tuning on one GPU)"
    elif tuned is None or tuned["figures"]["mfu"] is None:
        out["mfu"] = "not evaluated: no measured MFU"
    else:
        m = tuned["figures"]["mfu"]
        out["mfu"] = f"{'met' if m >= GOAL_MFU_1B_1GPU else 'not met'}: {100 * m:.1f}% (goal >= 45%)"
    return out


def table(result: dict) -> str:
    lines = []
    if result["plumbing_only"]:
        lines.append("PLUMBING RUN (--dry-run): CPU, tiny model, 2 steps. These figures are NOT benchmarks.")
    for lad in result["ladders"]:
        lines += ["", f"{ladder_title(lad)}, {lad['processes']} {'process' if result['plumbing_only'] else 'GPU'}(s)",
                  "",
                  "| rung | what | tokens/s/GPU | MFU | peak GiB alloc / reserved | planner GiB (vs alloc) "
                  "| speed-up vs rung 0 | status |",
                  "|---|---|---:|---:|---:|---:|---:|---|"]
        base = next((r for r in lad["rungs"] if r["id"] == "0" and r["status"] == "measured"), None)
        for r in lad["rungs"]:
            if r["status"] != "measured":
                detail = r.get("reason") or r.get("error") or ""
                lines.append(f"| {r['id']} | {r['name']} | - | - | - | - | - | {r['status']}: {detail} |")
                continue
            f = r["figures"]
            mfu = f"{100 * f['mfu']:.1f}%" if f["mfu"] is not None else "n/a"
            on_gpu = f["peak_allocated_gib"] is not None
            mem = (f"{f['peak_allocated_gib']:.1f} / {f['peak_reserved_gib']:.1f}" if on_gpu
                   else f"host RSS {f['host_rss_gib']:.2f}")
            est = r.get("memory_estimate_gib")
            planner = "-"
            if est is not None and on_gpu and f["peak_allocated_gib"] > 0:
                counted = est - RUNTIME_BYTES / GIB
                planner = f"{counted:.1f} ({counted / f['peak_allocated_gib'] - 1:+.0%})"
            up = (f"{f['tokens_per_s_per_gpu'] / base['figures']['tokens_per_s_per_gpu']:.2f}x" if base else "-")
            extra = f" (on {r['built_on']}, {r['config']['attn']})" if r["built_on"] else f" ({r['config']['attn']})"
            lines.append(f"| {r['id']} | {r['name']}{extra} | {f['tokens_per_s_per_gpu']:,.0f} | {mfu} | {mem} | "
                         f"{planner} | {up} | measured |")
        g = lad.get("goals") or {}
        tuned = f"rung {g['tuned_rung']}" if g.get("tuned_rung") else "no rung measured"
        lines += ["", f"Goal, tuned ({tuned}) tokens/s >= 1.5x rung 0: {g.get('speedup')}",
                  f"Goal, >= 45% MFU for 1B full fine-tuning on one GPU: {g.get('mfu')}"]
    return "\n".join(lines)


# ---- driver -------------------------------------------------------------------------------------------------------

COMPARABLE = ("max_length", "warmup", "steps", "baseline_batch", "pack_rows", "dtype")  # what --resume must match


def resume_rungs(path: Path, dry: bool, device: dict, sizes: dict) -> dict:
    """{(size, processes): {rung id: record}} of the measured and failed rungs in an earlier file of this benchmark,
    after checking that its figures are comparable with this run's (same device name, plumbing flag and sizes; the
    data and models are rebuilt from the same seeds). Skipped rungs are left to run now."""
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise SystemExit(f"bench_gpu: cannot read --resume {path}: {err}. Fix: name a bench-gpu-*.json this "
                         f"benchmark wrote.") from None
    if old.get("benchmark") != "gpu-ladder":
        raise SystemExit(f"bench_gpu: --resume {path} is not a GPU ladder result. Fix: name a bench-gpu-*.json.")
    differ = [k for k in COMPARABLE if old["sizes"].get(k) != sizes[k]]
    if old["plumbing_only"] != dry or old["device"]["name"] != device["name"] or differ:
        what = ", ".join(differ) or ("the device" if old["device"]["name"] != device["name"] else "--dry-run")
        raise SystemExit(f"bench_gpu: --resume {path} was measured differently ({what}: "
                         f"{old['device']['name']}, {old['sizes']}). Fix: resume with the same device and options.")
    # by id and name: an earlier ladder's order (before issue 57, rung 1 was packing) is not carried into this one's
    names = {r["id"]: r["name"] for r in RUNGS}
    return {(lad["size"], lad["processes"], method_of(lad)):
            {r["id"]: r for r in lad["rungs"]
             if r["status"] in ("measured", "failed") and names.get(r["id"]) == r["name"]} for lad in old["ladders"]}


def run(argv: list[str] | None = None) -> tuple[dict, str, Path]:
    """Run the ladders; (result, table, path of the JSON)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", "--cpu-plumbing", action="store_true", dest="dry_run",
                    help="the ladder on CPU with a tiny model: tests the plumbing, measures nothing")
    ap.add_argument("--sizes", default=None, help="comma-separated: 1b,8b,llama3-8b (default "
                    "1b,8b; tiny with --dry-run)")
    ap.add_argument("--gpus", default="1,all", help="layouts: 1, all, or 1,all (default); with --dry-run a number "
                    "is that many CPU processes")
    ap.add_argument("--methods", default="full", help="comma-separated: full, lora (LoRA with the adapters of "
                    "recipes/llama-3.1-8b-lora) or full,lora (default full)")
    ap.add_argument("--rungs", default=None, help="comma-separated rung ids to run (default all: 0,1,2,3,4,5,6a,6b)")
    ap.add_argument("--results", type=Path, default=None, help="default bench/results; with --dry-run runs/ (a "
                    "plumbing run is not a result to publish)")
    ap.add_argument("--work", type=Path, default=None, help="models, data, logs (default: a temporary folder)")
    ap.add_argument("--warmup", type=int)
    ap.add_argument("--steps", type=int)
    ap.add_argument("--deadline-s", type=float, help="skip the rungs that would start with less than min_rung_s "
                    "(90 s, twice that for compiled rungs) left of this many seconds from the start, and cut the "
                    "last one's timeout to it (default: none)")
    ap.add_argument("--rung-timeout-s", type=float)
    ap.add_argument("--min-rung-s", type=float, help="with --deadline-s: a rung starts only with this many seconds "
                    "left, twice that if it compiles (default 90; measured on an H100, 2026-11-26: a 1B rung 42 s, "
                    "an 8B LoRA rung 61 s, start to end)")
    ap.add_argument("--no-fit-check", action="store_true", help="run rungs whose memory estimate exceeds the GPU")
    ap.add_argument("--resume", type=Path, default=None, help="a JSON this command wrote before (same device, sizes "
                    "and data): its measured and failed rungs are carried over, and the rest run on top of them "
                    "(a 10-minute command limit cuts a ladder in two)")
    ap.add_argument("--resume-if-comparable", type=Path, nargs="+", default=None, help="earlier JSONs of this "
                    "benchmark: the newest (by its date) measured on this device with these options is resumed, and "
                    "its measured and failed rungs are kept even where --rungs names them; with none comparable, "
                    "every named rung runs (the GPU plan's ladders continue the last session's this way)")
    ap.add_argument("--inject-failure", default="", help=argparse.SUPPRESS)  # tests: rung ids given a bad setting
    args = ap.parse_args(argv)

    import torch

    from bench.overhead import write_token_rows
    from fsdp_recipes.api import file_stamp, now_iso, versions, write_json_atomic

    dry = args.dry_run
    if args.results is None:
        args.results = REPO / ("runs" if dry else "bench") / "results"
    if not dry and not torch.cuda.is_available():
        no_cuda("bench_gpu")
    sizes = {**(DRY_RUN if dry else GPU_RUN)}
    for k in ("warmup", "steps", "deadline_s", "rung_timeout_s", "min_rung_s"):
        if getattr(args, k) is not None:
            sizes[k] = getattr(args, k)
    size_names = (args.sizes or ("tiny" if dry else "1b,8b")).split(",")
    device = device_facts(dry)
    layouts = []
    for g in args.gpus.split(","):
        n = device["count"] if g == "all" else int(g)
        if n not in layouts and (dry or n <= device["count"]):  # --dry-run: N CPU processes
            layouts.append(n)
    selected = args.rungs.split(",") if args.rungs else [r["id"] for r in RUNGS]
    unknown = set(selected) - {r["id"] for r in RUNGS}
    if unknown:
        raise SystemExit(f"bench_gpu: unknown rung(s) {', '.join(sorted(unknown))}. Fix: --rungs from "
                         f"{','.join(r['id'] for r in RUNGS)}.")
    methods = args.methods.split(",")
    if set(methods) - set(METHODS):
        raise SystemExit(f"bench_gpu: unknown method(s) in --methods {args.methods}. Fix: --methods from "
                         f"{','.join(METHODS)}.")
    carried = resume_rungs(args.resume, dry, device, sizes) if args.resume else {}
    keep_carried = False
    if args.resume_if_comparable and not args.resume:
        def date_of(path: Path) -> str:
            try:
                return json.loads(path.read_text()).get("date") or ""
            except (OSError, ValueError):
                return ""

        for candidate in sorted(args.resume_if_comparable, key=date_of, reverse=True):
            try:
                carried = resume_rungs(candidate, dry, device, sizes)
            except SystemExit as err:
                print(f"[bench-gpu] not resuming {candidate.name}: {err}", flush=True)
                continue
            args.resume, keep_carried = candidate, True
            break

    date = now_iso()
    name = f"bench-gpu-{'cpu-plumbing' if dry else slug(device['name'])}-{file_stamp(date)}"
    if not dry and args.sizes:
        name += "-" + "-".join(size_names)
    if methods != ["full"]:
        name += "-" + "-".join(methods)
    path = args.results / f"{name}.json"
    result = {"benchmark": "gpu-ladder", "plumbing_only": dry,
              "untested_note": None if not dry else "CPU plumbing run: no figure here is a benchmark",
              "device": device, "gpu_count": 0 if dry else device["count"], "versions": versions(), "date": date,
              "host": os.uname().nodename, "command": sys.argv, "sizes": sizes,
              "resumed_from": str(args.resume) if args.resume else None,
              "lengths": {**LENGTHS, "scaled_to": sizes["max_length"]}, "rungs": RUNGS, "baseline": BASELINE,
              "ladders": []}
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    env.pop("MASTER_PORT", None)
    if dry:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU path even on a GPU machine
    else:  # every rung alike: fewer fragmentation OOMs as packed lengths vary (torchtitan sets it too)
        env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    result["rung_env"] = {k: env.get(k) for k in ("PYTORCH_CUDA_ALLOC_CONF", "CUDA_VISIBLE_DEVICES")}

    def save():
        result["duration_s"] = time.time() - t0
        write_json_atomic(path, result)

    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        max_batch = max(sizes["baseline_batch"], sizes["pack_rows"] * 4)
        lengths = synthetic_lengths(max_batch * (sizes["warmup"] + sizes["steps"]) + 64, sizes["max_length"])
        result["dataset"] = length_stats(lengths)
        params = {(s, m): param_counts(s, m) for s in size_names for m in {"full", *methods}}
        for s in size_names:
            result.setdefault("models", {})[s] = {"config": SIZES[s], "parameters": params[s, "full"]}
        if "lora" in methods:
            result["lora"] = {"recipe": LORA_RECIPE.name, **lora_settings()}
        ctx = dict(sizes=sizes, device=device, work=work, dry_run=dry, t0=t0, env=env,
                   carried=carried, rungs_named=args.rungs is not None, keep_carried=keep_carried,
                   resume_from=str(args.resume) if args.resume else None,
                   deadline_s=sizes["deadline_s"], fit_check=not args.no_fit_check,
                   build_device="cpu" if dry else "cuda",
                   inject_failure=set(filter(None, args.inject_failure.split(","))))
        for s in size_names:
            # one data set per vocabulary; the same rows, in the same order, for every rung of the size
            ctx["data_dir"] = write_token_rows(work / f"data-{s}", lengths, SIZES[s]["vocab_size"])
            for m in methods:
                for n in layouts:
                    lad = {"size": s, "method": m, "processes": n, "parameters": params[s, m], "rungs": []}
                    result["ladders"].append(lad)  # saved after every rung: a killed run keeps what it measured
                    ladder(lad, ctx, selected, save)
    save()
    from bench.plot import plot_gpu_ladders

    plot_gpu_ladders(result, path.with_suffix(".png"))  # beside the JSON
    text = table(result)
    return result, text, path


def main(argv: list[str] | None = None) -> int:
    result, text, path = run(sys.argv[1:] if argv is None else argv)
    print()
    print(text)
    print(f"\nwritten to {path} and {path.with_suffix('.png').name} ({result['duration_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
