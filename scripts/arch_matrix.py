"""The architecture matrix (`make arch-matrix`): LoRA and full fine-tuning of a tiny random model of each decoder family
in scripts/arch_families.py, under FSDP2 on 2 CPU processes, through the pack's own paths.

One `accelerate launch` for the whole matrix: its two ranks import torch, transformers and TRL once and loop over the
cases in process. A case is what a launch of the pack does: the launcher's checks of the recipe against the model
(config/model_check.py, on a meta-device copy), then the rank lifecycle (`train/entry.py` `train_once`: TRL's
SFTTrainer with the pack's callbacks, the final save and its checks), on the recipe tiny-cpu-lora's FSDP2 settings
without a wrap class (accelerate then wraps the model's own `_no_split_modules`). Then, on rank 0, with plain
transformers and PEFT:

- full: `from_pretrained(output_dir)` computes the logits the trained, sharded model computed in memory;
- LoRA: `PeftModel.from_pretrained(base, output_dir)` does, and `from_pretrained(output_dir/merged)` (the pack's
  merge) computes the logits of base + adapter;
- either way the logits moved from the base model's (a save of the untrained model fails), and a tied head is still
  the input embedding after the reload;
- head (the tied families only): LoRA with the LM head trained in full (`lora_modules_to_save: [lm_head]`, issue 61:
  every rank stopped in FSDP2's setup before), checked as LoRA; its merged model is untied (the trained head, the
  base's embedding).

- resume (`--resume`): the case also saves a checkpoint half-way, and a second run resumes from it into
  `<case>-resumed` (`--resume_from_checkpoint`, as a preempted run is relaunched); its per-step losses must be the
  uninterrupted run's (tests/test_moe_fsdp2.py runs the mixtures of experts this way, in make test).

The checks on rank 0 are scripts/arch_checks.py's; the families and the `--cases` they run, scripts/arch_families.py's.

A case that fails on both ranks is a result and the matrix goes on. One that fails on one rank can leave the other
waiting in a collective: that launch ends, and a new one takes the cases after it.

    python scripts/arch_matrix.py [--families llama,gemma2] [--methods lora,full,head] [--out runs/arch-matrix]
    python scripts/arch_matrix.py --cases qwen3-moe-experts:lora,mixtral:full --steps 4 --resume

Results: <out>/results.json and a table; exit 1 when a case failed (refused ones do not count).
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
from arch_checks import ATOL, case_dir, reload_checks, resume_check, resumed_dir  # noqa: E402,F401 (ATOL: the tests')

REPO = Path(__file__).resolve().parent.parent
CASE_TIMEOUT_S = 180  # a case takes 2-25 s on 2 busy cores
AGREE_TIMEOUT_S = 20  # a rank that failed alone waits this long for the other (agree)
# the accelerate YAML's fsdp_config keys a family may set, and the variables `accelerate launch` passes them in
FSDP_ENV = {"fsdp_cpu_ram_efficient_loading": "FSDP_CPU_RAM_EFFICIENT_LOADING",
            "fsdp_transformer_layer_cls_to_wrap": "FSDP_TRANSFORMER_CLS_TO_WRAP"}


def recipe(out: Path, family, steps: int) -> dict:
    """The family's trainer YAML: tiny-cpu-lora's training in a few steps, LoRA on every linear layer (PEFT's
    all-linear: the families name their projections differently), no LM head trained, and the pack's load checks."""
    return {
        "recipe_name": f"arch-matrix-{family.name}", "min_gpus": 0, "save_merged_model": True,
        "verify_loaded_weights": True, "model_name_or_path": str(out / "models" / family.name), "dtype": "float32",
        "attn_implementation": family.attn, "use_peft": True, "lora_r": 8, "lora_alpha": 16, "lora_dropout": 0.0,
        "lora_target_modules": "all-linear", "dataset_name": str(out / "data"), "dataset_train_split": "train",
        "dataset_test_split": "test", "output_dir": str(out / "runs" / family.name), "max_steps": steps,
        "per_device_train_batch_size": 4, "gradient_accumulation_steps": 1, "learning_rate": 1e-3,
        "lr_scheduler_type": "constant", "warmup_steps": 0, "max_length": 64, "packing": False, "bf16": False,
        "logging_steps": 1, "eval_strategy": "no", "save_strategy": "no", "report_to": "none", "seed": 0,
        "dataloader_num_workers": 0,
    }


def write_recipes(out: Path, families, steps: int) -> None:
    """A recipe folder per family, as a user would copy one: its trainer YAML, and tiny-cpu-lora's accelerate YAML
    with the family's fsdp_config settings. The launch itself runs the shared accelerate YAML; each case puts its
    family's settings where `accelerate launch` would (case_settings)."""
    import yaml

    (out / "accelerate.yaml").write_text(yaml.safe_dump(accelerate_config()))
    for family in families:
        folder = out / "recipes" / family.name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "sft.yaml").write_text(yaml.safe_dump(recipe(out, family, steps)))
        (folder / "accelerate.yaml").write_text(yaml.safe_dump(accelerate_config(family.fsdp)))


def accelerate_config(fsdp: dict | None = None) -> dict:
    """tiny-cpu-lora's accelerate YAML (FSDP2, 2 processes, no mixed precision) without the wrap class, and `fsdp`."""
    import yaml

    acc = yaml.safe_load((REPO / "recipes" / "tiny-cpu-lora" / "accelerate.yaml").read_text())
    acc["fsdp_config"].pop("fsdp_transformer_layer_cls_to_wrap")
    acc["fsdp_config"].update(fsdp or {})
    return acc


def cases(args) -> list[tuple]:
    """(family, method) in the table's order: the methods a family runs (Family.methods), `head` (the LM head trained
    in full) on the tied families only; or the `--cases` named (family:method), in their order."""
    if getattr(args, "cases", ""):
        return arch_families.parse_cases(names(args.cases))
    return [(f, m) for f in arch_families.by_name(names(args.families)) for m in args.methods.split(",")
            if m in f.methods and (m != "head" or arch_families.tied(f))]


def names(text: str) -> list[str]:
    return [n for n in text.split(",") if n]


def launch(args) -> int:
    """Write the YAMLs, run the launches (each one's output in <out>/launch<n>.log, the matrix's own lines shown),
    print the table."""
    out = Path(args.out).resolve()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    write_recipes(out, list({f.name: f for f, _ in cases(args)}.values()), args.steps)
    start, results = time.time(), []
    for family, method in cases(args):
        if method in family.refused:  # upstream's limitation, named: listed, not run
            results.append(row(family, method, "refused", 0.0, arch_families.refusal_line(family, method)))
    for attempt in range(1, len(cases(args)) + 1):
        todo = [f"{f.name}:{m}" for f, m in cases(args) if (f.name, m) not in {(r["family"], r["method"])
                                                                                 for r in results}]
        if not todo:
            break
        code = run_launch(out, todo, attempt, **({"extra": ("--resume", "--steps", str(args.steps))} if args.resume else {}))
        new = collect(out, attempt, code)
        results += new
        if not new:  # the launch ended before its first case: another would too
            results += [row(family, method, "fail", 0.0,
                            f"not run: launch {attempt} ended (exit code {code}) before any case; "
                            f"{out / f'launch{attempt}.log'} says why")
                        for family, method in arch_families.parse_cases(todo)]
    order = {(f.name, m): i for i, (f, m) in enumerate(cases(args))}
    results.sort(key=lambda r: order[(r["family"], r["method"])])
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(table(results, time.time() - start))
    return 1 if any(r["outcome"] == "fail" for r in results) else 0


def row(family, method: str, outcome: str, seconds: float, reason: str) -> dict:
    return {"family": family.name, "method": method, "outcome": outcome, "seconds": seconds, "reason": reason}


def run_launch(out: Path, todo: list[str], attempt: int, extra: tuple = ()) -> int:
    from fsdp_recipes.api import accelerate_cmd

    cmd = accelerate_cmd() + ["--config_file", str(out / "accelerate.yaml"), __file__, "--worker",
                              "--out", str(out), "--cases", ",".join(todo), "--attempt", str(attempt), *extra]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1"}  # a CPU matrix, on any machine
    with open(out / f"launch{attempt}.log", "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            log.write(line)
            if line.startswith("[arch-matrix]"):
                print(line, end="", flush=True)
    return proc.wait()


def collect(out: Path, attempt: int, code: int) -> list[dict]:
    """This launch's results, and the case it ended in, if it ended in one: named by a rank that failed there alone
    (its error file), else by the case rank 0 had started (a hang its watchdog ended, a crash)."""
    done, current = out / f"results{attempt}.json", out / f"current{attempt}.json"
    results = json.loads(done.read_text()) if done.is_file() else []
    finished = {(r["family"], r["method"]) for r in results}
    errors = [json.loads(e.read_text()) for e in sorted(out.glob("error.rank*.json"))]
    for error in out.glob("error.rank*.json"):
        error.unlink()
    ended = [e for e in errors if (e["family"], e["method"]) not in finished]
    if code and ended:
        case = ended[0]
        reason = f"{case['reason']} (rank {case['rank']} alone: launch {attempt} was ended)"
    elif code and current.is_file() and tuple(json.loads(current.read_text()).values()) not in finished:
        case = json.loads(current.read_text())
        reason = f"launch {attempt} ended in this case (exit code {code}): {out / f'launch{attempt}.log'} says why"
    else:
        return results
    print(f"[arch-matrix] {case['family']} {case['method']}: fail; the next launch takes the cases after it", flush=True)
    return [*results, {"family": case["family"], "method": case["method"], "outcome": "fail", "seconds": 0.0,
                       "reason": reason}]


def table(results: list[dict], seconds: float) -> str:
    width = max([len(r["family"]) for r in results] + [6])
    lines = [f"{'family':<{width}} {'method':<6} {'outcome':<8} {'s':>5}  reason",
             *(f"{r['family']:<{width}} {r['method']:<6} {r['outcome']:<8} {r['seconds']:>5.1f}  {r['reason']}"
               for r in results)]
    counts = {o: sum(r["outcome"] == o for r in results) for o in ("pass", "fail", "refused")}
    lines.append(f"arch-matrix: {counts['pass']} passed, {counts['fail']} failed, {counts['refused']} refused "
                 f"in {seconds:.0f} s")
    return "\n".join(lines)


# ---- in each rank -------------------------------------------------------------------------------------------------

def one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:400]


def agree(case: dict, out: Path, fn, *args):
    """Run `fn` on this rank; every rank learns the first failure on any rank (a collective: every rank calls it).
    Returns (value, None) or (None, 'rank N: <error>'); a UserError (the pack's one line) comes back as it is.

    A rank that failed alone may have left the other waiting in a collective of the pack's, which never pairs with
    this one: it writes its error where the driver finds it, then gives the exchange AGREE_TIMEOUT_S before it ends
    the launch (torchrun then stops the other rank) instead of both waiting for the case's watchdog."""
    import faulthandler

    from fsdp_recipes.api import UserError, gather_objects, rank

    try:
        value, error = fn(*args), None
    except Exception as err:  # noqa: BLE001 -- a failed case is a result, the matrix goes on
        value, error = None, f"error: {err}" if isinstance(err, UserError) else f"rank {rank()}: {one_line(err)}"
        traceback.print_exc()  # into the launch's log
        (out / f"error.rank{rank()}.json").write_text(json.dumps({**case, "rank": rank(), "reason": error}))
        faulthandler.dump_traceback_later(AGREE_TIMEOUT_S, exit=True)
    errors = [e for e in gather_objects(error) if e]
    faulthandler.dump_traceback_later(CASE_TIMEOUT_S, exit=True)  # the exchange went through: the case's watchdog
    (out / f"error.rank{rank()}.json").unlink(missing_ok=True)
    return (None, errors[0]) if errors else (value, None)


def sample_batch(tokenizer, data: Path, rows: int = 4) -> dict:
    """Held-out rows, rendered with the chat template, padded: the logits every check compares."""
    conversations = [json.loads(line) for line in (data / "test.jsonl").read_text().splitlines()[:rows]]
    return tokenizer.apply_chat_template([c["prompt"] + c["completion"] for c in conversations], padding=True,
                                         return_dict=True, return_tensors="pt")


def case_settings(family, method: str, out: Path, launched_env: dict, save_at: int = 0) -> list[str]:
    """The case's overrides of its family's recipe (`save_at`: a checkpoint at that step, to resume from); and the
    family's FSDP settings put where `accelerate launch` puts them for the ranks (its FSDP_* variables), over the
    launch's own."""
    import yaml

    fsdp = yaml.safe_load((out / "recipes" / family.name / "accelerate.yaml").read_text())["fsdp_config"]
    for key, var in FSDP_ENV.items():
        value = fsdp.get(key, launched_env.get(var))
        if value is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = str(value).lower() if isinstance(value, bool) else str(value)
    head = ["--lora_modules_to_save", "lm_head"] if method == "head" else []  # LoRA + the head trained in full
    save = ["--save_strategy", "steps", "--save_steps", str(save_at)] if save_at else []
    return ["--use_peft", str(method != "full").lower(), "--output_dir", str(case_dir(out, family, method)),
            *head, *save, *family.args]


def launcher_checks(family, out: Path, overrides: list[str]) -> None:
    """The launcher's own checks before any rank starts (launch/checks.py check_recipe): the recipe as the ranks
    will parse it, the recipe against the model's architecture on a meta-device copy, the data's rows. On rank 0:
    a UserError is the pack's one line, refusing the case as it would refuse the launch."""
    from fsdp_recipes.api import check_recipe, load_recipe, rank

    if rank() == 0:
        check_recipe(load_recipe(out / "recipes" / family.name, overrides))


def fresh_accelerate_state() -> None:
    """Each case's Trainer builds its Accelerator from the FSDP settings then in the environment: forget the last
    case's (its plugin, gradient state) but keep the process group (PartialState), as accelerate's own tests do."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()


def train(family, out: Path, overrides: list[str], batch: dict):
    """The pack's rank lifecycle on this case; returns the trained model's logits on `batch`, computed sharded."""
    import torch

    from fsdp_recipes.api import train_once

    fresh_accelerate_state()
    code, trainer = train_once(["--config", str(out / "recipes" / family.name / "sft.yaml"), *overrides])
    if code or trainer is None:
        raise RuntimeError(f"the run ended with exit code {code}")
    trainer.model.eval()
    with torch.no_grad():  # a collective under FSDP2: every rank runs the same forward
        return trainer.model(**batch).logits.detach().clone()


def resume(family, method: str, out: Path, overrides: list[str], step: int, batch: dict) -> None:
    """The case's run again, into <case>-resumed, resumed from the checkpoint it saved at `step`: the command a
    preempted run is relaunched with (`--resume_from_checkpoint`), the rest of the steps trained again."""
    at = overrides.index("--output_dir") + 1
    again = [*overrides[:at], str(resumed_dir(out, family, method)), *overrides[at + 1:],
             "--resume_from_checkpoint", str(case_dir(out, family, method) / f"checkpoint-{step}")]
    train(family, out, again, batch)


def run_case(family, method: str, out: Path, batch: dict, launched_env: dict, resume_at: int = 0) -> dict:
    from fsdp_recipes.api import rank

    start, case = time.time(), {"family": family.name, "method": method}
    overrides = case_settings(family, method, out, launched_env, resume_at)
    _, refused = agree(case, out, launcher_checks, family, out, overrides)
    if refused:  # the pack's one line, before any training, as a launch would stop
        return row(family, method, "refused" if refused.startswith("error: ") else "fail",
                   round(time.time() - start, 1), refused)
    trained, error = agree(case, out, train, family, out, overrides, batch)
    checked = None
    if error is None:
        checked, error = agree(case, out, lambda: reload_checks(family, method, out, batch, trained)
                               if rank() == 0 else "")
    if error is None and resume_at:
        _, error = agree(case, out, resume, family, method, out, overrides, resume_at, batch)
        if error is None:
            note, error = agree(case, out, lambda: resume_check(case_dir(out, family, method),
                                                                resumed_dir(out, family, method), resume_at)
                                if rank() == 0 else "")
            checked = f"{checked}; {note}"
    return row(family, method, "fail" if error else "pass", round(time.time() - start, 1), error or checked)


def write_data(out: Path) -> None:
    """Rank 0: the tiny recipe's assets (its tokenizer is every family's) and the matrix's rows."""
    from fsdp_recipes.api import ensure_tiny_assets, write_tiny_dataset

    ensure_tiny_assets(quiet=True)
    write_tiny_dataset(out / "data", n_train=32, n_test=4)  # 3 steps of 2 x 4 rows, and the checks' rows


def build_models(out: Path, families) -> dict:
    """This rank's share of the families' models (once per matrix); {family: why its model could not be built}."""
    from transformers import AutoTokenizer

    from fsdp_recipes.api import ensure_tiny_assets

    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_assets(quiet=True)["model"])
    errors = {}
    for family in families:
        if not (out / "models" / family.name / "config.json").is_file():
            try:
                arch_families.build_model(family, tokenizer, out / "models" / family.name)
            except Exception as err:  # noqa: BLE001 -- a family whose model cannot be built is its cases' failure
                errors[family.name] = f"building the model: {one_line(err)}"
    return errors


def rank_main(args) -> int:
    import faulthandler
    import gc

    from accelerate import PartialState
    from transformers import AutoTokenizer

    from fsdp_recipes.api import barrier, enable_cpu_fsdp, gather_objects, rank

    launched_env = {var: os.environ.get(var) for var in FSDP_ENV.values()}
    enable_cpu_fsdp()  # before the process group: gloo on CPU, FSDP kept (patches/cpu_fsdp.py)
    state = PartialState()  # the process group, shared by every case's Trainer
    out = Path(args.out)
    todo = arch_families.parse_cases(names(args.cases))
    families = list({f.name: f for f, _ in todo}.values())
    if rank() == 0 and not (out / "data" / "test.jsonl").is_file():
        write_data(out)
    barrier()
    shares = gather_objects(build_models(out, families[rank()::state.num_processes]))  # the ranks build in parallel
    unbuilt = {name: why for share in shares for name, why in share.items()}
    # What is imported and built so far stays: the collections that accelerate's free_memory runs after every case
    # (and the Trainer's) then skip it, 1.5 s each on 2 busy cores
    gc.freeze()
    batch = sample_batch(AutoTokenizer.from_pretrained(tiny_assets_model()), out / "data")
    results = []
    for family, method in todo:
        barrier()
        if rank() == 0:  # which case a launch that ends here ended in (collect)
            (out / f"current{args.attempt}.json").write_text(json.dumps({"family": family.name, "method": method}))
        if family.name in unbuilt:
            result = row(family, method, "fail", 0.0, unbuilt[family.name])
        else:
            faulthandler.dump_traceback_later(CASE_TIMEOUT_S, exit=True)  # a hung case ends the launch, stacks logged
            result = run_case(family, method, out, batch, launched_env, args.steps // 2 if args.resume else 0)
            faulthandler.cancel_dump_traceback_later()
        results.append(result)
        if rank() == 0:
            print(f"[arch-matrix] {result['family']} {result['method']}: {result['outcome']} ({result['seconds']} s) "
                  f"{result['reason']}", flush=True)
            (out / f"results{args.attempt}.json").write_text(json.dumps(results, indent=1))
    return 0


def tiny_assets_model() -> Path:
    from fsdp_recipes.api import ensure_tiny_assets

    return ensure_tiny_assets(quiet=True)["model"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/arch-matrix")
    ap.add_argument("--families", default="", help="comma-separated names (default: all)")
    ap.add_argument("--methods", default="lora,full,head")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--cases", default="", help="family:method,... (instead of --families and --methods)")
    ap.add_argument("--resume", action="store_true",
                    help="each case also saves at half its steps and a second run resumes from there")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # a rank of the launch
    ap.add_argument("--attempt", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    try:
        arch_families.by_name(names(args.families))
        arch_families.parse_cases(names(args.cases))
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.worker:
        from fsdp_recipes.api import exit_without_teardown

        exit_without_teardown(rank_main(args))  # gloo's teardown can abort a finished rank (entry.py says why)
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
