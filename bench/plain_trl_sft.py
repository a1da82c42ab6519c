"""The baseline of issue 33: the SFT script a user would write from TRL's docs for the default's job, no pack.

    python -m bench.plain_trl_sft --out /tmp/plain-trl [--steps 48] [--precision fp32|bf16]   # after `make smollm2`

Same model (the prepared SmolLM2-135M-Instruct), same data (two-digit addition, prompt-completion chat rows), LoRA
r16 alpha 32 on all seven projections, lr 1e-3 cosine with 3 warm-up steps, 48 steps of 16 sequences, seed 42, one
process, torch's default threads (one per core), TRL's defaults otherwise. Except one: SFTConfig's default bf16=True
stops on a CPU ("Your setup doesn't support bf16/gpu. You need to assign use_cpu"), so the script says one of the two
things a user would: `--precision fp32` sets bf16=False (issue 33's baseline: its final loss, 0.0589, is the pack's
float32 one to the digit), `--precision bf16` sets use_cpu=True as the message advises, which keeps bf16 autocast.
Prints one JSON line: training time (on_train_begin to on_train_end, as the pack's train_time_s), the final logged
loss, and the held-out exact match of the merged model, answered as the pack's summary answers.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from datasets import load_dataset
from peft import LoraConfig
from transformers import TrainerCallback
from trl import SFTConfig, SFTTrainer

from fsdp_recipes.api import cache_dir


class Clock(TrainerCallback):
    def on_train_begin(self, args, state, control, **kwargs):
        self.start = time.perf_counter()

    def on_train_end(self, args, state, control, **kwargs):
        self.seconds = time.perf_counter() - self.start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--precision", choices=("fp32", "bf16", "default"), default="fp32",
                    help="default: TRL's own (bf16=True), for a GPU; on a CPU it stops with TRL's error")
    args = ap.parse_args()

    model, data = cache_dir() / "smollm2-135m-instruct", cache_dir() / "two-digit-addition"
    ds = load_dataset("json", data_files={"train": str(data / "train.jsonl"), "test": str(data / "test.jsonl")})
    config = SFTConfig(output_dir=str(args.out), max_steps=args.steps, per_device_train_batch_size=16,
                       learning_rate=1e-3, lr_scheduler_type="cosine", warmup_steps=3,
                       logging_steps=min(4, args.steps),
                       save_strategy="no", report_to="none", seed=42,
                       **{"fp32": {"bf16": False}, "bf16": {"use_cpu": True}, "default": {}}[args.precision])
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    clock = Clock()
    trainer = SFTTrainer(model=str(model), args=config, train_dataset=ds["train"], peft_config=lora,
                         callbacks=[clock])
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]

    merged = args.out / "merged"
    trainer.model.merge_and_unload().save_pretrained(merged)
    trainer.processing_class.save_pretrained(merged)
    from fsdp_recipes.api import generate

    test = ds["test"]
    answers = generate(str(merged), list(test["prompt"]))
    correct = sum(a == c[-1]["content"] for a, c in zip(answers, test["completion"]))
    arm = {"fp32": "plain-trl", "bf16": "plain-trl-bf16", "default": "plain-trl-default"}[args.precision]
    print(json.dumps({"arm": arm, "device": str(trainer.args.device), "train_time_s": round(clock.seconds, 2),
                      "steps": trainer.state.global_step, "final_loss": losses[-1], "losses": losses,
                      "held_out_correct": correct,
                      "held_out": len(test), "bf16": config.bf16, "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
