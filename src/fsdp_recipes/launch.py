"""The launcher behind every recipe's launch.sh: check, prepare, `accelerate launch`, summarise.

    python -m fsdp_recipes.launch <recipe name or folder> [--sft_field value ...]

1. Sets what the seeds' wrappers set (TOKENIZERS_PARALLELISM, PYTORCH_CUDA_ALLOC_CONF) and prints the
   GPU inventory and NVLink status where nvidia-smi exists.
2. Checks the recipe in this one process -- GPU requirement, accelerate YAML, recipe YAML, model,
   dataset -- so a mistake is one line here instead of a traceback from every rank.
3. Builds the tiny local assets when the recipe uses them.
4. Runs the real `accelerate launch --config_file <recipe>/accelerate.yaml -m fsdp_recipes.train_sft`.
5. Prints the summary (fsdp_recipes.summary) of the finished run.

Environment for cluster wrappers (slurm/, k8s/):
    FSDP_RECIPES_LAUNCH_ARGS   extra `accelerate launch` options, shell-quoted, appended after the config file:
                               "--num_machines 2 --machine_rank 1 --main_process_ip node1 --main_process_port
                               29500 --num_processes 16 --rdzv_backend c10d". With --num_machines the launcher
                               leaves the rendezvous port alone.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

from fsdp_recipes import config_check, model_check, recipes, smoke, summary, train_sft
from fsdp_recipes.errors import UserError, cli
from fsdp_recipes.preemption import EXIT_PREEMPTED


def say(msg: str) -> None:
    print(f"[launch] {msg}", flush=True)


def override(argv: list[str], key: str, default):
    """The value of `--key v` / `--key=v` among the command-line overrides, else `default`."""
    for i, arg in enumerate(argv):
        if arg == f"--{key}" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(f"--{key}="):
            return arg.split("=", 1)[1]
    return default


def launch_args() -> list[str]:
    return shlex.split(os.environ.get("FSDP_RECIPES_LAUNCH_ARGS", ""))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def accelerate_cmd() -> list[str]:
    exe = Path(sys.executable).parent / "accelerate"
    found = str(exe) if exe.exists() else shutil.which("accelerate")
    if not found:
        raise UserError("the `accelerate` command is not installed. Fix: pip install -e . (or make venv).")
    return [found, "launch"]


def run_forwarding_signals(cmd: list[str]) -> tuple[int, int | None]:
    """Run the launcher child, passing on what a scheduler sends (SIGTERM, SIGUSR1, SIGINT) instead of dying.
    Returns the exit code and the first preemption signal (SIGTERM/SIGUSR1) passed on, if any."""
    child = subprocess.Popen(cmd)
    preempted_by: list[int] = []

    def forward(signum, frame):
        if signum != signal.SIGINT and not preempted_by:
            preempted_by.append(signum)
        child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    try:
        return child.wait(), (preempted_by[0] if preempted_by else None)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def grace_ran_out(output_dir: str, report: Path, grace_s: str, fresh: bool) -> str:
    """The ranks were stopped before the preemption checkpoint was complete: say so, in the report too."""
    from fsdp_recipes import checkpoints
    from fsdp_recipes.run_report import write_json_atomic

    latest = checkpoints.latest_complete(output_dir)
    note = (f"preempted, but the ranks did not finish within the grace period ({grace_s} s) and were stopped; "
            f"an incomplete checkpoint is skipped on resume, so the same command resumes from "
            f"{latest or 'the beginning (no complete checkpoint)'}. Fix: raise preemption_grace_s (and the "
            f"scheduler's grace) above the checkpoint save time")
    if fresh:
        metrics = json.loads(report.read_text())
        metrics.update(status="preempted", error=f"{metrics.get('error') or ''} -- {note}".lstrip(" -"),
                       provisional=False)
        write_json_atomic(report, metrics)
    return note


def check_recipe(recipe: Path, acc_yaml: Path, overrides: list[str]) -> tuple:
    sft_yaml = recipe / "sft.yaml"
    raw = config_check.load_yaml(sft_yaml, "recipe config")
    extra = launch_args()
    acc = config_check.check_accelerate_config(acc_yaml)
    machines = int(override(extra, "num_machines", acc.get("num_machines", 1)))
    # The GPU requirement before the recipe YAML: a GPU recipe's settings (bf16, hub model) cannot be checked
    # on CPU. min_gpus counts the whole job; each of its nodes runs this launcher with its share.
    min_gpus = int(override(overrides, "min_gpus", raw.get("min_gpus", 0)))
    config_check.check_gpus(-(-min_gpus // machines), recipe.name)
    processes = int(override(extra, "num_processes", acc.get("num_processes", 1)))
    config_check.check_topology(acc, acc_yaml, machines, processes)
    with warnings.catch_warnings():  # the training processes parse again and show these warnings there
        warnings.simplefilter("ignore")
        args = train_sft.parse_and_check(["--config", str(sft_yaml), *overrides])
    script, training, model, mixture, pack = args
    named = recipe / "accelerate.yaml"  # what the user edits, also when a smoke test runs a scaled copy
    config_check.check_fsdp_with_peft(acc, model.use_peft, named, processes)
    model_check.check(model.model_name_or_path, recipe, acc, named, model)
    train_sft.checkpoint_to_resume(training, model, pack, verbose=False)  # refuses an incompatible checkpoint
    return args, acc


@cli
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-"):
        raise UserError("usage: python -m fsdp_recipes.launch <recipe name or folder> [--field value ...]")
    recipe, overrides = recipes.resolve(argv[0]), argv[1:]
    acc_yaml = recipe / "accelerate.yaml"
    t0 = time.time()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    say(f"recipe {recipe.name} ({recipe})")
    print(config_check.gpu_inventory(), flush=True)
    if smoke.active():
        acc_yaml, overrides = smoke.prepare(recipe, overrides)

    (script, training, model, mixture, pack), acc = check_recipe(recipe, acc_yaml, overrides)
    if script.dataset_name and config_check.looks_local(script.dataset_name):
        import datasets

        from fsdp_recipes.loading import load_sft_datasets

        datasets.disable_progress_bars()  # a check, not work to watch: keep its error the only line
        load_sft_datasets(script, mixture, training.eval_strategy != "no", training.dataset_text_field)

    extra = launch_args()
    cmd = accelerate_cmd() + ["--config_file", str(acc_yaml), *extra]
    multi_node = int(acc.get("num_machines", 1)) > 1 or "--num_machines" in extra
    if not multi_node and "MASTER_PORT" not in os.environ:
        cmd += ["--main_process_port", str(free_port())]  # two runs on one machine must not collide
    cmd += ["-m", "fsdp_recipes.train_sft", "--config", str(recipe / "sft.yaml"), *overrides]
    say(f"checks passed in {time.time() - t0:.1f}s; starting {acc.get('num_processes', 1)} process(es):")
    say(" ".join(cmd))
    # torchrun forwards these signals to every rank and then allows the grace period before killing them.
    os.environ.setdefault("PET_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1")
    os.environ.setdefault("PET_SHUTDOWN_TIMEOUT", str(pack.preemption_grace_s))
    started = time.time()
    rc, preempted_by = run_forwarding_signals(cmd)
    report = Path(training.output_dir) / "metrics.json"
    fresh = report.exists() and report.stat().st_mtime >= started  # not a previous run's report
    metrics = json.loads(report.read_text()) if fresh else {}
    if metrics.get("status") == "preempted" and not metrics.get("provisional"):
        say(f"preempted: a checkpoint was saved in {training.output_dir}; run the same command again to resume")
        return EXIT_PREEMPTED
    if preempted_by is not None and (metrics.get("provisional") or rc != 0):
        say(grace_ran_out(training.output_dir, report, os.environ["PET_SHUTDOWN_TIMEOUT"], fresh))
        return EXIT_PREEMPTED
    if rc != 0:
        where = f"its run report is {report}" if report.exists() else "it failed before writing a run report"
        say(f"training exited with code {rc} (see the log above); {where}")
        return rc
    return summary.main([training.output_dir])


if __name__ == "__main__":
    sys.exit(main())
