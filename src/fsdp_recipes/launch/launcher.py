"""The launcher behind every recipe's launch.sh: check, prepare, `accelerate launch`, summarise.

    python -m fsdp_recipes.launch.launcher <recipe name or folder> [--sft_field value ...]

1. Sets what the seeds' wrappers set (TOKENIZERS_PARALLELISM, PYTORCH_CUDA_ALLOC_CONF) and prints the
   GPU inventory and NVLink status where nvidia-smi exists.
2. Checks what needs no heavy import (accelerate YAML, GPU requirement, topology), then starts the real
   `accelerate launch --config_file <recipe>/accelerate.yaml -m fsdp_recipes.train.entry`, in a session of its own.
   The recipe is loaded once (config/recipes.py `Recipe`) and everything below reads that object.
3. While the ranks import torch and the rest, checks the recipe in this one process -- recipe YAML, model,
   dataset, resume -- and builds the tiny local assets or prepares the
   default's SmolLM2 (assets/) when the recipe uses them. The ranks wait at a gate
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

import importlib.util
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from pathlib import Path

# Only light modules here: the heavy imports (torch, transformers, TRL) happen in check_recipe, while the ranks
# import the same in parallel.
from fsdp_recipes import library_logs
from fsdp_recipes.checkpoint import resume_choice
from fsdp_recipes.config import accelerate_yaml, hardware, model_check, placement, quantization, recipes, yaml_keys
from fsdp_recipes.config.argv import override
from fsdp_recipes.config.recipes import Recipe
from fsdp_recipes.config.run_config import PackArguments, RunConfig
from fsdp_recipes.dist import free_port
from fsdp_recipes.errors import EXIT_INTERRUPTED, EXIT_PREEMPTED, UserError, cli
from fsdp_recipes.launch import explain_failure, smoke, summary
from fsdp_recipes.launch.rank_output import RankOutput
from fsdp_recipes.metrics import gates
from fsdp_recipes.train import failure_record, float8, run_checks, start_gate


def say(msg: str) -> None:
    print(f"[launch] {msg}", flush=True)


def launch_args() -> list[str]:
    return shlex.split(os.environ.get("FSDP_RECIPES_LAUNCH_ARGS", ""))


def accelerate_cmd() -> list[str]:
    """`accelerate launch` in this Python: the script beside it, else accelerate's module (an environment whose
    packages came without their scripts). Never another environment's `accelerate` from PATH: its ranks would run
    a Python that may not have the pack, or other versions."""
    exe = Path(sys.executable).parent / "accelerate"
    if exe.exists():
        return [str(exe), "launch"]
    if importlib.util.find_spec("accelerate") is None:
        raise UserError(f"accelerate is not installed for {sys.executable}. Fix: pip install the fsdp-recipes wheel "
                        f"into that environment (it brings accelerate), or make venv in the repository.")
    return [sys.executable, "-m", "accelerate.commands.launch"]


class Preempted(BaseException):  # like KeyboardInterrupt: no check's `except Exception` may swallow it
    """SIGTERM/SIGUSR1 arrived before the checks passed: the ranks had not started work, nothing to save."""


class Ranks:
    """`accelerate launch` in a session of its own, gated (start_gate.py) until release(). Passes on what a
    scheduler sends (SIGTERM, SIGUSR1, SIGINT) instead of dying, and remembers the first preemption signal."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)

    def __init__(self, cmd: list[str], torchrun_logs: Path, gated: bool = True) -> None:
        self.gate = start_gate.Gate()
        self.torchrun_logs = torchrun_logs  # torchrun's --log_dir: each rank's output and error record
        self.records: list[dict] = []
        self.log_failure: str | None = None  # why output_dir/logs could not be written (a full disk), after wait()
        self.traceback_file: str | None = None  # where the ranks' tracebacks went instead
        env = dict(os.environ, **self.gate.env())
        env.setdefault("PYTHONUNBUFFERED", "1")  # the ranks write to files now: keep their lines live
        # torchrun's --redirects, which `accelerate launch` does not offer (torchrun reads PET_<option> as its default)
        env["PET_REDIRECTS"] = "3"
        self.released = not gated
        if not gated:
            self.gate.open()
        self.preempted_by: int | None = None
        self.interrupted = False  # Ctrl-C after release: the ranks report "interrupted", which is no failure
        self.previous = {sig: signal.signal(sig, self._on_signal) for sig in self.SIGNALS}
        # Its own session, as torchrun gives each rank: Ctrl-C in a terminal reaches the ranks through _on_signal
        # and torchrun (PET_SIGNALS_TO_HANDLE), and a Ctrl-C during the checks stops the launcher alone.
        try:
            # die_with_parent: `accelerate launch` (and with it torchrun, whose ranks die with it in turn) is
            # killed when this launcher dies, even by SIGKILL.
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                                         start_new_session=True, preexec_fn=failure_record.die_with_parent)
        except BaseException:
            self._done()
            raise
        self.output = RankOutput(self.proc, torchrun_logs)

    def _on_signal(self, signum, frame):
        if not self.released:  # the ranks are importing or at the gate: stop everything here
            raise KeyboardInterrupt if signum == signal.SIGINT else Preempted(signal.Signals(signum).name)
        if signum == signal.SIGINT:
            self.interrupted = True
        elif self.preempted_by is None:
            self.preempted_by = signum
        self.proc.send_signal(signum)

    def release(self, log_dir: Path | None) -> None:
        self.released = True  # first: from here on a signal is passed on, never raised in the launcher
        self.gate.open()
        self.output.release(log_dir)

    def abort(self) -> None:
        """The checks failed or were interrupted: kill accelerate, torchrun and the ranks, drop their output.
        (torchrun starts each rank in a session of its own, so killing the launcher child's session is not
        enough; a rank that escapes the list below sees the gate's ABORT and exits by itself.)"""
        import psutil

        self.output.drop()
        self.output.close()
        self.gate.abort()
        try:
            procs = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            procs = []
        for p in [psutil.Process(self.proc.pid), *procs] if self.proc.poll() is None else procs:
            try:
                p.kill()
            except psutil.Error:
                pass
        self.proc.wait()
        psutil.wait_procs(procs, timeout=10)
        self._done()

    def wait(self) -> tuple[int, int | None]:
        """The exit code, and the first preemption signal (SIGTERM/SIGUSR1) passed on, if any."""
        try:
            rc = self.proc.wait()
            self.output.join()
            self.records = explain_failure.read_records(self.torchrun_logs)
            for rec in self.records:  # the traceback the rank did not print, in its own log
                self.output.append(rec["rank"], self.traceback(rec))
            self.log_failure = self.output.log_failure
            if self.log_failure and self.records:  # the logs could not take it: a file where there is room
                try:
                    fd, path = tempfile.mkstemp(prefix="fsdp-recipes-ranks-", suffix=".log")
                    with os.fdopen(fd, "w") as f:
                        f.writelines(self.traceback(rec) for rec in self.records)
                    self.traceback_file = path
                except OSError:  # /tmp is full too: the one line is all there is
                    self.traceback_file = "nowhere (no disk space for it)"
        finally:
            self.output.close()
            self._done()
        return rc, self.preempted_by

    @staticmethod
    def traceback(rec: dict) -> str:
        return f"---- rank {rec['rank']} failed ({rec['phase']}) ----\n{rec.get('py_callstack') or rec['message']}\n"

    def _done(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.gate.remove()
        shutil.rmtree(self.torchrun_logs, ignore_errors=True)


def grace_ran_out(output_dir: str, report: Path, grace_s: str, fresh: bool) -> str:
    """The ranks were stopped before the preemption checkpoint was complete: say so, in the report too."""
    from fsdp_recipes.checkpoint import markers as checkpoints
    from fsdp_recipes.metrics import metrics_file

    latest = checkpoints.latest_complete(output_dir)
    note = (f"preempted, but the ranks did not finish within the grace period ({grace_s} s) and were stopped; "
            f"an incomplete checkpoint is skipped on resume, so the same command resumes from "
            f"{latest or 'the beginning (no complete checkpoint)'}. Fix: raise preemption_grace_s (and the "
            f"scheduler's grace) above the checkpoint save time")
    if fresh:
        metrics_file.amend(report.parent, lambda m: {
            **m, "status": "preempted", "error": f"{m.get('error') or ''} -- {note}".lstrip(" -"), "provisional": False})
    return note


def job_machines(acc: dict) -> int:
    return int(override(launch_args(), "num_machines", acc.get("num_machines", 1)))


def job_processes(acc: dict) -> int:
    return int(override(launch_args(), "num_processes", acc.get("num_processes", 1)))


def check_launch(recipe: Recipe) -> None:
    """What can be checked without importing torch: the pack's FSDP rules (read with the YAML), the GPU count
    (torch counts them here only when nvidia-smi / CUDA_VISIBLE_DEVICES show too few; else check_recipe does),
    the topology."""
    acc = recipe.accelerate
    machines = job_machines(acc)
    # The GPU requirement before the recipe YAML: a GPU recipe's settings (bf16, hub model) cannot be checked
    # on CPU. min_gpus counts the whole job; each of its nodes runs this launcher with its share.
    min_gpus = int(recipe.field("min_gpus", 0))
    per_node = hardware.gpus_per_node(min_gpus, machines)
    if per_node > 0 and ((hint := hardware.gpu_count_hint()) is None or hint < per_node):
        hardware.check_gpus(min_gpus, recipe.name, machines)  # torch's count now: no ranks start without GPUs
    accelerate_yaml.check_topology(acc, recipe.accelerate_path, machines, job_processes(acc))


def in_pack_cache(path: str) -> bool:
    """Whether `path` lies in the pack's cache, where the checks build the tiny and SmolLM2 assets it names."""
    from fsdp_recipes.paths import cache_dir

    return Path(path).absolute().is_relative_to(cache_dir().absolute())


def check_keys_early(recipe: Recipe) -> None:
    """A mistyped key or flag, a word where a number goes and a value out of its range (config/value_checks.py) are
    one line before the config classes' imports, where an earlier launch remembered the kind's fields
    (config/yaml_keys.py); otherwise the checks name them, the ranks started."""
    from fsdp_recipes.config import value_checks
    from fsdp_recipes.paths import cache_dir

    values = yaml_keys.remembered_values(recipe.trainer, recipe.raw, recipe.config_path, recipe.overrides,
                                         cache_dir())
    if values is None:
        return
    try:
        value_checks.check_training_values(values, str(getattr(values, "eval_strategy", "no")) != "no")
    except (TypeError, AttributeError):  # a field that is no plain value here (a kind without it): the parser's turn
        pass


def check_data_found(recipe: Recipe) -> None:
    """A mistyped local dataset_name is one line now, not after the checks' imports (issue 42: data mistakes
    within 5 s); a `datasets:` mixture and a hub id are checked with the recipe (check_recipe), as is data the
    checks build: the tiny and SmolLM2 assets in the pack's cache, and DPO's pairs from the SFT model's answers
    (addition_preferences), written where dataset_name says."""
    from fsdp_recipes.data import files
    from fsdp_recipes.paths import expand

    name = recipe.field("dataset_name")
    builds = str(recipe.field("addition_preferences", False)).lower() in ("true", "yes", "t", "y", "1")  # argparse's
    if builds or not isinstance(name, str):
        return
    if model_check.looks_local(path := expand(name, "dataset_name")) and not in_pack_cache(path):
        files.check_found(path)


def check_model_found(recipe: Recipe) -> None:
    """A mistyped model path, or a hub id neither cached nor reachable, is one line here, before the ranks start
    (from_pretrained in a rank retries the hub for most of a minute before it fails). Not for a smoke run, which
    trains a tiny model instead, nor for a model the pack builds in its cache during the checks (tiny_assets,
    smollm2_assets)."""
    from fsdp_recipes.paths import expand

    model = recipe.field("model_name_or_path")
    if smoke.active() or not isinstance(model, str):
        return  # no model: the recipe's parse names the missing field
    path = expand(model, "model_name_or_path")
    if in_pack_cache(path):
        return
    model_check.check_model_found(path, recipe.field("continues_from"), recipe.field("model_revision"))


def warn(recipe: Recipe, lines: list[str]) -> None:
    for line in lines:
        recipe.warnings.append(line)
        say(f"warning: {line}")


def check_recipe(recipe: Recipe) -> RunConfig:
    """accelerate's reading of its config; the recipe as the ranks will parse it, the model, the dataset and the
    checkpoint to resume. Sets recipe.cfg."""
    from fsdp_recipes.train import kinds

    acc = recipe.accelerate
    named = recipe.folder / "accelerate.yaml"  # what the user edits, also when a smoke test runs a scaled copy
    accelerate_yaml.check_accelerate_keys(named, yaml_keys.load_yaml(named, "accelerate config"))
    with warnings.catch_warnings():  # the training processes parse again and show these warnings there
        warnings.simplefilter("ignore")
        cfg = run_checks.parse_and_check(recipe.argv(), nodes=job_machines(acc), raw=recipe.raw,
                                         world_size=job_processes(acc))
    from fsdp_recipes.config.value_checks import schedule_warnings

    warn(recipe, schedule_warnings(cfg.training))
    accelerate_yaml.check_fsdp_with_peft(acc, cfg.model.use_peft, named, job_processes(acc))
    quantization.check(cfg.model, cfg.training, acc, named)
    if cfg.pack.float8:
        float8.check_gpus()
    wrap = model_check.check(cfg.model.model_name_or_path, recipe.folder, acc, named, cfg.model,
                             wrap_on_command_line=bool(recipe.launch_options))
    if wrap and wrap[1]:  # which layers FSDP wraps, and why those
        warn(recipe, [wrap[0]])
    elif wrap:
        say(wrap[0])
    from fsdp_recipes.data import loading

    if loading.is_local(cfg.script, cfg.mixture):
        import datasets

        kind = kinds.load(cfg.trainer)
        datasets.disable_progress_bars()  # a check, not work to watch: keep its error the only line
        # datasets logs a bad JSON file at error level with its traceback; loading.py names the line instead
        datasets.utils.logging.set_verbosity(datasets.utils.logging.CRITICAL)
        splits = kind.load_datasets(cfg)
        for line in loading.NOTES:  # the format found and how it maps; the eval split, or that there is none
            say(line)
        warn(recipe, loading.WARNINGS)
        from fsdp_recipes.data import length_report, lengths, recipe_tokenizer

        # a local model's tokenizer, with the chat template the trainer will use (a hub model's: rank 0 measures)
        tokenizer, template = recipe_tokenizer.load_tokenizer(cfg, cached=False)
        # the rows: errors with the file and line; rows that teach nothing are one counted warning
        warn(recipe, kind.check_data(cfg, splits, tokenizer))
        if tokenizer is not None:  # token lengths, and what max_length cuts: a table, and one warning where it cuts
            measured = lengths.measure_splits(cfg, splits, tokenizer, template)
            table, cut = length_report.report(measured, cfg, tokenizer, cfg.script.dataset_name or "mixture")
            for line in table:
                say(line)
            warn(recipe, cut)
    recipe.cfg = cfg
    return cfg


def first_node() -> bool:
    return override(launch_args(), "machine_rank", "0") == "0"


def lock_output_dir(recipe: Recipe, held: ExitStack, output_dir: str | None = None) -> str | None:
    """Lock output_dir for this run, held until the launcher exits: before the ranks start where the recipe or
    the command names it, so that a busy folder is one line at once (issue 42: lock mistakes within 5 s), else
    (`output_dir`: TrainingArguments' default, once parsed) in claim_output_dir. The folder locked, or None. On a
    multi-node job the first node's launcher locks."""
    from fsdp_recipes.checkpoint import output_lock
    from fsdp_recipes.paths import expand

    out = output_dir or recipe.field("output_dir")
    if not isinstance(out, str) or not out or not first_node():
        return None
    out = expand(out, "output_dir")
    lock = output_lock.OutputLock(out, shlex.join(["launch", recipe.name, *recipe.overrides]))
    if output_dir is None:  # before the checks: a folder that cannot be made is theirs to name (config/value_checks)
        try:
            lock.acquire()
        except OSError:
            return None
        held.callback(lock.release)
    else:
        held.enter_context(lock)
    if lock.note:
        say(f"warning: {lock.note}")
    return out


def claim_output_dir(recipe: Recipe, cfg: RunConfig, held: ExitStack, locked: str | None = None) -> str | None:
    """Lock output_dir for this run where lock_output_dir could not yet, apply --overwrite_output_dir, and decide what
    the command does with a run the folder holds already (checkpoint/previous_run.py): None to go on, or the
    "already complete" line. Then the checkpoint to resume: refused when incompatible, skipped (and moved aside)
    when unreadable. On a multi-node job the first node's launcher does this; the others only check the resume."""
    from fsdp_recipes.checkpoint import previous_run, resume_settings
    from fsdp_recipes.train import kinds

    out = cfg.training.output_dir
    now = resume_settings.current(cfg, job_processes(recipe.accelerate), kinds.load(cfg.trainer).RESUME_SETTINGS)
    if locked is None or Path(out).resolve() != Path(locked).resolve():  # the lock first: the folder is read under it
        lock_output_dir(recipe, held, out)
    first = first_node()
    previous = previous_run.read(Path(out))
    # a finished smoke run is scratch: the next smoke run replaces it (an unfinished one is resumed, as any run)
    replace = cfg.pack.overwrite_output_dir or (smoke.active() and previous is not None
                                                and previous.status == "completed")
    if replace and first and (removed := previous_run.clear(out, previous)):
        say(f"{'overwrite_output_dir' if cfg.pack.overwrite_output_dir else 'smoke run'}: {removed}")
    if not replace:  # every node decides alike (read-only), so none starts ranks that would wait for the others
        resumes = cfg.pack.auto_resume or bool(cfg.training.resume_from_checkpoint)
        if done := previous_run.decide(out, previous, now, cfg.pack.override_resumed_settings, resumes):
            return done
    elif not first:
        return None  # the first node is emptying output_dir: there is nothing of the old run to resume
    resume, changed = resume_choice.checkpoint_to_resume(cfg, now, say=say, move_unreadable=first)
    if first:
        superseded(out, resume)
    if changed.get("length"):
        (_, was), (name, now_len) = changed["length"]
        say(f"continuing {resume} to {name} {now_len} (it was trained toward {was}): the learning-rate schedule is "
            f"the new length's from its step on")
    if changed.get("changed"):
        say(f"override_resumed_settings: resuming {resume} with {resume_settings.described(changed['changed'])}; the "
            f"new values apply from step {changed['step'] + 1} (run_args.json: resumed_with_changes)")
    return None


def superseded(output_dir: str, resume: str | None) -> None:
    """Complete checkpoints of this output_dir past the step this run starts from (auto_resume false, or an older
    resume_from_checkpoint) are moved aside: the Trainer would save into those folders while their old
    completion marker still stood, and a kill mid-save would leave a mixed folder that looked complete."""
    from fsdp_recipes.checkpoint import markers
    from fsdp_recipes.checkpoint.resume_check import checkpoint_step

    start = checkpoint_step(resume) if resume else 0
    for ckpt in markers.checkpoint_dirs(output_dir):
        if markers.is_complete(ckpt) and markers.step_of(ckpt) > start:
            moved = markers.move_aside(ckpt, "superseded")
            say(f"{ckpt.name} is past step {start}, where this run starts: moved to {moved.name} (kept, not resumed)")


def grace_seconds(recipe: Recipe) -> str:
    """preemption_grace_s before the recipe is parsed (torchrun reads it at start); the parse checks it later."""
    value = recipe.field("preemption_grace_s")
    try:
        return str(int(value))
    except (TypeError, ValueError):
        return str(PackArguments.preemption_grace_s)


@cli
def main(argv: list[str] | None = None) -> int:
    library_logs.divert(lambda text: None)  # each rank's log has the same records
    with ExitStack() as held:  # the output_dir's lock, from the checks to the summary
        return launch(list(sys.argv[1:] if argv is None else argv), held)


def launch(argv: list[str], held: ExitStack) -> int:
    """The steps of the module docstring, in order. The exit code, or a UserError's one line."""
    t0 = time.time()
    recipe = load_recipe(argv)
    with unexpected_errors("reading the recipe"):
        check_keys_early(recipe)
    gpus, build_smoke_model = set_up(recipe)
    with unexpected_errors("reading the recipe"):
        check_launch(recipe)
    extra = place(recipe, gpus)
    with unexpected_errors("reading the recipe"):
        check_model_found(recipe)
        check_data_found(recipe)
    locked = lock_output_dir(recipe, held)
    torchrun_logs = Path(tempfile.mkdtemp(prefix="fsdp-recipes-torchrun-"))  # torchrun's --log_dir: rank_command
    cmd = rank_command(recipe, extra, torchrun_logs)
    started = time.time()
    ranks = start_ranks(recipe, cmd, torchrun_logs, "", gated=True) if overlap_checks() else None
    cfg, code = check_while_ranks_import(recipe, held, ranks, torchrun_logs, build_smoke_model, locked)
    if code is not None:
        return code
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


def load_recipe(argv: list[str]) -> Recipe:
    """The recipe named first on the command line, loaded once (config/recipes.py), with the rest as overrides."""
    if not argv or argv[0].startswith("-"):
        raise UserError("usage: python -m fsdp_recipes.launch.launcher <recipe name or folder> [--field value ...]")
    with unexpected_errors("reading the recipe"):
        return recipes.load(argv[0], argv[1:])


def set_up(recipe: Recipe) -> tuple[int, Callable[[], None] | None]:
    """Step 1 of the module docstring; the summary's settings checked. Returns the GPUs here and, for a smoke run,
    what builds its tiny model (smoke.prepare swaps in the scaled accelerate YAML and its overrides now)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    say(f"recipe {recipe.name} ({recipe.folder}), trainer {recipe.trainer}")
    summary.settings()  # checked now: a bad value is one line before the ranks start, not after the training
    if override(launch_args(), "machine_rank", "0") == "0":  # one inventory per job, not one per node
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
        placed = placement.cpu_precision(recipe.name, recipe.raw, recipe.overrides, hardware.cpu_bf16_flags())
    for note in placed.notes:
        say(note)
    recipe.overrides = [*placed.overrides, *recipe.overrides]  # the user's last: they win
    if placed.processes is not None:
        recipe.accelerate = dict(recipe.accelerate, num_processes=placed.processes)
        extra += ["--num_processes", str(placed.processes)]
    return extra


def rank_command(recipe: Recipe, extra: list[str], torchrun_logs: Path) -> list[str]:
    """The `accelerate launch` command of the rank entry point; torchrun's signal handling set in the environment.

    torchrun writes each rank's output and error record under --log_dir, `torchrun_logs` (PET_REDIRECTS=3, in Ranks:
    to files only); the launcher relays the output, keeps it in output_dir/logs/rank<N>.log and reads the records
    (rank_output.py, explain_failure.py)."""
    cmd = accelerate_cmd() + ["--config_file", str(recipe.accelerate_path), "--log_dir", str(torchrun_logs), *extra,
                              *recipe.launch_options]  # --fsdp_transformer_layer_cls_to_wrap from the command line
    multi_node = int(recipe.accelerate.get("num_machines", 1)) > 1 or "--num_machines" in extra
    if not multi_node and "MASTER_PORT" not in os.environ:
        cmd += ["--main_process_port", str(free_port())]  # two runs on one machine must not collide
    cmd += ["-m", "fsdp_recipes.train.entry", *recipe.argv()]
    # torchrun forwards these signals to every rank and then allows the grace period before killing them.
    os.environ.setdefault("PET_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1")
    os.environ.setdefault("PET_SHUTDOWN_TIMEOUT", grace_seconds(recipe))
    return cmd


def overlap_checks() -> bool:
    """FSDP_RECIPES_OVERLAP_CHECKS=0: check first, then start the ranks (the order before start_gate.py), for a
    node whose host memory cannot take the ranks' imports and the launcher's dataset check at once."""
    return os.environ.get("FSDP_RECIPES_OVERLAP_CHECKS", "1") != "0"


def start_ranks(recipe: Recipe, cmd: list[str], torchrun_logs: Path, said: str, gated: bool) -> Ranks:
    wait = "; they wait at a gate until the checks pass" if gated else ""
    say(f"{said}starting {recipe.accelerate.get('num_processes', 1)} process(es){wait}:")
    say(" ".join(cmd))
    return Ranks(cmd, torchrun_logs, gated)


def check_while_ranks_import(recipe: Recipe, held: ExitStack, ranks: Ranks | None, torchrun_logs: Path,
                             build_smoke_model: Callable[[], None] | None,
                             locked: str | None = None) -> tuple[RunConfig | None, int | None]:
    """Step 3 of the module docstring: the smoke run's model, the recipe's checks (check_recipe) and output_dir's
    (claim_output_dir), while the ranks import, or before they start (`ranks` None). Returns the parsed
    configuration and None; or None and the exit code where the launch ends here (a signal, a run that is complete
    already), the ranks stopped. A failed check stops them and raises."""
    try:
        if build_smoke_model is not None:
            build_smoke_model()
        cfg = check_recipe(recipe)
        done = claim_output_dir(recipe, cfg, held, locked)
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


def read_report(output_dir: str, started: float) -> tuple[Path, bool, dict]:
    """The run report: its path, whether this run wrote it (not a previous run's), and what it says (this run's)."""
    report = Path(output_dir) / "metrics.json"
    fresh = report.exists() and report.stat().st_mtime >= started  # not a previous run's report
    metrics = json.loads(report.read_text()) if fresh else {}
    return report, fresh, metrics


def how_it_ended(recipe: Recipe, ranks: Ranks, rc: int, preempted_by: int | None, output_dir: str,
                 started: float) -> int | None:
    """The exit code of a run that was preempted, interrupted or failed (a failure raises its one line), with what to
    do next; None for a completed run, whose summary follows."""
    report, fresh, metrics = read_report(output_dir, started)
    completed = metrics.get("status") == "completed" and not metrics.get("provisional")
    if preempted_by is not None and completed:
        # The signal came after the ranks' final report (on a fast GPU a short run ends within a second of it):
        # torchrun then exits non-zero for its own signal, yet the run is complete. Calling it preempted would make
        # a requeued job start over, without a checkpoint, on top of the finished outputs.
        say(f"{signal.Signals(preempted_by).name} arrived after training completed: the final save was written and "
            f"checked, and the run report {report} is final; nothing to resume (the summary is skipped)")
        return gates.exit_code(metrics)  # its gates and divergence still decide: 3 or 4 as after a summary
    if metrics.get("status") == "preempted" and not metrics.get("provisional"):
        if ranks.interrupted and preempted_by is None:
            # torch 2.13.0's elastic agent: a SIGINT handled inside its metrics wrapper (metrics/api.py `prof`,
            # before `start` is set) turns into an UnboundLocalError, and torchrun stops the ranks with SIGTERM
            say(f"interrupted (Ctrl-C): torchrun passed it on to the ranks as SIGTERM, so they saved a checkpoint "
                f"first ({metrics.get('error')}); run the same command again to resume from it in {output_dir}")
            return EXIT_INTERRUPTED
        say(f"preempted: a checkpoint was saved in {output_dir}; run the same command again to resume")
        return EXIT_PREEMPTED
    if preempted_by is not None and (metrics.get("provisional") or rc != 0):
        say(grace_ran_out(output_dir, report, os.environ["PET_SHUTDOWN_TIMEOUT"], fresh))
        return EXIT_PREEMPTED
    if rc != 0 and completed:
        # Seen twice in CI before ranks skipped interpreter teardown (entry.exit_without_teardown): a rank aborted
        # there ("terminate called without an active exception") after the run had finished. Should a rank still
        # die after its report is final, the exit code stays non-zero and the user learns that nothing is missing.
        say(f"training completed and its run report {report} says so (final save written and checked), but a rank "
            f"exited with code {rc} afterwards, while shutting down; the outputs in {output_dir} are complete")
        return rc
    if rc != 0 and (ranks.interrupted or metrics.get("status") == "interrupted"):
        say(f"interrupted (Ctrl-C): no checkpoint was saved on the way out; run the same command again to resume "
            f"from the newest complete checkpoint in {output_dir}, if there is one")
        return EXIT_INTERRUPTED
    if rc != 0:
        raise failed(recipe, ranks, rc, output_dir, report, fresh)
    return None


def failed(recipe: Recipe, ranks: Ranks, rc: int, output_dir: str, report: Path, fresh: bool) -> UserError:
    """A failed run as one line (explain_failure.py), also recorded in this run's report."""
    from fsdp_recipes.checkpoint import markers as checkpoints

    log_dir = Path(output_dir) / "logs"
    last_good = checkpoints.latest_complete(output_dir)
    line, code = explain_failure.describe(ranks.records, rc, log_dir, recipe.name, last_good and str(last_good),
                                          traceback_file=ranks.traceback_file, output_dir=output_dir)
    if fresh:
        try:
            explain_failure.mark_report_failed(report, line, ranks.records[0] if ranks.records else None)
        except OSError as err:  # the disk that stopped the run: the line below is the report
            say(f"warning: {report} could not record the failure ({err.strerror or err})")
    return UserError(line, exit_code=code)


def summarise(recipe: Recipe, output_dir: str) -> int:
    """Step 5 of the module docstring, for a completed run (fsdp_recipes.launch.summary)."""
    report = Path(output_dir) / "metrics.json"
    with unexpected_errors("summarising the finished run"):
        try:
            return summary.main(summary_args(output_dir), recipe=recipe)
        except OSError as err:  # a full disk or a quota, met while writing the generations or the eval section
            raise UserError(f"training completed and {report} says so, but the summary could not write to "
                            f"{output_dir} ({err.strerror or err}). Fix: free space there, then `python -m "
                            f"fsdp_recipes.launch.summary {output_dir}` makes the summary again", exit_code=1) from None


@contextmanager
def unexpected_errors(doing: str):
    """Any exception but a UserError, raised inside, becomes the one line of `unexpected`."""
    try:
        yield
    except UserError:
        raise
    except Exception as err:
        raise unexpected(err, doing) from None


def unexpected(err: Exception, doing: str) -> UserError:
    """An exception no check turned into a UserError (a library's own validation, or a bug): one line, and the
    traceback in a file, since output_dir may be what is wrong."""
    import traceback

    fd, path = tempfile.mkstemp(prefix="fsdp-recipes-launch-", suffix=".log")
    with os.fdopen(fd, "w") as f:
        f.write("".join(traceback.format_exception(err)))
    first = next((x.strip() for x in str(err).splitlines() if x.strip()), "")
    return UserError(f"{type(err).__name__} while {doing}: {first}. Fix: correct the setting or file it names; "
                     f"full traceback: {path}")


def summary_args(output_dir: str) -> list[str]:
    """The summary runs on every node's launcher; its generations load two whole models, so only the first node
    (machine rank 0) may run them (summary.py decides, by size too)."""
    return [output_dir, "--machine-rank", str(override(launch_args(), "machine_rank", "0"))]


if __name__ == "__main__":
    sys.exit(main())
