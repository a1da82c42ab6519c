"""How a launch ended: preempted, interrupted, failed (one line, explain_failure.py) or completed (the summary)."""

from __future__ import annotations

import functools
import json
import os
import signal
import sys
from pathlib import Path

# Only light modules here: the heavy imports (torch, transformers, TRL) happen in the checks, while the ranks
# import the same in parallel.
from fsdp_recipes.config.job import machine_rank
from fsdp_recipes.config.recipes import Recipe
from fsdp_recipes.dist import slurm_job
from fsdp_recipes.errors import EXIT_INTERRUPTED, EXIT_PREEMPTED, EXIT_USER_ERROR, UserError
from fsdp_recipes.launch import explain_failure, summary
from fsdp_recipes.launch.lines import say, unexpected
from fsdp_recipes.launch.ranks import Ranks
from fsdp_recipes.metrics import gates, metrics_file


# `make finetune` exits 2 for any failure (make's own code); a script that must tell a gate (3), a divergence (4), a
# preemption (75: requeue), an interruption (130), a failed run (1) and a mistake (2) apart names a file here
# (the Makefile's EXIT_CODE_FILE) and the launcher writes its exit code to it as it exits, 0 included.
EXIT_CODE_FILE_ENV = "FSDP_RECIPES_EXIT_CODE_FILE"


def records_exit_code(main):
    """Decorate the launcher's `main` (outside errors.cli, whose SystemExit carries a UserError's code): its exit code
    written to $FSDP_RECIPES_EXIT_CODE_FILE, when set, however it ends (an exception no check caught: 1, as Python
    exits; Ctrl-C escaping: 130)."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        path = os.environ.get(EXIT_CODE_FILE_ENV)
        target = Path(path).absolute() if path else None
        # found before the run, not when the code is written after it (launch.sh; the Makefile checks the same)
        if target is not None and (target.is_dir() or not target.parent.is_dir()):
            where = "is a folder" if target.is_dir() else f"is in a folder that does not exist ({target.parent})"
            print(f"error: {EXIT_CODE_FILE_ENV}={path} {where}, where the exit code cannot be written. Fix: create "
                  "that folder first, or name a file in one that exists.", file=sys.stderr, flush=True)
            sys.exit(EXIT_USER_ERROR)
        code: object = 1
        try:
            code = main(*args, **kwargs)
            return code
        except SystemExit as stop:
            code = stop.code
            raise
        except KeyboardInterrupt:
            code = EXIT_INTERRUPTED
            raise
        finally:
            write_exit_code(code)

    return wrapper


def write_exit_code(code: object) -> None:
    path = os.environ.get(EXIT_CODE_FILE_ENV)
    if not path:
        return
    number = 0 if code is None else code if isinstance(code, int) else 1  # as Python turns sys.exit(x) into a status
    try:
        Path(path).write_text(f"{number}\n")
    except OSError as err:  # the exit code itself stays what it was
        print(f"warning: the exit code {number} could not be written to {path} ({err.strerror or err})",
              file=sys.stderr, flush=True)


def grace_ran_out(output_dir: str, report: Path, grace_s: str, fresh: bool, cfg=None) -> str:
    """The ranks were stopped before the preemption checkpoint was complete: say so, in the report too."""
    note = (f"preempted, but the ranks did not finish within the grace period ({grace_s} s) and were stopped; "
            f"an incomplete checkpoint is skipped on resume: {resumes_from(output_dir, cfg)}. Fix: raise "
            f"preemption_grace_s (and the scheduler's grace) above the checkpoint save time")
    if fresh:
        metrics_file.amend(report.parent, lambda m: {
            **m, "status": "preempted", "error": f"{m.get('error') or ''} -- {note}".lstrip(" -"), "provisional": False})
    return note


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
        if ranks.interrupted and preempted_by is None:  # Ctrl-C, passed on as SIGTERM (Ranks._on_signal)
            say(f"interrupted (Ctrl-C): the ranks saved a checkpoint first ({metrics.get('error')}); "
                f"{resumes_from(output_dir, recipe.cfg)}")
            return EXIT_INTERRUPTED
        say(f"preempted: a checkpoint was saved in {output_dir}; {resumes_from(output_dir, recipe.cfg)}")
        return EXIT_PREEMPTED
    if preempted_by is not None and (metrics.get("provisional") or rc != 0):
        say(grace_ran_out(output_dir, report, os.environ["PET_SHUTDOWN_TIMEOUT"], fresh, recipe.cfg))
        return EXIT_PREEMPTED
    if rc != 0 and completed:
        # Seen twice in CI before ranks skipped interpreter teardown (entry.exit_without_teardown): a rank aborted
        # there ("terminate called without an active exception") after the run had finished. Should a rank still
        # die after its report is final, the exit code stays non-zero and the user learns that nothing is missing.
        say(f"training completed and its run report {report} says so (final save written and checked), but a rank "
            f"exited with code {rc} afterwards, while shutting down; the outputs in {output_dir} are complete")
        return rc
    if rc != 0 and (ranks.interrupted or metrics.get("status") == "interrupted"):
        if ranks.killed:
            how = "the second Ctrl-C stopped the ranks at once"
        elif metrics.get("status") == "preempted":  # the first Ctrl-C's checkpoint was begun: the grace ran out
            how = (f"the ranks' checkpoint did not finish within the grace period "
                   f"({os.environ.get('PET_SHUTDOWN_TIMEOUT')} s, preemption_grace_s)")
        else:
            how = "the ranks stopped at once"
        say(f"interrupted (Ctrl-C): {how}, with no checkpoint saved on the way out; "
            f"{resumes_from(output_dir, recipe.cfg)}")
        return EXIT_INTERRUPTED
    if rc != 0:
        raise failed(recipe, ranks, rc, output_dir, report, fresh)
    return None


def resumes_from(output_dir: str, cfg=None) -> str:
    """What the same command does next in `output_dir` (`cfg`: its parsed recipe, recipe.cfg): resume from the newest
    complete checkpoint it can read (markers.usable, as the resume picks it), or what its settings do instead: a
    requeued job runs the same command."""
    from fsdp_recipes.checkpoint import markers as checkpoints

    latest = checkpoints.usable(output_dir)[0]
    if cfg is None or not cfg.pack.overwrite_output_dir:
        return next_start(output_dir, latest, cfg, "the same command")
    empties = (f"the same command (--overwrite_output_dir true) would empty {output_dir} again, checkpoints and all: "
               + (f"leave that flag out to resume from {latest}" if latest else "nothing would resume"))
    if (job := slurm_job()) is None:
        return empties
    # output_dir.requeued: a requeue keeps the job's own run, and its other settings decide what then
    return f"{empties}; a requeue of Slurm job {job[0]} keeps it: " + next_start(output_dir, latest, cfg,
                                                                               "the requeued job")


def next_start(output_dir: str, latest: Path | None, cfg, who: str) -> str:
    """Where `who` (the same command) starts in `output_dir` by its resume settings, `latest` the checkpoint
    auto_resume picks."""
    if cfg is not None and (resume := cfg.training.resume_from_checkpoint):
        return f"{who} resumes from {resume} again (its resume_from_checkpoint)" + (
            f"; leave that out to resume from {latest}" if latest and Path(resume) != latest else "")
    if cfg is not None and not cfg.pack.auto_resume:
        return f"{who} starts again at step 0 (--auto_resume false)" + (
            f"; --auto_resume true resumes from {latest}" if latest else "")
    return (f"{who} resumes from {latest}" if latest else
            f"no complete checkpoint in {output_dir}: {who} starts again at step 0")


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
    again = f"`python -m fsdp_recipes.launch.summary {output_dir}` makes the summary again"
    try:
        return summary.main(summary_args(output_dir), recipe=recipe)
    except UserError as err:
        if err.exit_code != EXIT_USER_ERROR:
            raise
        raise UserError(f"training completed and {report} says so (the outputs in {output_dir} are complete), but the "
                        f"summary stopped: {err}; once fixed, {again}", exit_code=1) from None
    except OSError as err:  # a full disk or a quota, met while writing the generations or the eval section
        raise UserError(f"training completed and {report} says so, but the summary could not write to "
                        f"{output_dir} ({err.strerror or err}). Fix: free space there, then {again}",
                        exit_code=1) from None
    except Exception as err:  # the weights are saved: not exit 2, which says that nothing ran
        raise unexpected(err, f"summarising the finished run (training completed and {report} says so; the "
                              f"outputs in {output_dir} are complete)",
                         fix=f"once the cause is fixed, {again}", exit_code=1) from None


def summary_args(output_dir: str) -> list[str]:
    """The summary runs on every node's launcher; its generations load two whole models, so only the first node
    (machine rank 0) may run them (summary.py decides, by size too)."""
    return [output_dir, "--machine-rank", machine_rank()]

