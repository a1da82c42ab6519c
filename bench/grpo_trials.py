"""How the GRPO demo's design was chosen: plain TRL GRPOTrainer runs in one process (no pack, no FSDP), from the
default SFT run's merged model, scored on 400 *training* questions GRPO never sees (train.jsonl rows 1,600 to 1,999,
as bench/dpo_validation.py scores DPO's) and on the 100 held-out questions.

    python -m bench.grpo_trials --lr 2e-5 --steps 40 --seed 1 --prompts random --temperature 1.0 --beta 0 \\
        --out /tmp/grpo-trial                    # after `make finetune`; about 6-7 min on the 2-core VM

--prompts: `random` (training rows 0 to 1,599), `hard` (the SFT model's greedy mistakes on them: the DPO demo's
pairs, $FSDP_RECIPES_CACHE/addition-preferences, which `make finetune RECIPE=smollm2-135m-dpo` builds), `mix` (the
mistakes and rows 0 to 799). Every run made and its result: bench/README.md, "GRPO on the default".
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from fsdp_recipes.api import cache_dir

SFT = "runs/smollm2-135m-lora/merged"
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def prompts(kind: str) -> list[dict]:
    data, pairs = cache_dir() / "two-digit-addition", cache_dir() / "addition-preferences"
    plain = [{"prompt": r["prompt"], "answer": r["completion"][0]["content"]} for r in rows(data / "train.jsonl")]
    hard = [{"prompt": r["prompt"], "answer": r["chosen"][0]["content"]} for r in rows(pairs / "train.jsonl")] \
        if kind != "random" else []
    return {"random": plain[:1600], "hard": hard, "mix": hard + plain[:800]}[kind]


def exact(completions, answer, **kwargs):
    return [1.0 if c[0]["content"].strip() == a else 0.0 for c, a in zip(completions, answer)]


def score(model: str, questions: list[dict]) -> int:
    from fsdp_recipes.api import generate

    answers = generate(model, [r["prompt"] for r in questions])
    return sum(a == r["completion"][0]["content"] for a, r in zip(answers, questions))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lr", type=float, required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--prompts", choices=("random", "hard", "mix"), default="random")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--beta", type=float, default=0.0)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(2)
    config = GRPOConfig(output_dir=str(args.out), learning_rate=args.lr, max_steps=args.steps,
                        per_device_train_batch_size=4 * args.generations, num_generations=args.generations,
                        max_completion_length=6, beta=args.beta, temperature=args.temperature, seed=args.seed,
                        logging_steps=2, save_strategy="no", report_to=[], use_cpu=True,
                        lr_scheduler_type="constant", bf16=False, dataloader_pin_memory=False)
    trainer = GRPOTrainer(model=SFT, reward_funcs=exact, args=config, train_dataset=Dataset.from_list(
        prompts(args.prompts)), peft_config=LoraConfig(r=16, lora_alpha=32, target_modules=LORA_TARGETS,
                                                       task_type="CAUSAL_LM"))
    start = time.time()
    trainer.train()
    train_s = time.time() - start
    merged = str(args.out / "merged")
    trainer.model.merge_and_unload().save_pretrained(merged)
    AutoTokenizer.from_pretrained(SFT).save_pretrained(merged)
    data = cache_dir() / "two-digit-addition"
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "train_s": round(train_s, 1),
              "held_out": score(merged, rows(data / "test.jsonl")),
              "validation_of_400": score(merged, rows(data / "train.jsonl")[1600:2000]),
              "rewards": [round(h["reward"], 3) for h in trainer.state.log_history if "reward" in h]}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
