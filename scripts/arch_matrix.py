"""The architecture matrix (`make arch-matrix`): LoRA and full fine-tuning of a tiny random model of each decoder family
in scripts/arch_families.py, under FSDP2 on 2 CPU processes, through the pack's own rank path.

One `accelerate launch` for the whole matrix: its two ranks import torch, transformers and TRL once and loop over the
families and methods in process. Each case is the pack's rank lifecycle (`train/entry.py` `train_once`: parse and
checks, TRL's SFTTrainer with the pack's callbacks, the final save and its check), on the recipe tiny-cpu-lora's FSDP2
settings without a wrap class (accelerate then wraps the model's own `_no_split_modules`). Then, on rank 0 with plain
transformers and PEFT:

- full: `from_pretrained(output_dir)` computes the logits the trained, sharded model computed in memory;
- LoRA: `PeftModel.from_pretrained(base, output_dir)` does, and `from_pretrained(output_dir/merged)` (the pack's
  merge) computes the same logits as base + adapter;
- either way the trained logits differ from the base model's (a save of the untrained model fails), and a tied head
  is still the input embedding after the reload.

    python scripts/arch_matrix.py [--families llama,gemma2] [--methods lora,full] [--out runs/arch-matrix]

Results: <out>/results.json and a table; exit 1 when a case that is not refused failed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # arch_families beside this file, under accelerate launch too
import arch_families  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
METHODS = ("lora", "full")
# |a - b| <= ATOL + RTOL * |b|, elementwise over the logits (float32): reloads and merges reorder float32 sums
ATOL, RTOL = 1e-4, 1e-4
# trained against base: at least this much apart somewhere, else the save may be the untrained model
MIN_CHANGE = 1e-3
CASE_TIMEOUT_S = 180  # a case takes 2-25 s on 2 busy cores
AGREE_TIMEOUT_S = 20  # a rank that failed alone waits this long for the other (agree)


def recipe(out: Path, steps: int) -> dict:
    """The matrix's trainer YAML: tiny-cpu-lora's training in a few steps, LoRA on every linear layer (PEFT's
    all-linear: the families name their projections differently), no LM head trained, and the pack's load checks."""
    return {
        "recipe_name": "arch-matrix", "min_gpus": 0, "save_merged_model": True, "verify_loaded_weights": True,
        "model_name_or_path": str(out / "models" / "llama"), "dtype": "float32", "attn_implementation": "sdpa",
        "use_peft": True, "lora_r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "lora_target_modules": "all-linear",
        "dataset_name": str(out / "data"), "dataset_train_split": "train", "dataset_test_split": "test",
        "output_dir": str(out / "runs"), "max_steps": steps, "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 1, "learning_rate": 1e-3, "lr_scheduler_type": "constant", "warmup_steps": 0,
        "max_length": 64, "packing": False, "bf16": False, "logging_steps": 1, "eval_strategy": "no",
        "save_strategy": "no", "report_to": "none", "seed": 0, "dataloader_num_workers": 0,
        # a rank left waiting in a collective by the other's failure gives up in 2 minutes, not torch's 30
        "ddp_timeout": 120,
    }


def accelerate_config() -> dict:
    """tiny-cpu-lora's accelerate YAML (FSDP2, 2 processes, no mixed precision) without the wrap class."""
    import yaml

    acc = yaml.safe_load((REPO / "recipes" / "tiny-cpu-lora" / "accelerate.yaml").read_text())
    acc["fsdp_config"].pop("fsdp_transformer_layer_cls_to_wrap")
    return acc


def launch(args) -> int:
    """Write the YAMLs, run the one launch (its output to <out>/launch.log, the matrix's own lines shown), print the
    table."""
    import yaml

    from fsdp_recipes.launch.launcher import accelerate_cmd

    out = Path(args.out).resolve()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    (out / "accelerate.yaml").write_text(yaml.safe_dump(accelerate_config()))
    (out / "sft.yaml").write_text(yaml.safe_dump(recipe(out, args.steps)))
    cmd = accelerate_cmd() + ["--config_file", str(out / "accelerate.yaml"), __file__, "--worker",
                              "--out", str(out), "--families", args.families, "--methods", args.methods]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1"}  # a CPU matrix, on any machine
    start = time.time()
    with open(out / "launch.log", "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            log.write(line)
            if line.startswith("[arch-matrix]"):
                print(line, end="", flush=True)
    code = proc.wait()
    results = json.loads((out / "results.json").read_text()) if (out / "results.json").is_file() else []
    results += not_run(results, args, out, code)
    print(table(results, time.time() - start))
    (out / "results.json").write_text(json.dumps(results, indent=1))
    return 1 if code or any(r["outcome"] == "fail" for r in results) else 0


def not_run(results: list[dict], args, out: Path, code: int) -> list[dict]:
    """The cases the launch did not finish, as failures: the one a rank failed alone (its error file says so) and
    the ones after it."""
    done = {(r["family"], r["method"]) for r in results}
    stopped = {(e["family"], e["method"]): e["reason"] for e in map(json.loads, map(Path.read_text,
                                                                                   out.glob("error.rank*.json")))}
    why = f"not run: the launch ended (exit code {code}) before this case; {out / 'launch.log'} says why"
    return [{"family": f.name, "method": m, "outcome": "fail", "seconds": 0.0,
             "reason": stopped.get((f.name, m), why) + ("" if (f.name, m) not in stopped else
                                                        " (the other rank was left waiting: the launch was ended)")}
            for f in arch_families.by_name([f for f in args.families.split(",") if f])
            for m in args.methods.split(",") if (f.name, m) not in done]


def table(results: list[dict], seconds: float) -> str:
    lines = [f"{'family':<12} {'method':<6} {'outcome':<8} {'s':>5}  reason",
             *(f"{r['family']:<12} {r['method']:<6} {r['outcome']:<8} {r['seconds']:>5.1f}  {r.get('reason', '')}"
               for r in results)]
    counts = {o: sum(r["outcome"] == o for r in results) for o in ("pass", "fail", "refused")}
    lines.append(f"arch-matrix: {counts['pass']} passed, {counts['fail']} failed, {counts['refused']} refused "
                 f"in {seconds:.0f} s")
    return "\n".join(lines)


# ---- in each rank -------------------------------------------------------------------------------------------------

def one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:300]


def agree(case: dict, out: Path, fn, *args):
    """Run `fn` on this rank; every rank learns the first failure on any rank (a collective: every rank calls it).
    Returns (value, None) or (None, 'rank N: <error>').

    A rank that failed alone may have left the other waiting in a collective of the pack's, which never pairs with
    this one: it writes its error where the driver finds it, then gives the exchange AGREE_TIMEOUT_S before it ends
    the launch (torchrun then stops the other rank) instead of both waiting for the case's watchdog."""
    import faulthandler

    from fsdp_recipes.dist import gather_objects, rank

    try:
        value, error = fn(*args), None
    except Exception as err:  # noqa: BLE001 -- a failed case is a result, the matrix goes on
        value, error = None, one_line(err)
        traceback.print_exc()  # into launch.log
        (out / f"error.rank{rank()}.json").write_text(json.dumps({**case, "reason": f"rank {rank()}: {error}"}))
        faulthandler.dump_traceback_later(AGREE_TIMEOUT_S, exit=True)
    errors = [f"rank {r}: {e}" for r, e in enumerate(gather_objects(error)) if e]
    faulthandler.dump_traceback_later(CASE_TIMEOUT_S, exit=True)  # the exchange went through: the case's watchdog
    return (None, errors[0]) if errors else (value, None)


def sample_batch(tokenizer, data: Path, rows: int = 4) -> dict:
    """Held-out rows, rendered with the chat template, padded: the logits every check compares."""
    conversations = [json.loads(line) for line in (data / "test.jsonl").read_text().splitlines()[:rows]]
    return tokenizer.apply_chat_template([c["prompt"] + c["completion"] for c in conversations], padding=True,
                                         return_dict=True, return_tensors="pt")


def fresh_accelerate_state() -> None:
    """Each case's Trainer builds its Accelerator from this launch's FSDP settings: forget the last case's state (its
    plugin, gradient state) but keep the process group (PartialState), as accelerate's own tests do between cases."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()


def train(family, method: str, out: Path, batch: dict):
    """The pack's rank lifecycle on this case; returns the trained model's logits on `batch`, computed sharded."""
    import torch

    from fsdp_recipes.train import entry

    fresh_accelerate_state()
    argv = ["--config", str(out / "sft.yaml"), "--model_name_or_path", str(out / "models" / family.name),
            "--output_dir", str(case_dir(out, family, method)), "--use_peft", str(method == "lora").lower(),
            "--attn_implementation", family.attn, "--recipe_name", f"arch-matrix-{family.name}-{method}"]
    code, trainer = entry.train_once(argv)
    if code or trainer is None:
        raise RuntimeError(f"the run ended with exit code {code}")
    trainer.model.eval()
    with torch.no_grad():  # a collective under FSDP2: every rank runs the same forward
        logits = trainer.model(**batch).logits.detach().clone()
    return logits


def case_dir(out: Path, family, method: str) -> Path:
    return out / "runs" / f"{family.name}-{method}"


def close(a, b, what: str) -> float:
    """The largest difference; raises when any logit is outside the stated tolerance."""
    import torch

    diff = (a - b).abs()
    if not bool((diff <= ATOL + RTOL * b.abs()).all()):
        raise AssertionError(f"{what}: logits differ by up to {diff.max().item():.3g} (tolerance {ATOL:g} + {RTOL:g}|x|)")
    return float(diff.max()) if torch.numel(diff) else 0.0


def reload_checks(family, method: str, out: Path, batch: dict, trained) -> str:
    """Rank 0, plain transformers and PEFT: the saved model against the sharded one, the merge against base + adapter."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    def load(path):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=family.attn)
        head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
        if model.config.tie_word_embeddings and head is not None and head.weight is not embedding.weight:
            raise AssertionError(f"{path}: tie_word_embeddings, but the reloaded head is not the input embedding")
        return model.eval()

    def logits(model):
        with torch.no_grad():
            return model(**batch).logits

    run = case_dir(out, family, method)
    base = logits(load(out / "models" / family.name))
    notes = []
    if method == "full":
        reloaded = logits(load(run))
        notes.append(f"reload {close(reloaded, trained, 'from_pretrained against the trained model'):.1g}")
    else:
        reloaded = logits(PeftModel.from_pretrained(load(out / "models" / family.name), run).eval())
        notes.append(f"adapter {close(reloaded, trained, 'base + adapter against the trained model'):.1g}")
        merged = logits(load(run / "merged"))
        notes.append(f"merged {close(merged, reloaded, 'the merged model against base + adapter'):.1g}")
    change = float((reloaded - base).abs().max())
    if change < MIN_CHANGE:
        raise AssertionError(f"the saved model's logits are the base model's (max change {change:.2g}): not trained")
    return ", ".join(notes) + f"; trained vs base {change:.2g}"


def run_case(family, method: str, out: Path, batch: dict) -> dict:
    from fsdp_recipes.dist import rank

    start, case = time.time(), {"family": family.name, "method": method}
    trained, error = agree(case, out, train, family, method, out, batch)
    if error is None:
        checked, error = agree(case, out, lambda: reload_checks(family, method, out, batch, trained)
                               if rank() == 0 else "")
    return {**case, "outcome": "fail" if error else "pass", "seconds": round(time.time() - start, 1),
            "reason": error or checked}


def write_data(out: Path) -> None:
    """Rank 0: the tiny recipe's assets (its tokenizer is every family's) and the matrix's rows."""
    from fsdp_recipes.assets import tiny_assets

    tiny_assets.ensure_assets(quiet=True)
    tiny_assets.write_dataset(out / "data", n_train=32, n_test=4)  # 3 steps of 2 x 4 rows, and the checks' rows


def build_models(out: Path, families) -> dict:
    """This rank's share of the families' models; {family: why its model could not be built}."""
    from transformers import AutoTokenizer

    from fsdp_recipes.assets import tiny_assets

    tokenizer = AutoTokenizer.from_pretrained(tiny_assets.ensure_assets(quiet=True)["model"])
    errors = {}
    for family in families:
        if family.refused is None:
            try:
                arch_families.build_model(family, tokenizer, out / "models" / family.name)
            except Exception as err:  # noqa: BLE001 -- a family whose model cannot be built is its case's failure
                errors[family.name] = f"building the model: {one_line(err)}"
    return errors


def rank_main(args) -> int:
    import faulthandler
    import gc

    from accelerate import PartialState
    from transformers import AutoTokenizer

    from fsdp_recipes.dist import barrier, gather_objects, rank
    from fsdp_recipes.patches import cpu_fsdp

    cpu_fsdp.enable()  # before the process group: gloo on CPU, FSDP kept (patches/cpu_fsdp.py)
    state = PartialState()  # the process group, shared by every case's Trainer
    out, families = Path(args.out), arch_families.by_name([f for f in args.families.split(",") if f])
    if rank() == 0:
        write_data(out)
    barrier()
    shares = gather_objects(build_models(out, families[rank()::state.num_processes]))  # the ranks build in parallel
    built = {name: why for share in shares for name, why in share.items()}
    # Everything imported and built so far stays: the collections that accelerate's free_memory runs after every
    # case (and the Trainer's) then skip it, 1.5 s each on 2 busy cores
    gc.freeze()
    batch = sample_batch(AutoTokenizer.from_pretrained(out / "models" / next(
        f.name for f in families if f.refused is None and f.name not in built)), out / "data")
    results = []
    for family in families:
        for method in args.methods.split(","):
            if family.refused or family.name in built:
                why = arch_families.refusal_line(family) if family.refused else built[family.name]
                result = {"family": family.name, "method": method, "seconds": 0.0,
                          "outcome": "refused" if family.refused else "fail", "reason": why}
            else:
                barrier()
                # a case that hangs ends the launch with every thread's stack in the log
                faulthandler.dump_traceback_later(CASE_TIMEOUT_S, exit=True)
                result = run_case(family, method, out, batch)
                faulthandler.cancel_dump_traceback_later()
            results.append(result)
            if rank() == 0:
                print(f"[arch-matrix] {result['family']} {result['method']}: {result['outcome']} "
                      f"({result['seconds']} s) {result['reason']}", flush=True)
                (out / "results.json").write_text(json.dumps(results, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/arch-matrix")
    ap.add_argument("--families", default="", help="comma-separated names (default: all)")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # a rank of the launch
    args = ap.parse_args(argv)
    try:
        arch_families.by_name([f for f in args.families.split(",") if f])
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.worker:
        from fsdp_recipes.train.entry import exit_without_teardown

        exit_without_teardown(rank_main(args))  # gloo's teardown can abort a finished rank (entry.py says why)
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
