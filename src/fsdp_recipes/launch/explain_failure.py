"""A failed run, as one line: the first failing rank's error record (train/failure_record.py), what to do about it,
where the full traceback is, and the exit code (2: before the first optimizer step, 1: during training)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from fsdp_recipes.errors import EXIT_USER_ERROR
from fsdp_recipes.metrics import metrics_file

EXIT_TRAINING_FAILED = 1


def read_records(torchrun_log_dir: Path) -> list[dict]:
    """Every rank's record under torchrun's log dir (<dir>/<run id>/attempt_<n>/<local rank>/error.json), oldest
    first. A file that is not the pack's record (written by torch's own `record` decorator) still counts."""
    found = []
    for path in sorted(Path(torchrun_log_dir).glob("*/attempt_*/*/error.json")):
        try:
            message = json.loads(path.read_text())["message"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if isinstance(message, str):  # torch's format for a record without extraInfo
            message = {"message": message, "extraInfo": {}}
        info = dict(message.get("extraInfo") or {})
        info.setdefault("error", message.get("message", ""))
        info.setdefault("type", "")
        info.setdefault("time", float(info.get("timestamp") or 0))
        info.setdefault("rank", int(path.parent.name))
        info.setdefault("phase", "training")
        info["message"] = message.get("message", "")
        found.append(info)
    return sorted(found, key=lambda r: r["time"])


def _first_line(text: str, limit: int = 400) -> str:
    line = next((x.strip() for x in str(text).splitlines() if x.strip()), "")
    return line if len(line) <= limit else line[:limit] + "..."


def _where(rec: dict) -> str:
    if rec.get("phase") == "setup":
        return "before the first optimizer step"
    if rec.get("trained_steps") is not None:  # the final save, its check, the merged model
        return f"after its {rec['trained_steps']} steps"
    return f"at step {rec['step']}" if rec.get("step") else "during training"


DISK_FULL = ("No space left on device", "Disk quota exceeded")  # ENOSPC, EDQUOT, as strerror spells them
# torch.save's zip writer (caffe2 inline_container.cc) reports a failed write without the errno ("unexpected pos 64
# vs 0", "file write failed"): seen when a rank's optimizer shard met a full tmpfs. Read as a full disk only when
# output_dir's file system is in fact nearly full when the launcher looks.
TORCH_WRITER = ("inline_container.cc", "PytorchStreamWriter failed")
NEARLY_FULL = 1 << 30


def free_bytes(path: str) -> int | None:
    """Free space of the file system holding `path` (its nearest existing parent); None when unreadable."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def fix_for(rec: dict, recipe: str, last_good: str | None, output_dir: str = "output_dir") -> tuple[str, str]:
    """(problem, fix) for a record: the pack's own errors carry their fix; known library errors get one here;
    anything else names the log."""
    kind = rec["type"].rsplit(".", 1)[-1]
    # the pack's own line is whole (cut at 400 characters it lost the end of its fix); a library's is cut
    error = _first_line(rec["error"], limit=4000 if kind == "UserError" else 400)
    if kind == "UserError":  # the message is already "<problem>. Fix: <what to do>"
        problem, _, fix = error.partition(" Fix: ")
        return problem.rstrip("."), fix.rstrip(".")
    if kind == "NonFiniteLoss":
        resume = f"the last good checkpoint is {last_good}" if last_good else "there is no complete checkpoint"
        return (f"{error}; training stopped there, before the optimizer applied it ({resume})",
                "usually a learning rate too high (lower learning_rate, add warmup_steps, set max_grad_norm), fp16 "
                "overflow (use bf16), or rows whose labels are all masked; fix the cause before resuming")
    named = re.search(r"['<](/[^'>]+)['>]", rec["error"])  # the file the error names, if it names one
    disk_full = any(text in rec["error"] for text in DISK_FULL)
    if not disk_full and any(text in rec["error"] for text in TORCH_WRITER):
        free = free_bytes(output_dir)
        disk_full = free is not None and free < NEARLY_FULL
        if disk_full:
            error += f" (torch could not write the file; {output_dir} has {free / 2**20:.1f} MiB free)"
    if disk_full and named and not named.group(1).startswith(output_dir):
        return (f"rank {rec['rank']} ran out of space writing {named.group(1)} {_where(rec)}: {error}",
                f"free space where {named.group(1)} is (df -h {Path(named.group(1)).parent}; /dev/shm in a "
                f"container: a larger --shm-size), then run the same command again")
    if disk_full:
        resume = (f"it resumes from {last_good}, which is intact" if last_good
                  else "it starts over: no checkpoint was complete")
        return (f"rank {rec['rank']} ran out of disk space {_where(rec)}: {error}",
                f"free space where {output_dir} is (df -h {output_dir}; older runs, or a lower save_total_limit), "
                f"then run the same command again: {resume}")
    if kind == "OutOfMemoryError" or "out of memory" in error.lower():
        phase = ("while loading the model and setting up" if rec.get("phase") == "setup"
                 else f"during training ({_where(rec)})")
        return (f"rank {rec['rank']} ran out of device memory {phase}: {error}",
                f"check the budget with `make plan RECIPE={recipe}`, then lower per_device_train_batch_size or "
                "max_length (raise gradient_accumulation_steps to keep the batch), turn on activation_checkpointing, "
                "use LoRA or more GPUs")
    return f"rank {rec['rank']} failed {_where(rec)}: {kind}: {error}", ""


def describe(records: list[dict], rc: int, log_dir: Path | None, recipe: str, last_good: str | None,
             traceback_file: str | None = None, output_dir: str = "output_dir") -> tuple[str, int]:
    """The one line (without `error: `) and the exit code for a run whose ranks exited with `rc` != 0.
    `traceback_file`: where the tracebacks are when the rank logs could not be written."""
    logs = f"{log_dir}/" if log_dir else "the terminal above"
    if not records:
        return (f"training stopped with exit code {rc} and no rank recorded an error (a rank was killed: out of "
                f"host memory, a signal, or torchrun could not start them). Fix: read {log_dir / 'launch.log' if log_dir else logs} "
                f"and the rank logs in {logs}", EXIT_TRAINING_FAILED)
    rec = records[0]
    problem, fix = fix_for(rec, recipe, last_good, output_dir)
    problem = problem.rstrip(".")  # a library message ending in "." must not end in ".." before ". Fix:"
    log = traceback_file or (f"{log_dir}/rank{rec['rank']}.log" if log_dir else logs)
    code = EXIT_USER_ERROR if rec.get("phase") == "setup" else EXIT_TRAINING_FAILED
    if not fix:  # an error the pack does not know: the traceback is what there is to read
        return f"{problem}. Fix: read the full traceback in {log}", code
    return f"{problem}. Fix: {fix}. Full traceback: {log}", code


def mark_report_failed(report: Path, line: str, rec: dict | None) -> None:
    """A run report this run wrote says `failed`, with the first failing rank's reason (rank 0 may have written
    another: the collective that broke when that rank died)."""
    def failed(metrics: dict) -> dict | None:
        if metrics.get("status") == "completed":
            return None
        metrics.update(status="failed", error=line, provisional=False)
        if rec is not None:
            metrics.update(failed_rank=rec.get("rank"), failed_phase=rec.get("phase"), failed_step=rec.get("step"))
        return metrics

    metrics_file.amend(report.parent, failed)
