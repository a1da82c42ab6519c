"""Benchmark: data preparation throughput (load + chat template + tokenize + truncate or pack), examples/s.

    python -m bench.data             # part of `make bench`

Data: N conversational prompt-completion examples from `tiny_assets.make_example` (the default recipe's format and
generator, seed 1), tokenized with the tiny tokenizer and its chat template. Two paths on the same rows:

- pack: the rows written as train.jsonl; `run_config.parse_args` on the default recipe's sft.yaml with this
  dataset, then `trainer_for` (train/build.py) as the entry point builds it: `loading.load_for`
  (datasets.load_dataset of the JSONL) and SFTTrainer's preparation with the recipe's settings (max_length 64).
- TRL default: `datasets.Dataset.from_list(rows)` and `SFTTrainer(model, args=SFTConfig(output_dir, packing=...))`,
  everything else TRL's default (max_length 1024) but bf16, off on CPU.
- TRL at the recipe's length: the same, with `max_length` set to the recipe's (64). It separates the cost of the
  pack's code path (pack vs this) from the cost of the setting: packing into 64-token rows makes ~17x more rows
  than into 1024-token rows, and TRL's best-fit-decreasing packer works per row.

Each with `packing` false and true (TRL's default strategy, bfd), `dataset_num_proc` left at its default (None:
one process). Timed: the load (loading.load_for / Dataset.from_list) and TRL's `_prepare_dataset` (chat
template, tokenize, labels, truncate or pack), with clocks wrapped around those two functions during a real
trainer construction; the model load and the rest of the construction are not counted. Every run gets an empty
datasets cache, so nothing is reused from an earlier run (a repeated real run would reuse the cached Arrow files
and skip the work). The order of the paths alternates per repetition.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

RECIPE_SFT = Path(__file__).resolve().parents[1] / "recipes" / "tiny-cpu-lora" / "sft.yaml"
DEFAULTS = dict(examples=10000, reps=2)


def write_rows(out: Path, n: int, seed: int = 1) -> list[dict]:
    from fsdp_recipes.api import make_example

    rng = random.Random(seed)
    rows = [make_example(rng) for _ in range(n)]
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "train.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return rows


class Clocks:
    """Wrap a function (module or class attribute) with a clock that adds up its time while active."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.undo = []

    def wrap(self, owner, name: str, label: str) -> None:
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - t0

        setattr(owner, name, timed)
        self.undo.append((owner, name, original))

    def restore(self) -> None:
        for owner, name, original in reversed(self.undo):
            setattr(owner, name, original)


def pack_path(data_dir: Path, work: Path, packing: bool) -> dict:
    from trl import SFTTrainer

    from fsdp_recipes.api import data_loading, parse_and_check, run_report_for, trainer_for

    argv = ["--config", str(RECIPE_SFT), "--dataset_name", str(data_dir), "--eval_strategy", "no",
            "--packing", str(packing).lower(), "--output_dir", str(work / "out"), "--save_merged_model", "false"]
    cfg = parse_and_check(argv, quiet=True)
    clocks = Clocks()
    clocks.wrap(data_loading, "load_for", "load")  # what the SFT kind loads its splits with
    clocks.wrap(SFTTrainer, "_prepare_dataset", "prepare")
    try:
        trainer = trainer_for(cfg, run_report_for(cfg))
    finally:
        clocks.restore()
    return {**clocks.seconds, "rows_out": len(trainer.train_dataset), "max_length": cfg.training.max_length}


def trl_default_path(rows: list[dict], work: Path, packing: bool, max_length: int | None = None) -> dict:
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from fsdp_recipes.api import ensure_tiny_assets

    model = str(ensure_tiny_assets(quiet=True)["model"])
    t0 = time.perf_counter()
    ds = Dataset.from_list(rows)
    load = time.perf_counter() - t0
    clocks = Clocks()
    clocks.wrap(SFTTrainer, "_prepare_dataset", "prepare")
    try:
        # bf16: TRL defaults to True, which a CPU-only torch refuses; it does not touch the data path.
        args = SFTConfig(output_dir=str(work / "out"), packing=packing, report_to="none", bf16=False,
                         **({"max_length": max_length} if max_length else {}))
        trainer = SFTTrainer(model=model, args=args, train_dataset=ds)
    finally:
        clocks.restore()
    return {"load": load, **clocks.seconds, "rows_out": len(trainer.train_dataset), "max_length": args.max_length}


PATHS = ("pack", "trl_default", "trl_recipe_length")


def recipe_max_length() -> int:
    import yaml

    return int(yaml.safe_load(RECIPE_SFT.read_text())["max_length"])


def run(work: Path, examples: int = DEFAULTS["examples"], reps: int = DEFAULTS["reps"]) -> dict:
    import datasets

    datasets.disable_progress_bars()
    work.mkdir(parents=True, exist_ok=True)
    data_dir = work / "data"
    rows = write_rows(data_dir, examples)
    length = recipe_max_length()
    runs = []
    for rep in range(reps):
        for packing in (False, True):
            order = PATHS if rep % 2 == 0 else PATHS[::-1]
            for path in order:
                run_dir = work / f"{path}-{packing}-{rep}"
                # an empty cache for every run: datasets reads HF_DATASETS_CACHE from its config at each load
                datasets.config.HF_DATASETS_CACHE = run_dir / "hf-datasets"
                if path == "pack":
                    r = pack_path(data_dir, run_dir, packing)
                else:
                    r = trl_default_path(rows, run_dir, packing, length if path == "trl_recipe_length" else None)
                total = r["load"] + r["prepare"]
                runs.append({"rep": rep, "path": path, "packing": packing, **r, "total_s": total,
                             "examples_per_s": examples / total, "prepare_examples_per_s": examples / r["prepare"]})
                print(f"[bench-data] rep {rep} {path} packing={packing}: {examples / total:,.0f} examples/s "
                      f"(load {r['load']:.2f} s, prepare {r['prepare']:.2f} s, {r['rows_out']:,} rows of "
                      f"max_length {r['max_length']})", flush=True)
    summary = {}
    for packing in (False, True):
        suffix = "_packing" if packing else ""
        for path in PATHS:
            sel = [r for r in runs if r["path"] == path and r["packing"] == packing]
            summary[f"{path}{suffix}"] = {
                "median_examples_per_s": statistics.median(r["examples_per_s"] for r in sel),
                "median_prepare_examples_per_s": statistics.median(r["prepare_examples_per_s"] for r in sel),
            }
        pack = summary[f"pack{suffix}"]["median_examples_per_s"]
        summary[f"ratio_pack_over_trl{suffix}"] = pack / summary[f"trl_default{suffix}"]["median_examples_per_s"]
        summary[f"ratio_pack_over_trl_recipe_length{suffix}"] = (
            pack / summary[f"trl_recipe_length{suffix}"]["median_examples_per_s"])
    return {"examples": examples, "format": "conversational prompt-completion (tiny_assets.make_example)",
            "recipe_max_length": length, "dataset_num_proc": None, "reps": reps, "runs": runs, "summary": summary}


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        res = run(Path(tmp))
    print(json.dumps(res["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
