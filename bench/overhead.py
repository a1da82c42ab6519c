"""Benchmark: the pack's training step against a bare PyTorch loop, same model, batches and optimizer.

    python -m bench.overhead              # both layouts below; part of `make bench`

Model: a Mistral built from a config with random weights (MistralForCausalLM, hidden 512, 8 heads, intermediate
1536, 6 layers, the tiny tokenizer's 268-token vocabulary: 20.7M parameters, so the decoder layers' matmuls
dominate), fp32, saved once with save_pretrained and loaded by both sides from the same files.
Batches: fixed-length rows of random token ids (no padding), taken in the same order by both sides
(`train_sampling_strategy: sequential`; with 2 ranks, rank r takes batches r, r+2, ... as accelerate's
dataloader does). Optimizer: what the Trainer builds from the recipe's settings, written out by hand on the
bare side: torch AdamW (fused, as `optim: adamw_torch_fused`, transformers' default on torch >= 2.8), the
recipe's learning rate, cosine schedule with warm-up, gradient clipping at max_grad_norm 1.0. Full fine-tuning
(no LoRA): every parameter gets gradients and optimizer updates on both sides.

Two layouts, each measured step by step in pairs: in every run the pack's trainer takes its steps, and after each
of them a callback (added last) runs one bare step on a second model in the same process (or ranks). So every pack
step and its bare step are measured within about a second of each other, under the same state of the shared
machine: on the 2-core VM the same step took 0.43 s in one run and 0.62 s in another, a swing that comparing
separate runs per side (this benchmark's design until 2026-11-22 16:30 UTC) could not tell from overhead. Every pack
step follows a bare step and every bare step a pack step, so cache and allocator effects of the switch fall on both.

- 1 process, no FSDP, 1 thread: `python -m bench.overhead --worker`.
- 2 processes, FSDP2 over gloo: `accelerate launch --config_file recipes/tiny-cpu-lora/accelerate.yaml` (the
  default recipe's own YAML, as the launcher runs it) starts the worker; the pack side then goes through the
  CPU FSDP adapter and accelerate's `fsdp2_prepare_model`; the bare side calls torch's `fully_shard` on every
  decoder layer and then the root, with reshard_after_forward (what that YAML asks for).

Pack side: `run_config.parse_args` on the default recipe's sft.yaml plus overrides (this model, this data,
`use_peft false`, batch, length, steps), then `trainer_for` (train/build.py), the trainer the entry point builds:
TRL SFTTrainer (its loss through TRL's fused LM head, its entropy and token-accuracy metrics), the pack's
RunReportCallback with its token counter, CompletionMarkerCallback and PreemptionCallback (one all-reduce per step
under 2 processes), the Trainer's logging every `logging_steps`. Bare side: forward with labels, backward, clip,
optimizer step, scheduler step, zero_grad.

Measured, per pair: the pack's span runs from the end of the previous bare step (or the start of training) to the
pack's step end (its callbacks included), i.e. the Trainer's loop, batch fetch + collate, forward, backward, clip,
optimizer step, scheduler, logging and the pack's callbacks; the bare span runs from there to the end of the bare
step (batch from the same rows, forward, backward, clip, step, schedule, zero_grad). The first `warmup` pairs of
every run are dropped (allocator and thread-pool warm-up, the Trainer's lazy set-up; the first run in a fresh
process stayed slow for about 4 steps under 2 processes). Not measured here: process start, imports, model load,
dataset preparation, the FSDP wrap, saving (see bench_first_step.py for those).
Overhead = median over all measured pairs of all repetitions of (pack span / bare span) - 1 (`overhead_of`); the
medians per side and every span are kept. The same is computed from the process's CPU time per span
(`time.process_time`, all threads of rank 0's process): the wall clock is what a user waits for; the CPU time leaves
out the time the process waits for a core that other work holds or for its peer rank in a collective.
Each figure's 95% interval comes from a two-level bootstrap (`overhead_interval`): repetitions drawn with
replacement, then pairs within each drawn repetition, which carries differences between runs (each builds its own
models) into the interval. The verdict against the 5% goal is "within" only when the whole interval lies under it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fsdp_recipes.api import parse_args

REPO_RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "tiny-cpu-lora"

# ~20.7M parameters with the tiny tokenizer's 268-token vocabulary: 6 x (4 x 512^2 + 3 x 512 x 1536) in the layers.
SHAPE = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=8,
             num_key_value_heads=8, head_dim=64)
# For tests and `make bench ARGS=--quick`: checks the plumbing, says nothing about overhead.
QUICK_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=2, head_dim=32)
# Sizes of the measured run (batch is the global batch: 2 rows per step in both layouts, 1 per rank under 2
# processes): 4 x 12 pairs per layout, about 3 minutes for both on 2 cores. Tests pass smaller ones.
DEFAULTS = dict(batch=2, seq=128, warmup=2, steps=12, reps=4)
GOAL_PCT = 5.0  # the goal: the pack's step at most 5% slower than the bare loop


def build_bench_model(out: Path, shape: dict = SHAPE) -> dict:
    """The random-weight model both sides load, and its parameter count."""
    from transformers import AutoTokenizer

    from fsdp_recipes.api import build_tiny_model, ensure_tiny_assets

    if not (out / "model.safetensors").is_file():
        tok = AutoTokenizer.from_pretrained(ensure_tiny_assets(quiet=True)["model"])
        build_tiny_model(tok, out, shape=shape)
    cfg = json.loads((out / "config.json").read_text())
    h, i, n, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    # q, k, v, o projections + gate/up/down + two RMSNorm weights per layer; embeddings and LM head (untied); final norm
    params = n * (h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h) + 2 * v * h + h
    return {"path": str(out), "parameters": params, **{k: cfg[k] for k in SHAPE}, "vocab_size": v}


def write_token_rows(out: Path, lengths: list[int], vocab: int, seed: int = 0) -> Path:
    """train.jsonl of random token rows of the given lengths (bench_gpu.py uses it too). `input_ids` makes TRL treat
    the data as tokenized; the empty `text` column only satisfies the entry point's column check (the Trainer drops
    it: not a model input)."""
    import random

    rng = random.Random(seed)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "train.jsonl", "w") as f:
        for n in lengths:
            # ids from 6 on: 0-5 are the tiny tokenizer's special tokens (<pad> among them)
            f.write(json.dumps({"text": "", "input_ids": [rng.randrange(6, vocab) for _ in range(n)]}) + "\n")
    return out


# ---- the two sides (run inside the worker processes) --------------------------------------------------------------

def pack_args(model_dir: str, data_dir: str, out_dir: str, batch: int, seq: int, steps: int) -> list[str]:
    return ["--config", str(REPO_RECIPE / "sft.yaml"), "--model_name_or_path", model_dir, "--dataset_name", data_dir,
            "--use_peft", "false", "--tiny_assets", "false", "--save_merged_model", "false",
            "--per_device_train_batch_size", str(batch), "--max_length", str(seq), "--max_steps", str(steps),
            "--eval_strategy", "no", "--save_strategy", "no", "--train_sampling_strategy", "sequential",
            "--output_dir", out_dir, "--disable_tqdm", "true"]


class BareLoop:
    """The bare side: forward with labels, backward, clip, AdamW step, schedule, zero_grad; the same settings the
    Trainer resolves, one `step(k)` at a time so that the pack's run can call it between its own steps."""

    def __init__(self, model_dir: str, data_dir: str, batch: int, seq: int, steps: int):
        import math

        import torch
        import torch.distributed as dist
        from transformers import AutoModelForCausalLM


        # The recipe's optimizer settings, resolved by the same parser (no hand-copied numbers).
        training = parse_args(pack_args(model_dir, data_dir, tempfile.gettempdir(), batch, seq, steps)).training
        if training.optim != "adamw_torch_fused":  # the only optimizer written out below
            raise ValueError(f"bench_overhead mirrors adamw_torch_fused, the recipe resolves {training.optim}")
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.batch, self.max_grad_norm = batch, training.max_grad_norm
        self.rows = [json.loads(line)["input_ids"] for line in open(Path(data_dir) / "train.jsonl")]
        torch.manual_seed(training.seed)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
        model.train()
        if self.world > 1:
            from torch.distributed.fsdp import fully_shard

            for layer in model.model.layers:
                fully_shard(layer, reshard_after_forward=True)
            fully_shard(model, reshard_after_forward=True)
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=training.learning_rate,
                                     betas=(training.adam_beta1, training.adam_beta2), eps=training.adam_epsilon,
                                     weight_decay=training.weight_decay, fused=True)
        warm = training.warmup_steps

        def lr_lambda(step: int) -> float:  # transformers' get_cosine_schedule_with_warmup, half a cosine wave
            if step < warm:
                return step / max(1, warm)
            progress = (step - warm) / max(1, steps - warm)
            return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))

        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_lambda)

    def step(self, k: int) -> None:
        import torch

        b = k * self.world + self.rank  # accelerate's per-rank batches of a sequential sampler: r, r + world, ...
        ids = torch.tensor(self.rows[b * self.batch:(b + 1) * self.batch])
        loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)


def run_paired(argv: list[str], bare: BareLoop) -> dict[str, list[tuple[tuple, tuple]]]:
    """The entry point's trainer (train/build.py trainer_for) for max_steps, with one bare step after each of its steps.

    Returns each side's step spans as (start, end) clock readings: the pack's from the end of the previous bare step
    (or the start of training) to its own step end, so that the Trainer's loop, batch fetch, forward, backward,
    optimizer, logging and the pack's callbacks all fall in it; the bare step's from there to its own end."""
    from transformers import TrainerCallback

    from fsdp_recipes.api import run_report_for, trainer_for

    cfg = parse_args(argv)
    report = run_report_for(cfg)
    trainer = trainer_for(cfg, report)
    spans = {"pack": [], "bare": []}
    last = []

    class PairedStep(TrainerCallback):  # added last: the pack's callbacks run inside the pack's span
        def on_train_begin(self, args, state, control, **kwargs):
            last.append(clock())

        def on_step_end(self, args, state, control, **kwargs):
            end = clock()
            spans["pack"].append((last[-1], end))
            bare.step(state.global_step - 1)
            last.append(clock())
            spans["bare"].append((end, last[-1]))

    trainer.add_callback(PairedStep())
    trainer.train()
    del trainer
    return spans


def clock() -> tuple[float, float]:
    """(wall clock, this process's CPU time over all its threads); the module docstring says what each shows.
    The CPU time misses time spent waiting (for a collective's peer, for I/O)."""
    return time.perf_counter(), time.process_time()


def step_times(spans: list[tuple[tuple, tuple]], warmup: int, which: int = 0) -> list[float]:
    """Durations of the (start, end) spans (which=0: wall clock, 1: CPU time), without the first `warmup`."""
    return [b[which] - a[which] for a, b in spans][warmup:]


def worker(model_dir: str, data_dir: str, out: Path, batch: int, seq: int, warmup: int, steps: int,
           reps: int) -> dict:
    """`reps` paired runs in this process (or these ranks); rank 0 writes every step time to `out`."""
    import gc

    from fsdp_recipes.api import set_up_process

    fsdp = set_up_process()  # a no-op outside `accelerate launch` with an FSDP config (the 1-process layout)
    import torch
    import torch.distributed as dist


    with tempfile.TemporaryDirectory() as tmp:  # TrainingArguments.device creates the process group (gloo on CPU)
        _ = parse_args(pack_args(model_dir, data_dir, tmp, batch, seq, warmup + steps)).training.device
    rank = dist.get_rank() if dist.is_initialized() else 0
    if not dist.is_initialized():
        # One thread, as each of the 2 ranks has (torchrun sets OMP_NUM_THREADS=1): on a 2-core machine shared with
        # other jobs, 2 threads stall on whichever core is busy, and the step time then varied 0.2-5 s (measured).
        torch.set_num_threads(1)
    total = warmup + steps
    runs = []
    for rep in range(reps):
        gc.collect()
        if dist.is_initialized():
            dist.barrier()
        bare = BareLoop(model_dir, data_dir, batch, seq, total)
        with tempfile.TemporaryDirectory(prefix="bench-overhead-") as tmp:
            spans = run_paired(pack_args(model_dir, data_dir, tmp, batch, seq, total), bare)
        del bare
        for side in ("pack", "bare"):
            times = step_times(spans[side], warmup)
            runs.append({"rep": rep, "side": side, "step_times_s": times, "median_step_s": statistics.median(times),
                         "step_cpu_s": step_times(spans[side], warmup, which=1)})
        if rank == 0:
            pct = overhead_of({r["side"]: r["step_times_s"] for r in runs[-2:]}, paired=True)
            print(f"[bench-overhead] rep {rep}: median step pack {runs[-2]['median_step_s']:.3f} s, "
                  f"bare {runs[-1]['median_step_s']:.3f} s, overhead {pct:+.1f}%", flush=True)
    world = dist.get_world_size() if dist.is_initialized() else 1
    result = {"design": "paired", "world_size": world, "fsdp": "FSDP2 (cpu_fsdp adapter, gloo)" if fsdp else None,
              "torch_threads": torch.get_num_threads(), "batch_per_rank": batch, "seq_len": seq,
              "warmup_steps_dropped": warmup, "measured_steps_per_run": steps, "reps": reps, "runs": runs}
    if rank == 0:
        out.write_text(json.dumps(result))
    return result


def by_rep(layout: dict, key: str = "step_times_s") -> dict[int, dict[str, list[float]]]:
    out: dict[int, dict[str, list[float]]] = {}
    for r in layout["runs"]:
        out.setdefault(r["rep"], {})[r["side"]] = r[key]
    return out


def overhead_of(sides: dict[str, list[float]], paired: bool) -> float:
    """The overhead statistic, in %. Paired runs: the median of the per-step ratios pack_i / bare_i, each pair
    measured within about a second, so the machine's drift cancels inside every ratio. Files of the earlier design
    (separate runs per side, no `"design": "paired"`): the ratio of the two sides' medians."""
    if paired:
        return 100.0 * (statistics.median(p / b for p, b in zip(sides["pack"], sides["bare"])) - 1.0)
    return 100.0 * (statistics.median(sides["pack"]) / statistics.median(sides["bare"]) - 1.0)


def overhead_interval(layout: dict, resamples: int = 2000, seed: int = 0,
                      key: str = "step_times_s") -> tuple[float, float]:
    """95% bootstrap interval of the overhead in %, two levels: draw repetitions with replacement, then within each
    drawn repetition its steps with replacement (paired: whole pairs; earlier design: each side's steps on their
    own); the statistic is `overhead_of`. Percentile interval; the seed is fixed so that the same JSON gives the
    same interval."""
    import random

    rng = random.Random(seed)
    paired = layout.get("design") == "paired"
    reps = by_rep(layout, key)
    stats = []
    for _ in range(resamples):
        pooled = {"bare": [], "pack": []}
        for rep in rng.choices(sorted(reps), k=len(reps)):
            if paired:
                idx = rng.choices(range(len(reps[rep]["pack"])), k=len(reps[rep]["pack"]))
                for side in pooled:
                    pooled[side] += [reps[rep][side][i] for i in idx]
            else:
                for side, times in reps[rep].items():
                    pooled[side] += rng.choices(times, k=len(times))
        stats.append(overhead_of(pooled, paired))
    stats.sort()
    return stats[int(0.025 * (resamples - 1))], stats[int(0.975 * (resamples - 1))]


def verdict(interval: tuple[float, float], repetitions: int, goal_pct: float = GOAL_PCT) -> str:
    if repetitions < 2:  # the bootstrap then resamples steps only: its interval says nothing about the drift
        return "undecided: one repetition gives no interval across the machine's drift"
    lo, hi = interval
    if hi < goal_pct:
        return "within goal"
    if lo > goal_pct:
        return "over goal"
    return "undecided: the interval spans the goal"


def describe(overhead: dict) -> str:
    """One overhead figure of `summarize` in words: "+1.9% (95% interval -2.4% to +10.1%: undecided: ...)"."""
    lo, hi = overhead["overhead_pct_ci95"]
    return f"{overhead['overhead_pct']:+.1f}% (95% interval {lo:+.1f}% to {hi:+.1f}%: {overhead['verdict']})"


def summarize(layout: dict) -> dict:
    """Medians per side from the recorded step times, and the overhead (`overhead_of`) with its interval: by the
    wall clock (the headline) and by CPU time (`step_cpu_s`, where the JSON has it)."""
    paired = layout.get("design") == "paired"

    def overhead(key: str) -> dict:
        reps = by_rep(layout, key)
        pooled = {side: [t for rep in sorted(reps) for t in reps[rep][side]] for side in ("bare", "pack")}
        pct = overhead_of(pooled, paired)
        interval = overhead_interval(layout, key=key)
        return {"median_step_s": {side: statistics.median(t) for side, t in pooled.items()},
                "overhead_ratio": 1.0 + pct / 100.0, "overhead_pct": pct, "overhead_pct_ci95": list(interval),
                "goal_pct": GOAL_PCT, "verdict": verdict(interval, len(reps)),
                "per_rep_ratio": [1.0 + overhead_of(reps[rep], paired) / 100.0 for rep in sorted(reps)]}

    wall = overhead("step_times_s")
    tokens_per_step = layout["batch_per_rank"] * layout["seq_len"] * layout["world_size"]
    return {
        **wall,
        "statistic": "median of per-step pack/bare ratios" if paired else "ratio of the sides' medians",
        "tokens_per_s": {k: tokens_per_step / v for k, v in wall["median_step_s"].items()},
        "cpu_time": overhead("step_cpu_s") if all("step_cpu_s" in r for r in layout["runs"]) else None,
    }


# ---- driver ----------------------------------------------------------------------------------------------------

def run_layout(processes: int, model: dict, data_dir: Path, work: Path, sizes: dict) -> dict:
    out = work / f"overhead-{processes}proc.json"
    worker_args = ["-m", "bench.overhead", "--worker", "--model", model["path"],
                   "--data", str(data_dir), "--out", str(out),
                   *[a for k, v in sizes.items() for a in (f"--{k}", str(v if k != "batch" else v // processes))]]
    if processes == 1:
        cmd = [sys.executable, *worker_args]
    else:
        acc = REPO_RECIPE / "accelerate.yaml"
        cmd = [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file", str(acc),
               "--num_processes", str(processes), "--main_process_port", "0", *worker_args]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    t0 = time.time()
    log = work / f"overhead-{processes}proc.log"
    with open(log, "w") as f:
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    if rc != 0 or not out.is_file():
        tail = "\n".join(log.read_text().splitlines()[-15:])
        raise RuntimeError(f"overhead benchmark ({processes} process(es)) failed with code {rc}:\n{tail}")
    layout = json.loads(out.read_text())
    layout["wall_s"] = time.time() - t0
    layout["command"] = " ".join(cmd)
    layout["summary"] = summarize(layout)
    return layout


def run(work: Path, sizes: dict | None = None, layouts: tuple[int, ...] = (1, 2), shape: dict = SHAPE) -> dict:
    sizes = {**DEFAULTS, **(sizes or {})}
    model = build_bench_model(work / "model", shape)
    data_dir = work / "data"
    # one row per global batch slot and step: every layout reads the same rows in the same order
    write_token_rows(data_dir, [sizes["seq"]] * (sizes["batch"] * (sizes["warmup"] + sizes["steps"])),
                     model["vocab_size"])
    return {"model": model, "optimizer": "torch AdamW fused, recipe lr/cosine/warm-up, clip 1.0",
            "sizes": sizes, "layouts": {f"{p}proc": run_layout(p, model, data_dir, work, sizes) for p in layouts}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help="internal: run the alternating sides in this process")
    ap.add_argument("--model")
    ap.add_argument("--data")
    ap.add_argument("--out", type=Path)
    for k, v in DEFAULTS.items():
        ap.add_argument(f"--{k}", type=int, default=v)
    args = ap.parse_args(argv)
    sizes = {k: getattr(args, k) for k in DEFAULTS}
    if args.worker:
        worker(args.model, args.data, args.out, **sizes)
        return 0
    with tempfile.TemporaryDirectory(prefix="bench-overhead-") as tmp:
        res = run(Path(tmp), sizes)
    for name, layout in res["layouts"].items():
        s = layout["summary"]
        for clock_name, o in (("wall clock", s), ("CPU time", s["cpu_time"])):
            print(f"{name}, {clock_name}: bare {o['median_step_s']['bare']:.3f} s/step, "
                  f"pack {o['median_step_s']['pack']:.3f} s/step, overhead {describe(o)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
