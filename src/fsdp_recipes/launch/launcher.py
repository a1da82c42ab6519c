"""The launcher behind every recipe's launch.sh: check, prepare, `accelerate launch`, summarise.

    python -m fsdp_recipes.launch.launcher <recipe name or folder> [--sft_field value ...]

1. Sets what the seeds' wrappers set (TOKENIZERS_PARALLELISM, PYTORCH_CUDA_ALLOC_CONF) and prints the
   GPU inventory and NVLink status where nvidia-smi exists.
2. Checks what needs no heavy import (accelerate YAML, GPU requirement, topology), then starts the real
   `accelerate launch --config_file <recipe>/accelerate.yaml -m fsdp_recipes.train.entry`, in a session of its own.
   The recipe is loaded once (config/recipes.py `Recipe`) and everything below reads that object.
3. While the ranks import torch and the rest, checks the recipe in this one process -- recipe YAML, a finished
   run in output_dir (said before the slower checks), model, dataset, resume -- and builds the tiny local assets or
   prepares the default's SmolLM2 (assets/) when the recipe uses them. The ranks wait at a gate
   (start_gate.py) and their output is held back until the checks pass; a mistake kills them and is one line
   here instead of a traceback from every rank.
4. Passes on what a scheduler sends (SIGTERM, SIGUSR1, SIGINT) and relays the ranks' output.
5. Prints the summary (fsdp_recipes.launch.summary) of the finished run.

Environment for cluster wrappers (slurm/, k8s/):
    FSDP_RECIPES_LAUNCH_ARGS   extra `accelerate launch` options, shell-quoted, appended after the config file:
                               "--num_machines 2 --machine_rank 1 --main_process_ip node1 --main_process_port
                               29500 --num_processes 16 --rdzv_backend c10d". With --num_machines the launcher
                               leaves the rendezvous port alone.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

# Only light modules here: the heavy imports (torch, transformers, TRL) happen in the checks, while the ranks
# import the same in parallel.
from fsdp_recipes import library_logs, speed
from fsdp_recipes.config import handoff, hardware, model_found, placement, recipes, run_config
from fsdp_recipes.config.job import first_node, launch_args
from fsdp_recipes.config.recipes import Recipe
from fsdp_recipes.config.run_config import RunConfig
from fsdp_recipes.data import files
from fsdp_recipes.errors import EXIT_INTERRUPTED, EXIT_PREEMPTED, UserError, cli
from fsdp_recipes.launch import smoke, summary
from fsdp_recipes.launch.checks import check_launch, check_model_and_data, check_settings
from fsdp_recipes.launch.ending import how_it_ended, records_exit_code, summarise
from fsdp_recipes.launch.lines import say, unexpected, unexpected_errors
from fsdp_recipes.launch.output_dir import claim_output_dir, finished_run, holds_finished_run, lock_output_dir
from fsdp_recipes.launch.ranks import Preempted, Ranks, overlap_checks, rank_command, settings_file
from fsdp_recipes.planning import launch_pick


@records_exit_code  # $FSDP_RECIPES_EXIT_CODE_FILE: the code a script cannot get from make (launch/ending.py)
@cli
def main(argv: list[str] | None = None) -> int:
    library_logs.divert(lambda text: None)  # each rank's log has the same records
    with ExitStack() as held:  # the output_dir's lock, from the checks to the summary
        return launch(list(sys.argv[1:] if argv is None else argv), held)


def launch(argv: list[str], held: ExitStack) -> int:
    """The steps of the module docstring, in order. The exit code, or a UserError's one line."""
    t0 = time.time()
    if any(a in HELP for a in argv):
        return show_help(argv)
    recipe = load_recipe(argv)
    gpus, build_smoke_model = set_up(recipe)
    with unexpected_errors("reading the recipe"):
        check_launch(recipe)
    extra = place(recipe, gpus)
    with unexpected_errors("reading the recipe"):  # a mistyped model or data path: one line before the ranks start
        early = recipe.early
        if not smoke.active():  # a smoke run trains a tiny model instead
            model_found.check_model_found(early.model_name_or_path, early.continues_from, early.model_revision)
        files.check_named_found(early.dataset_name, built_by_checks=early.addition_preferences)
    locked = lock_output_dir(recipe, held)
    torchrun_logs = Path(tempfile.mkdtemp(prefix="fsdp-recipes-torchrun-"))  # torchrun's --log_dir: rank_command
    cmd = rank_command(recipe, extra, torchrun_logs)
    started = time.time()
    overlap = overlap_checks() and not holds_finished_run(recipe)  # the ranks import while the launcher checks
    ranks = start_ranks(recipe, cmd, torchrun_logs, "", gated=True) if overlap else None
    launched_with = list(recipe.launch_options)
    cfg, code = check_while_ranks_import(recipe, held, ranks, torchrun_logs, build_smoke_model, locked)
    if code is not None:
        return code
    if recipe.launch_options != launched_with:  # the checks chose the wrap classes (launch/checks.py)
        cmd, torchrun_logs, ranks = relaunch(recipe, extra, ranks, torchrun_logs)
    handoff.write(cfg.settings, settings_file(torchrun_logs))
    output_dir = cfg.training.output_dir
    log_dir = Path(output_dir) / "logs"
    ranks = release_ranks(recipe, cmd, torchrun_logs, ranks, f"checks passed in {time.time() - t0:.1f}s; ", log_dir)
    rc, preempted_by = ranks.wait()
    if ranks.log_failure:
        say(f"warning: the logs in {log_dir} could not be written ({ranks.log_failure}); the output above is complete")
    code = how_it_ended(recipe, ranks, rc, preempted_by, output_dir, started)
    if code is not None:
        return code
    return summarise(recipe, output_dir)


HELP = ("-h", "--help")


def prog() -> str:
    """The launcher as it was called: `fsdp-recipes finetune` (cli/main.py names it so), else `python -m`."""
    return sys.argv[0] if sys.argv[0].startswith("fsdp-recipes") else "python -m fsdp_recipes.launch.launcher"


def usage() -> str:
    return f"usage: {prog()} <recipe name or folder> [--field value ...]"


def load_recipe(argv: list[str]) -> Recipe:
    """The recipe named first on the command line, loaded once (config/recipes.py), with the rest as overrides; a
    mistyped key or value said at once."""
    if not argv or argv[0].startswith("-"):
        raise UserError(f"{usage()}. Fix: name a recipe (fsdp-recipes recipes list), e.g. tiny-cpu-lora")
    with unexpected_errors("reading the recipe"):
        return recipes.load(argv[0], argv[1:], check_keys=True)


def show_help(argv: list[str]) -> int:
    """`--help`: the usage, or with a recipe named, every field it takes; nothing is checked or started."""
    if not argv or argv[0] in HELP:
        print(f"{usage()}\n\nChecks the recipe, runs `accelerate launch` over its accelerate.yaml and trainer YAML with "
              "the fields given as overrides, then prints the run's summary. <recipe> --help lists its fields.")
        return 0
    recipe = load_recipe([a for a in argv if a not in HELP])
    with unexpected_errors("reading the recipe"):
        text = run_config.fields_help(recipe.trainer, f"{prog()} {recipe.name}", recipe.raw, str(recipe.config_path))
    print(text, end="")  # `| head` closing the pipe: errors.cli's quiet exit
    return 0


def set_up(recipe: Recipe) -> tuple[int, Callable[[], None] | None]:
    """Step 1 of the module docstring; the summary's settings checked. Returns the GPUs here and, for a smoke run,
    what builds its tiny model (smoke.prepare swaps in the scaled accelerate YAML and its overrides now)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    say(f"recipe {recipe.name} ({recipe.folder}), trainer {recipe.trainer}")
    summary.settings()  # checked now: a bad value is one line before the ranks start, not after the training
    if first_node():  # one inventory per job, not one per node
        print(hardware.gpu_inventory(), flush=True)
    gpus = placement.gpus_here()
    build_smoke_model = None
    if smoke.active():
        build_smoke_model = smoke.prepare(recipe, gpus)
    return gpus, build_smoke_model


def place(recipe: Recipe, gpus: int) -> list[str]:
    """Where the processes go on this machine (config/placement.py): its overrides go before the user's, and the
    process count it chooses into the recipe's accelerate config. Returns the extra `accelerate launch` options."""
    extra = launch_args()
    placed = placement.place(recipe.name, recipe.raw, recipe.accelerate, gpus, recipe.overrides, extra,
                             bf16_ok=gpus > 0 and hardware.bf16_supported())
    if placement.runs_on_cpu(recipe.raw, recipe.accelerate, gpus, recipe.overrides):
        placed = placement.cpu_precision(recipe.name, recipe.raw, recipe.overrides, hardware.cpu_bf16_flags(),
                                         smoke=smoke.active())
    for note in placed.notes:
        say(note)
    recipe.overrides = [*placed.overrides, *recipe.overrides]  # the user's last: they win
    # what the planner decides for the GPUs here (activation checkpointing's `auto`): after the user's, replacing it
    decided, notes = speed.launch_overrides(recipe.field, gpus, lambda: launch_pick.checkpointing_pick(recipe, gpus))
    for note in notes:
        say(note)
    recipe.overrides += decided
    if placed.processes is not None:
        recipe.accelerate = dict(recipe.accelerate, num_processes=placed.processes)
        extra += ["--num_processes", str(placed.processes)]
    return extra


def start_ranks(recipe: Recipe, cmd: list[str], torchrun_logs: Path, said: str, gated: bool) -> Ranks:
    wait = "; they wait at a gate until the checks pass" if gated else ""
    say(f"{said}starting {recipe.accelerate.get('num_processes', 1)} process(es){wait}:")
    say(" ".join(cmd))
    return Ranks(cmd, torchrun_logs, gated)


def check_while_ranks_import(recipe: Recipe, held: ExitStack, ranks: Ranks | None, torchrun_logs: Path,
                             build_smoke_model: Callable[[], None] | None,
                             locked: str | None = None) -> tuple[RunConfig | None, int | None]:
    """Step 3 of the module docstring: the smoke run's model, the recipe's checks (launch/checks.py), what to do with
    a run output_dir holds (launch/output_dir.py), while the ranks import, or before they start (`ranks` None).
    Returns the parsed configuration and None; or None and the exit code where the launch ends here (a signal, a run
    that is complete already), the ranks stopped. A failed check stops them and raises."""
    try:
        if build_smoke_model is not None:
            build_smoke_model()
        cfg = check_settings(recipe)
        try:
            found = finished_run(recipe, cfg, held, locked)  # "already complete": said before the data's checks
        except UserError:  # a refusal names the command's other settings: a mistake in those is said first
            check_model_and_data(recipe, cfg)
            raise
        done = found.done
        if done is None:
            check_model_and_data(recipe, cfg)
            claim_output_dir(cfg, found)
    except BaseException as err:
        if ranks is not None:
            ranks.abort()
        else:
            shutil.rmtree(torchrun_logs, ignore_errors=True)
        if isinstance(err, Preempted):
            say(f"{err} before the checks finished: nothing had started, nothing to save; run the same command "
                "again")
            return None, EXIT_PREEMPTED
        if isinstance(err, KeyboardInterrupt):
            say("interrupted before the checks finished: nothing had started")
            return None, EXIT_INTERRUPTED
        if isinstance(err, Exception) and not isinstance(err, UserError):
            raise unexpected(err, "checking the recipe") from None
        raise
    if done is not None:
        if ranks is not None:
            ranks.abort()
        shutil.rmtree(torchrun_logs, ignore_errors=True)
        say(done)
        return None, 0
    return cfg, None


def relaunch(recipe: Recipe, extra: list[str], ranks: Ranks | None,
             torchrun_logs: Path) -> tuple[list[str], Path, None]:
    """The checks changed the `accelerate launch` options (a model named on the command line that lacks the recipe's
    wrap class: its own classes): ranks started with the old command are stopped, and the new command starts once
    the checks passed. Returns the command, its torchrun log folder and no ranks."""
    if ranks is not None:
        say(f"the ranks started before the checks stop; they start again with {' '.join(recipe.launch_options)}")
        ranks.abort()  # removes their torchrun log folder too
    shutil.rmtree(torchrun_logs, ignore_errors=True)
    torchrun_logs = Path(tempfile.mkdtemp(prefix="fsdp-recipes-torchrun-"))
    return rank_command(recipe, extra, torchrun_logs), torchrun_logs, None


def release_ranks(recipe: Recipe, cmd: list[str], torchrun_logs: Path, ranks: Ranks | None, passed: str,
                  log_dir: Path) -> Ranks:
    """The checks passed: the ranks start now (when they were not started before the checks) or go on past the
    gate, and their output goes to the terminal and to `log_dir`."""
    if ranks is None:
        ranks = start_ranks(recipe, cmd, torchrun_logs, passed, gated=False)
    else:
        say(passed + "the ranks go on")
    ranks.release(log_dir)
    return ranks


if __name__ == "__main__":
    sys.exit(main())
