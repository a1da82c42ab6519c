"""What an output_dir already holds, and what a new command there may do with it.

The rule (docs/checkpoints.md, "One output_dir, one run"):
- A finished run (metrics.json `completed`) is never replaced silently. The same command again says "already
  complete" and changes nothing. A larger max_steps continues it from its last checkpoint, when it saved one at its
  last step. Anything else is refused in one line naming a new --output_dir or --overwrite_output_dir.
- An unfinished run (preempted, failed, interrupted, or killed before its report) is resumed from its newest complete
  checkpoint by the same command (checkpoint/resume_settings.py compares the settings), or started over when it has
  none.
- `--overwrite_output_dir true` removes what a run left there first, after saying what it removes: the user's own
  files (NOT_A_RUNS by suffix) and what this run reads (its data or model inside the folder) stay.

The launcher calls `decide` while it holds the output_dir's lock (output_lock.py), before any rank starts.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

from fsdp_recipes import dist, model_folders
from fsdp_recipes.checkpoint import markers, resume_settings
from fsdp_recipes.checkpoint.output_lock import LOCK_FILE
from fsdp_recipes.errors import UserError
from fsdp_recipes.paths import same_path_key

REPORT, ARGS = "metrics.json", "run_args.json"
# What a run trained, besides the settings resume_settings compares: the base model and the adapter (run_args.json's
# model_args, TRL's ModelConfig fields). A command with another one is another run, never "already complete"; a
# resume of another model or adapter shape is checkpoint/markers.py check_compatible's to refuse.
MODEL = ("model_name_or_path", "use_peft")
ADAPTER = ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_target_parameters",
           "lora_modules_to_save", "use_rslora", "use_dora")


@dataclass
class Previous:
    status: str | None  # metrics.json's, None without one; "running?" for a provisional report
    steps: int | None
    finished_at: str | None
    settings: dict | None  # run_args.json's resume_settings: what the run was trained with
    last_checkpoint: Path | None  # the newest complete, readable one
    unreadable: list[tuple[Path, str]]  # newer complete ones that cannot be read, with why
    model: dict | None = None  # trained(run_args.json's model_args): the base model and the adapter
    job: tuple | None = None  # the Slurm job that ran it, and that job's restart count (run_args.json's launcher)


def read(output_dir: Path) -> Previous | None:
    """None when the folder holds no run (no report, no run_args.json, no checkpoint)."""
    report, args = output_dir / REPORT, output_dir / ARGS
    if not (report.is_file() or args.is_file() or markers.checkpoint_dirs(output_dir)):
        return None
    metrics = _json(report)
    status = metrics.get("status")
    if metrics.get("provisional"):
        status = "running?"  # a rank's report before its end: the run died, or is still running elsewhere
    last, bad = markers.usable(output_dir)
    recorded = _json(args)
    return Previous(status, metrics.get("steps"), metrics.get("finished_at"), recorded.get("resume_settings"),
                    last, bad, trained(recorded.get("model_args")), slurm_job(recorded.get("launcher") or {}))


# What a run writes at the top of its output_dir besides its report and checkpoints: the Trainer's final save (weights
# or adapter, model_folders' names, and these), its model card, the pack's merged model. In a folder that holds no run,
# an entry of these names is someone else's, which the run would overwrite without a word (a recipe folder's README.md,
# a model folder's weights).
RUN_WRITES = ("README.md", "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "tokenizer.model", "special_tokens_map.json", "chat_template.jinja", "vocab.json", "merges.txt",
              "training_args.bin", "merged")


def run_writes(name: str) -> bool:
    return (name in RUN_WRITES or name in model_folders.ADAPTER_FILES
            or any(fnmatch(name, pattern) for pattern in model_folders.WEIGHT_GLOBS))


def check_named(output_dir: str | Path) -> None:
    """An empty output_dir: Path("") is the working directory, which would be locked, read and written."""
    if not str(output_dir).strip():
        raise UserError("output_dir is empty. Fix: name the folder the run writes to, e.g. --output_dir runs/my-run")


def check_not_anothers(output_dir: str | Path, previous: Previous | None, model: str | None) -> None:
    """Refuse an output_dir that is the folder of the model this run trains from (its final save would replace the
    base model's files, --overwrite_output_dir would delete them first), and one that holds no run but files a run
    writes (`previous`: read(output_dir)). Before anything is written or removed."""
    out = Path(output_dir)
    if model and Path(model).is_dir() and out.resolve() == Path(model).resolve():
        raise UserError(f"output_dir {output_dir} is the folder of the model this run trains from "
                        f"(model_name_or_path): the run's final save would replace the model's own files. Fix: a new "
                        f"--output_dir, e.g. {out.parent / (out.name + '-trained')}")
    if previous is not None or not out.is_dir():
        return
    taken = sorted(p.name for p in out.iterdir() if run_writes(p.name))
    if taken:
        names = ", ".join(taken[:4]) + (f" and {len(taken) - 4} more" if len(taken) > 4 else "")
        raise UserError(f"output_dir {output_dir} holds files that are no run's ({names}), which this run would "
                        f"overwrite. Fix: a new or empty --output_dir (--overwrite_output_dir replaces a run, not "
                        f"other files)")


def requeued(previous: Previous | None, now: dict) -> bool:
    """The run in output_dir is this very Slurm job's, before a requeue: the same job id, a lower restart count, the
    same settings (`now`: this command's resume_settings.current; a job script that runs several commands into one
    folder is not requeueing the first). The requeued job runs the same command, and --overwrite_output_dir, meant for
    what the job found at its first start, keeps the job's own progress: resumed when unfinished, "already complete"
    when Slurm requeued it after its end (PreemptMode=REQUEUE, a node failure)."""
    job = dist.slurm_job()
    if job is None or previous is None or previous.job is None or previous.job[0] != job[0]:
        return False
    saved = previous.settings  # None: a run of a pack version that did not record them
    same = saved is None or (not resume_settings.changes(saved, now)
                             and resume_settings.length(saved) == resume_settings.length(now))
    return previous.job[1] < job[1] and same


def slurm_job(launcher: dict) -> tuple[str, int] | None:
    """(id, restart count) as dist.slurm_job gives them, from run_args.json's launcher; None outside Slurm."""
    job = launcher.get("slurm_job_id")
    return (job, int(launcher.get("slurm_restart_count") or 0)) if job else None


def trained(model_args) -> dict | None:
    """The base model and the adapter of a ModelConfig (or of its run_args.json dict), comparable: the model's path
    expanded ($FSDP_RECIPES_CACHE, ~), lists sorted; the adapter's fields only under LoRA."""
    if model_args is None:
        return None
    get = model_args.get if isinstance(model_args, dict) else lambda k: getattr(model_args, k, None)
    has = model_args.__contains__ if isinstance(model_args, dict) else lambda k: hasattr(model_args, k)
    names = [k for k in MODEL + (ADAPTER if get("use_peft") else ()) if has(k)]  # one a run never recorded: unknown
    out = {k: sorted(get(k)) if isinstance(get(k), (list, tuple, set)) else get(k) for k in names}
    if isinstance(out.get("model_name_or_path"), str):
        out["model_name_or_path"] = same_path_key(out["model_name_or_path"])
    return out


def model_changes(saved: dict | None, now: dict | None) -> dict[str, list]:
    """{name: [saved, now]} for the base model and adapter fields that differ (none when either is unknown). A field
    missing on either side (a run_args.json of a TRL or pack version without it) is unknown, not a difference, as
    markers.check_compatible treats a checkpoint's identity."""
    if not saved or not now:
        return {}
    names = MODEL if saved.get("use_peft") != now.get("use_peft") else saved
    return {k: [saved[k], now[k]] for k in names if k in saved and k in now and saved[k] != now[k]}


def decide(output_dir: str | Path, previous: Previous | None, now: dict, override: bool = False,
           resumes: bool = True, model: dict | None = None) -> str | None:
    """None: go on (train, resume or continue). A string: the run is already complete, nothing to do (the line
    to print). Raises UserError for a command that would replace a finished run. `previous`: read(output_dir);
    `now`: this command's resume_settings.current; `override`: its override_resumed_settings; `resumes`: whether
    the command resumes from a checkpoint at all (auto_resume, or resume_from_checkpoint): without, it would start
    over; `model`: trained(its ModelConfig), another base model or adapter than the run's never continues it."""
    if previous is None or previous.status != "completed":
        return None  # nothing there, or an unfinished run: resumed from its checkpoint, or started over
    done = f"{output_dir} holds a finished run ({previous.steps} steps, completed {previous.finished_at}, {REPORT})"
    saved = previous.settings
    if saved is None:  # a run of a pack version that did not record them
        raise UserError(f"{done}, whose settings were not recorded (an earlier version of the pack), so this command "
                        f"cannot be told apart from one that would replace it. Fix: a new --output_dir, or "
                        f"--overwrite_output_dir true to replace it.")
    other_model = model_changes(previous.model, model)
    changed = {**resume_settings.changes(saved, now), **other_model}
    longer = _longer(saved, now)
    final = previous.last_checkpoint
    at_end = final is not None and markers.step_of(final) == previous.steps
    if not changed and resume_settings.length(saved) == resume_settings.length(now):
        more = f"; to train longer: a larger --max_steps (continues from {final.name})" if at_end else ""
        return (f"{done}: already complete with this command's settings; nothing to do. To train again: a new "
                f"--output_dir, or --overwrite_output_dir true{more}")
    fixed = [k for k in changed if resume_settings.is_fixed(k, now) or k in other_model]
    if longer and at_end and resumes and (not changed or override and not fixed):
        return None  # continue from its last checkpoint: checkpoint_to_resume checks and reports the rest
    if longer:
        fix = "Fix: a new --output_dir"
        unreadable = [f"{c.name} cannot be read ({why})" for c, why in previous.unreadable
                      if markers.step_of(c) == previous.steps]
        if not resumes:
            why = "this command does not resume (auto_resume false), so it would start over on top of it"
        elif at_end:
            why = f"this command also changes {resume_settings.described(changed)}"
            batch = resume_settings.other_rows(saved, now, changed)  # the global batch beside another mesh
            if batch:
                why, fix = f"{why}: {batch[0]}", batch[1]
        else:
            why = unreadable[0] if unreadable else ("it saved no checkpoint at its last step (save_strategy \"no\", "
                                                    "or save_steps that do not divide max_steps)")
        raise UserError(f"{done}; it cannot continue to {'='.join(map(str, resume_settings.length(now)))}: {why}. "
                        f"{fix}, or --overwrite_output_dir true to replace it"
                        f"{', or --override_resumed_settings true' if at_end and resumes and not fixed else ''}.")
    (name, was), (_, asked) = resume_settings.length(saved), resume_settings.length(now)
    differences = {**changed, **({name: [was, asked]} if was != asked else {})}
    raise UserError(f"{done} with other settings ({resume_settings.described(differences)}); a new run there would "
                    f"replace it. Fix: a new --output_dir, or --overwrite_output_dir true to replace it.")


# Files no run writes, by suffix: a user's data, code and notes in the folder output_dir names (a run writes beside
# them; --overwrite_output_dir deleted them with the run). A tokenizer's own .txt files are a run's.
NOT_A_RUNS = (".jsonl", ".csv", ".tsv", ".parquet", ".xlsx", ".xls", ".txt", ".md", ".py", ".ipynb", ".sh",
              ".yaml", ".yml", ".gz", ".xz", ".zst", ".bz2", ".zip", ".tar")
RUNS_OWN = ("README.md", "merges.txt", "vocab.txt")


def clear(output_dir: str | Path, previous: Previous | None, keep=()) -> str | None:
    """--overwrite_output_dir: remove everything but the lock and the user's own files (NOT_A_RUNS) from an
    output_dir that holds a run (`previous`, read(output_dir): a report, run_args.json or a checkpoint; a folder of
    other files is left alone). `keep`: paths this run reads (its dataset_name, model_name_or_path): an entry that is
    one of them or holds one stays whatever its suffix (a train.json, a data/ folder, the merged/ model continued from
    were deleted, and the run failed on the data or model its checks had just read). The line to print, or None."""
    output_dir = Path(output_dir)
    if previous is None:
        return None
    read = [Path(k).resolve() for k in keep if k]
    entries, kept = [], []
    for p in output_dir.iterdir():
        if p.name == LOCK_FILE:
            continue
        users = p.is_file() and p.suffix.lower() in NOT_A_RUNS and p.name not in RUNS_OWN
        needed = any(r == p.resolve() or r.is_relative_to(p.resolve()) for r in read)
        (kept if users or needed else entries).append(p)
    what = f"a {previous.status} run of {previous.steps} steps" if previous.status else "an unfinished run"
    for p in entries:
        shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    names = ", ".join(sorted(p.name for p in kept)[:3]) + (f" and {len(kept) - 3} more" if len(kept) > 3 else "")
    return (f"removed {what} from {output_dir} ({len(entries)} files and folders)"
            + (f"; kept {len(kept)} file(s) no run writes ({names})" if kept else ""))


def _longer(saved: dict, now: dict) -> bool:
    (name_a, a), (name_b, b) = resume_settings.length(saved), resume_settings.length(now)
    return name_a == name_b and b is not None and a is not None and b > a


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
