"""Two-digit additions for the SmolLM2 default: train and test questions disjoint by construction.

    python -m fsdp_recipes.assets.addition_data --out DIR     # writes DIR/train.jsonl and DIR/test.jsonl

Why this task: SmolLM2-135M-Instruct follows the chat format but cannot add two-digit numbers (asked "What is
12 + 7?" it answers "9"), and a few CPU minutes of LoRA teach it to, on questions it never saw. Exact match of
the answer is a check a reader can redo by hand.

Disjoint by construction: the unordered pairs {a, b} with 10 <= a, b <= 99 (4,095 of them) are shuffled with a
fixed seed and cut in two; a test pair never appears in training in either order, so a correct test answer
cannot be a recalled training example (nor its commuted twin). Every line is a prompt-completion chat example,
the format TRL's SFTTrainer trains on with the loss on the completion only.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

# One system line states the expected format, for the base model and the fine-tuned one alike, so the evaluation
# measures the arithmetic rather than the base model's guess at the format. It also replaces SmolLM2's default
# system prompt (the chat template inserts one when there is none): 10 tokens instead of 19, on every sequence.
SYSTEM = "Answer with the number only."
LOW, HIGH = 10, 99
SEED = 0
N_TEST = 100  # the end-of-run summary generates an answer to each, twice (base, trained): 100 keeps that short


def pairs() -> list[tuple[int, int]]:
    """Every unordered pair (a <= b) of two-digit numbers, in a fixed order."""
    return [(a, b) for a in range(LOW, HIGH + 1) for b in range(a, HIGH + 1)]


def split(n_test: int = N_TEST, seed: int = SEED) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(train pairs, test pairs): one seeded shuffle, cut after n_test; disjoint as unordered pairs."""
    everything = pairs()
    random.Random(seed).shuffle(everything)
    return everything[n_test:], everything[:n_test]


def example(a: int, b: int) -> dict:
    return {
        "prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"What is {a} + {b}?"}],
        "completion": [{"role": "assistant", "content": str(a + b)}],
    }


def write(out: Path, n_test: int = N_TEST, seed: int = SEED) -> dict[str, int]:
    """train.jsonl (each training pair once, in a random order of its two operands) and test.jsonl; returns the
    row counts. Deterministic: the same files on every machine."""
    train, test = split(n_test, seed)
    rng = random.Random(seed + 1)
    out.mkdir(parents=True, exist_ok=True)
    counts = {}
    for name, rows in (("train", train), ("test", test)):
        with open(out / f"{name}.jsonl", "w") as f:
            for a, b in rows:
                if rng.random() < 0.5:  # both orders occur in training; a test pair is held out in both
                    a, b = b, a
                f.write(json.dumps(example(a, b)) + "\n")
        counts[name] = len(rows)
    return counts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    counts = write(args.out)
    print(f"[addition-data] {args.out}: {counts['train']} train, {counts['test']} test questions (disjoint pairs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
