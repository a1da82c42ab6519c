"""Preference pairs for DPO on the default's task, built from the SFT model's own answers (on-policy), which the
caller's `generate` gives (evaluation/generation.py's, from train/run_checks.py: the evaluation room sits above this
one).

What DPO can teach here is to stop making the mistakes the SFT model makes, so the pairs are its mistakes:
- train.jsonl: the model answers the first TRAIN_QUESTIONS questions of the *training* split
  (assets/addition_data.py's train.jsonl, as the SFT run read it) greedily; each wrong answer is a pair, the right sum chosen and the model's answer
  rejected. Where it answers right there is nothing to prefer, and no pair.
- test.jsonl: every one of the 100 *held-out* questions is a pair built the same way, so the summary can measure
  preference on questions no stage trained on: the model's own answer rejected where it is wrong, and where it is
  right a near miss the model might give, the sum off by ten (a carry dropped or added).

The pairs depend on the model, so a stamp (`source.json`: the model folder and its weights' size and time) says
which model they came from; a new SFT model makes new pairs. Generation is plain transformers on the CPU, batched.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

from fsdp_recipes.assets import smollm2
from fsdp_recipes.errors import UserError
from fsdp_recipes.paths import cache_dir

TRAIN_QUESTIONS = 1600  # of the 3,995 training questions; the SFT run trained on the first 768 of a shuffle
QUESTIONS_ENV = "FSDP_RECIPES_PREFERENCE_QUESTIONS"  # fewer questions (the test suite's short run)
BATCH = 100
STAMP = "source.json"
OWN_FOLDER = "addition-preferences"  # in the pack's cache: the DPO and KTO demos' dataset_name
VERSION = 4  # of how pairs are built: a change here rebuilds every cached set


def question_counts() -> tuple[int, int]:
    """(training questions, held-out questions) the model answers: FSDP_RECIPES_PREFERENCE_QUESTIONS ("N" or
    "N,M"), else (TRAIN_QUESTIONS, all 100)."""
    value = os.environ.get(QUESTIONS_ENV, str(TRAIN_QUESTIONS))
    parts = value.split(",")
    if len(parts) > 2 or not all(p.isdigit() and int(p) >= 1 for p in parts) or int(parts[0]) > 3995 or (
            len(parts) == 2 and int(parts[1]) > 100):
        raise UserError(f"{QUESTIONS_ENV}={value!r} is not N or N,M (N training questions, 1 to 3995; M held-out "
                        f"questions, 1 to 100). Fix: set how many questions the SFT model answers to make pairs "
                        f"(default {TRAIN_QUESTIONS},100), or unset it.")
    return int(parts[0]), int(parts[1]) if len(parts) == 2 else 100


def source_of(model: Path) -> dict:
    """What identifies the model the pairs come from: its folder and its weight files' sizes and times."""
    files = sorted(model.glob("*.safetensors"))
    return {"version": VERSION, "model": str(model.resolve()), "questions": list(question_counts()),
            "weights": [[f.name, f.stat().st_size, int(f.stat().st_mtime)] for f in files]}


def is_current(out: Path, model: Path) -> bool:
    stamp = out / STAMP
    return stamp.is_file() and json.loads(stamp.read_text()) == source_of(model)


def questions(split: str, n: int | None = None) -> list[tuple[list[dict], int]]:
    """(chat prompt, the sum) for the first `n` questions of the default's data files (the same prompts, operand
    order included, that the SFT run trained on and its summary scored), written first when missing."""
    data = smollm2.ensure_assets(model=False, quiet=True)["data"]
    rows = [json.loads(line) for line in (data / f"{split}.jsonl").read_text().splitlines()[:n]]
    return [(r["prompt"], int(r["completion"][-1]["content"])) for r in rows]


def pair(prompt: list[dict], chosen: str, rejected: str) -> dict:
    return {"prompt": prompt, "chosen": [{"role": "assistant", "content": chosen}],
            "rejected": [{"role": "assistant", "content": rejected}]}


def near_miss(total: int) -> str:
    return str(total + 10 if total < 100 else total - 10)


def write(model: Path, out: Path, generate: Callable, say=print) -> dict[str, int]:
    """train.jsonl and test.jsonl from `model`'s greedy answers (`generate(model folder, chat prompts, batch_size=)`:
    evaluation/generation.py's); returns the counts. The stamp is written last."""
    import torch

    torch.manual_seed(0)
    counts = {}
    t0 = time.time()
    for split, n in zip(("train", "test"), question_counts()):
        qs = questions(split, n)
        answers = generate(str(model), [p for p, _ in qs], batch_size=BATCH)
        rows, wrong = [], 0
        for (prompt, total), got in zip(qs, answers):
            if got != str(total):
                wrong += 1
                rows.append(pair(prompt, str(total), got))
            elif split == "test":
                rows.append(pair(prompt, str(total), near_miss(total)))
        if not rows:  # only the training split can end empty: every held-out question makes a pair
            raise UserError(f"addition_preferences: {model} answered all {len(qs)} training questions right, so there "
                            f"is no mistake to make a preference pair from. Fix: raise {QUESTIONS_ENV} (more "
                            "questions), or train DPO on other pairs (dataset_name, addition_preferences: false).")
        out.mkdir(parents=True, exist_ok=True)
        # a stamp before the first file, which no model matches: a folder this stops half-way in stays this module's
        # to rewrite (check_target), and is never current
        (out / STAMP).write_text(json.dumps({"writing": source_of(model)}))
        tmp = out / f".{split}.jsonl.tmp"
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        tmp.replace(out / f"{split}.jsonl")
        counts[split], counts[f"{split}_wrong"], counts[f"{split}_questions"] = len(rows), wrong, len(qs)
    (out / STAMP).write_text(json.dumps(source_of(model)))
    say(f"{counts['train']} training pairs (the model's mistakes on {counts['train_questions']} training questions), "
        f"{counts['test']} held-out pairs ({counts['test_wrong']} of its mistakes, the rest near misses) in "
        f"{time.time() - t0:.0f}s -> {out}")
    return counts


def stamped(out: Path) -> bool:
    """Whether `out` holds this module's stamp: a `source.json` of the shape write() gives it (the name alone is a
    common one for a data folder's own notes)."""
    try:
        stamp = json.loads((out / STAMP).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(stamp, dict) and ("writing" in stamp or "model" in stamp and (
        "version" in stamp or "train_questions" in stamp))  # the first stamps had no version


def check_target(out: Path) -> None:
    """`out` (dataset_name) is a folder this module may write its pairs into: absent, empty, stamped by it, or the
    recipes' own folder in the pack's cache (OWN_FOLDER). A user's own data there (dataset_name given on the command
    line, addition_preferences left on) was replaced by the demo's pairs, and trained on without a word; so was the
    pack's own SFT data (--dataset_name $FSDP_RECIPES_CACHE/two-digit-addition), which this module then reads its
    questions from."""
    if out.absolute() == (cache_dir() / OWN_FOLDER).absolute():  # a half-written one from before the first stamp
        return
    if out.exists() and not stamped(out) and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"addition_preferences is on, and it would replace what {out} holds (dataset_name: data it "
                        "did not write) with addition pairs from the SFT model's answers. Fix: --addition_preferences "
                        f"false (or addition_preferences: false in the recipe) to train on {out} itself.")


def ensure(model: str, out: str, generate: Callable, quiet: bool = False) -> Path:
    """The pairs for `model` in `out`, made when missing or made from another model (write)."""
    model_dir, out_dir = Path(model), Path(out)
    if not (model_dir / "config.json").is_file():
        raise UserError(f"addition_preferences: {model_dir} is not a model folder (no config.json). Fix: run the SFT "
                        "recipe first (make finetune RECIPE=smollm2-135m-lora), or point model_name_or_path at its "
                        "merged/ folder.")
    if not is_current(out_dir, model_dir):
        check_target(out_dir)
        say = (lambda *a: None) if quiet else (lambda *a: print("[addition-preferences]", *a, flush=True))
        say(f"answering the addition questions with {model_dir} to build preference pairs (once per model)")
        write(model_dir, out_dir, generate, say)
    return out_dir

