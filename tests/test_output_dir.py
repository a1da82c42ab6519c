"""One output_dir, one run: nothing a command does there loses or silently contradicts an earlier run.

docs/checkpoints.md "One output_dir, one run" states the rule; checkpoint/previous_run.py, output_lock.py and
resume_settings.py implement it. One real 4-step run (module fixture, checkpoints at steps 2 and 4) is what the
commands below meet; each test that changes it works on a copy. The refusals are checked in the launcher's own
process (no rank starts); continuing with new settings and a full disk run for real. The finished run is
conftest.shared_run's: tests/test_start_gate.py's gate test watches the same launch and publishes it, so that one
launch serves both files (the one that comes first makes it).
"""

import json
import math
import os
import shutil
import signal
import subprocess
import sys

import pytest

from conftest import SHORT_TINY_RUN, launch, launcher_checks, launcher_until_ranks, RanksWouldStart, shared_run
from fsdp_recipes.checkpoint import markers
from fsdp_recipes.checkpoint.output_lock import LOCK_FILE

# tiny-cpu-lora, 4 steps, checkpoints at steps 2 and 4, no evaluation, no merged model, no warm-up
ARGS = SHORT_TINY_RUN
LR = 3e-3  # the recipe's, cosine


@pytest.fixture(scope="module")
def shared(cache_dir):
    return shared_run(ARGS, cache_dir)


@pytest.fixture
def finished(shared, monkeypatch):
    """The finished run's folder (read-only: the tests that change it use `copy`). The launcher resolves the
    recipe's $FSDP_RECIPES_CACHE paths where this run was made (the other xdist worker's cache, if it made it)."""
    monkeypatch.setenv("FSDP_RECIPES_CACHE", str(shared.cache))
    return shared.out


@pytest.fixture
def copy(finished, tmp_path):
    return shutil.copytree(finished, tmp_path / "run")


def files(folder):
    """Every file's bytes but the lock's (which each launcher writes its name into)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != LOCK_FILE}


def one_error(res) -> str:
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), res.stdout + res.stderr
    assert "Traceback" not in res.stdout + res.stderr and "Fix:" in lines[0]
    return lines[0]


def test_the_same_command_again_is_already_complete_and_changes_nothing(finished, monkeypatch, capsys):
    before = files(finished)
    res = launcher_checks([*ARGS, "--output_dir", str(finished)], monkeypatch, capsys)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "holds a finished run (4 steps" in res.stdout and "already complete" in res.stdout
    assert "continues from checkpoint-4" in res.stdout  # how to train longer
    # said once the recipe is parsed, before the checks read the model and the rows (its token lengths' table)
    assert "FSDP wraps" not in res.stdout and "token lengths" not in res.stdout, res.stdout
    assert files(finished) == before


def test_other_settings_never_replace_a_finished_run(finished, monkeypatch, capsys):
    before = files(finished)
    line = one_error(launcher_checks([*ARGS, "--output_dir", str(finished), "--learning_rate", "1e-3"],
                                     monkeypatch, capsys))
    assert "holds a finished run (4 steps" in line and "learning_rate 0.003 -> 0.001" in line
    assert "a new --output_dir, or --overwrite_output_dir true" in line
    # a longer run with a new learning rate would continue from checkpoint-4 on other settings: asked for explicitly
    line = one_error(launcher_checks([*ARGS, "--output_dir", str(finished), "--max_steps", "6", "--learning_rate",
                                      "1e-3"], monkeypatch, capsys))
    assert "cannot continue to max_steps=6" in line and "--override_resumed_settings true" in line
    # a mistake in the other settings is said, not the refusal, whose fix would replace the run for a broken command
    line = one_error(launcher_checks([*ARGS, "--output_dir", str(finished), "--lora_target_modules", "q_proj", "nope"],
                                     monkeypatch, capsys))
    assert "lora_target_modules ['nope'] match no module" in line, line
    line = one_error(launcher_checks([*ARGS, "--output_dir", str(finished), "--max_steps", "2"], monkeypatch, capsys))
    assert "with other settings (max_steps 4 -> 2)" in line
    line = one_error(launcher_checks([*ARGS, "--output_dir", str(finished), "--max_steps", "6", "--auto_resume",
                                      "false"], monkeypatch, capsys))
    assert "does not resume (auto_resume false), so it would start over on top of it" in line
    assert files(finished) == before


def test_another_adapter_or_full_fine_tuning_is_never_already_complete(finished, monkeypatch, capsys):
    """The base model and the adapter are run_args.json's model_args, not resume_settings: a relaunch with another
    LoRA rank, or full fine-tuning, said "already complete with this command's settings" and exited 0."""
    before = files(finished)
    line = one_error(launcher_checks([*ARGS, "--output_dir", str(finished), "--lora_r", "8"], monkeypatch, capsys))
    assert "holds a finished run (4 steps" in line and "with other settings (lora_r 32 -> 8)" in line
    line = one_error(launcher_checks([*ARGS, "--output_dir", str(finished), "--max_steps", "6", "--use_peft", "false"],
                                     monkeypatch, capsys))
    assert "cannot continue to max_steps=6: this command also changes use_peft True -> False" in line
    assert "--override_resumed_settings" not in line  # no override continues another model's run
    assert files(finished) == before


def test_another_base_model_is_never_already_complete(tmp_path, monkeypatch):
    """The model path as the user writes it ($FSDP_RECIPES_CACHE, ~) or as run_args.json records it (expanded)."""
    from fsdp_recipes.checkpoint.previous_run import Previous, decide, trained
    from fsdp_recipes.errors import UserError

    settings = {"learning_rate": 1e-3, "max_steps": 4, "num_train_epochs": 3.0}
    lora = {"use_peft": True, "lora_r": 16, "lora_alpha": 32, "lora_target_modules": ["v_proj", "q_proj"]}
    saved = trained({"model_name_or_path": str(tmp_path / "cache/tiny-mistral"), **lora})
    previous = Previous("completed", 4, "2026-11-29T05:00:00", settings, None, [], saved)
    monkeypatch.setenv("FSDP_RECIPES_CACHE", str(tmp_path / "cache"))
    same = trained({"model_name_or_path": "$FSDP_RECIPES_CACHE/tiny-mistral/", **lora,
                    "lora_target_modules": ["q_proj", "v_proj"]})
    assert "already complete" in decide("out", previous, dict(settings), model=same)
    with pytest.raises(UserError, match=r"with other settings \(model_name_or_path '.*/cache/tiny-mistral' -> "
                                        r"'.*/cache/qwen3'\); a new run there would replace it"):
        decide("out", previous, dict(settings), model={**same, "model_name_or_path": str(tmp_path / "cache/qwen3")})


def test_an_adapter_field_an_older_run_never_recorded_is_unknown_not_a_difference():
    """run_args.json of a TRL version before use_dora: its model_args lack the key; the same command (TRL's
    ModelConfig, use_dora False) is the same run, while a field both record and that differs still refuses."""
    from trl import ModelConfig
    from fsdp_recipes.checkpoint.previous_run import Previous, decide, trained
    from fsdp_recipes.errors import UserError

    settings = {"learning_rate": 1e-3, "max_steps": 4, "num_train_epochs": 3.0}
    now = ModelConfig(model_name_or_path="/models/tiny", use_peft=True, lora_r=16, lora_target_modules=["q_proj"])
    older = {k: v for k, v in vars(now).items() if k != "use_dora"}
    previous = Previous("completed", 4, "2026-11-29T05:00:00", settings, None, [], trained(older))
    assert "already complete" in decide("out", previous, dict(settings), model=trained(now))
    with pytest.raises(UserError, match=r"with other settings \(lora_r 16 -> 8\)"):
        decide("out", previous, dict(settings), model={**trained(now), "lora_r": 8})


def test_the_same_command_again_starts_no_ranks(finished, monkeypatch, capsys):
    """The ranks import while the launcher checks (the default): the same command again started them, and stopped
    them some 10 s later at "already complete". A finished run in the named output_dir now waits for the checks."""
    before = files(finished)
    res = launcher_until_ranks([*ARGS, "--output_dir", str(finished)], monkeypatch, capsys, checks_first=False)
    assert res.returncode == 0 and "already complete" in res.stdout, res.stdout + res.stderr
    assert "starting" not in res.stdout and files(finished) == before


def test_an_unfinished_run_never_resumes_with_another_lora_scale(copy, monkeypatch, capsys):
    """lora_alpha (with r, the adapter's scale) and DoRA or rsLoRA change what the checkpoint's adapter weights
    compute: a resume with another was not refused (the checkpoint's identity compared r, the targets and
    modules_to_save only)."""
    metrics = json.loads((copy / "metrics.json").read_text())
    (copy / "metrics.json").write_text(json.dumps({**metrics, "status": "preempted"}))
    line = one_error(launcher_checks([*ARGS, "--output_dir", str(copy), "--max_steps", "6", "--lora_alpha", "64"],
                                     monkeypatch, capsys))
    assert "cannot resume from" in line and "its LoRA lora_alpha is 32 and this run's is 64" in line


def test_a_finished_run_without_a_last_checkpoint_cannot_continue(copy, monkeypatch, capsys):
    """The default recipe saves no checkpoint (save_strategy "no"): a larger max_steps has nothing to continue from."""
    for ckpt in markers.checkpoint_dirs(copy):
        shutil.rmtree(ckpt)
    line = one_error(launcher_checks([*ARGS, "--output_dir", str(copy), "--max_steps", "6"], monkeypatch, capsys))
    assert "cannot continue to max_steps=6: it saved no checkpoint at its last step" in line
    res = launcher_checks([*ARGS, "--output_dir", str(copy)], monkeypatch, capsys)
    assert res.returncode == 0 and "already complete" in res.stdout and "to train longer" not in res.stdout


def test_continuing_a_finished_run_with_a_new_learning_rate_applies_it(copy, shared):
    """max_steps 4 -> 6 and learning rate 3e-3 -> 1e-3, asked for with --override_resumed_settings: steps 5 and 6 run
    on the new cosine schedule (6 steps, peak 1e-3) from step 4, the first 4 steps stay as they were. Without the
    schedule resync, the optimizer would keep the checkpoint's base rate and step 5 would run at the old schedule's
    last value (resume_settings.py)."""
    res = launch([*ARGS, "--output_dir", str(copy), "--max_steps", "6", "--learning_rate", "1e-3",
                  "--override_resumed_settings", "true"], shared.cache)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert f"continuing {copy}/checkpoint-4 to max_steps 6 (it was trained toward 4)" in res.stdout
    assert "learning_rate 0.003 -> 0.001; the new values apply from step 5" in res.stdout
    history = json.loads((copy / "log_history.json").read_text())["log_history"]
    logged = {h["step"]: h["learning_rate"] for h in history if "loss" in h}

    def cosine(peak, total, step):  # transformers' get_cosine_schedule_with_warmup without warmup, logged after `step`
        return peak * 0.5 * (1 + math.cos(math.pi * (step - 1) / total))

    expected = {s: cosine(LR, 4, s) for s in range(1, 5)} | {s: cosine(1e-3, 6, s) for s in (5, 6)}
    assert logged == pytest.approx(expected, rel=1e-6)
    run_args = json.loads((copy / "run_args.json").read_text())
    assert run_args["resumed_with_changes"]["changed"] == {"learning_rate": [LR, 1e-3]}
    assert run_args["resumed_with_changes"]["length"] == [["max_steps", 4], ["max_steps", 6]]
    metrics = json.loads((copy / "metrics.json").read_text())
    assert metrics["status"] == "completed" and metrics["steps"] == 6
    assert metrics["resume_check"]["learning_rate_after_resume"] == pytest.approx(cosine(1e-3, 6, 5))


def test_an_unreadable_newest_checkpoint_is_named_and_the_previous_one_used(copy, monkeypatch, capsys):
    """A run that failed after checkpoint-4, whose optimizer file was cut short (a disk that filled, a copy that
    stopped): the rerun names the file, moves the checkpoint aside (kept, never resumed or overwritten) and resumes
    from checkpoint-2."""
    metrics = json.loads((copy / "metrics.json").read_text())
    (copy / "metrics.json").write_text(json.dumps({**metrics, "status": "failed"}))
    optimizer = copy / "checkpoint-4" / "optimizer.bin"
    optimizer.write_bytes(optimizer.read_bytes()[:5000])
    with pytest.raises(RanksWouldStart):
        launcher_until_ranks([*ARGS, "--output_dir", str(copy)], monkeypatch, capsys)
    out = capsys.readouterr().out
    assert (f"{copy}/checkpoint-4 cannot be read (optimizer.bin: BadZipFile: File is not a zip file); moved to "
            f"unreadable-checkpoint-4; resuming from checkpoint-2") in out
    assert (copy / "unreadable-checkpoint-4" / "optimizer.bin").stat().st_size == 5000
    assert markers.usable(copy) == (copy / "checkpoint-2", [])


def test_overwrite_output_dir_replaces_the_run(copy, shared, monkeypatch, capsys):
    """The run's files go; the user's own files in that folder stay (a run writes beside them, and the overwrite
    deleted them with it: output_dir pointed at the folder of the data), and so does the data folder this run reads
    (a folder is no user's file by its suffix: claim_output_dir names it to previous_run.clear)."""
    (copy / "iris.jsonl").write_text('{"prompt": "a", "completion": "b"}\n')
    (copy / "notes.txt").write_text("lr 1e-3 next\n")
    shutil.copytree(shared.cache / "tiny-arith", copy / "tiny-arith")
    with pytest.raises(RanksWouldStart):
        launcher_until_ranks([*ARGS, "--output_dir", str(copy), "--learning_rate", "1e-3", "--overwrite_output_dir",
                              "true", "--dataset_name", str(copy / "tiny-arith")], monkeypatch, capsys)
    out = capsys.readouterr().out
    assert f"overwrite_output_dir: removed a completed run of 4 steps from {copy}" in out
    assert "; kept 3 file(s)" in out and "iris.jsonl, notes.txt" in out, out
    assert sorted(p.name for p in copy.iterdir()) == sorted([LOCK_FILE, "iris.jsonl", "notes.txt", "tiny-arith"])


def test_a_requeued_slurm_job_keeps_its_own_run_despite_overwrite_output_dir(finished, tmp_path, monkeypatch,
                                                                            capsys):
    """slurm/common.sh requeues a preempted job, which runs the same command: with --overwrite_output_dir true in it,
    the requeue emptied the job's own preemption checkpoint and started again at step 0. The same job (id 4242) one
    restart later keeps and resumes it, and a run it had completed (Slurm's own requeue after the end) is "already
    complete"; another job, the same id at the same count (an interactive allocation's next run), or another command
    of the same job (other settings), replaces it."""
    def run_of_job_4242(name, status, recorded):
        run = shutil.copytree(finished, tmp_path / name)
        metrics = json.loads((run / "metrics.json").read_text())
        (run / "metrics.json").write_text(json.dumps({**metrics, "status": status}))
        args = json.loads((run / "run_args.json").read_text())
        args["launcher"].update(slurm_job_id="4242", slurm_restart_count=recorded)  # None: an older pack's file
        (run / "run_args.json").write_text(json.dumps(args))
        return run

    # the last case: a job script whose next command (another learning rate) writes the same folder replaces it
    cases = [("4242", "1", "preempted", 0, "kept", []), ("4242", "2", "preempted", None, "kept", []),
             ("4242", "1", "completed", 0, "complete", []), ("4243", "1", "preempted", 0, "removed", []),
             ("4242", "0", "preempted", 0, "removed", []), ("4242", "1", "preempted", 0, "removed",
                                                           ["--learning_rate", "1e-3"])]
    for i, (job, restart, status, recorded, then, other) in enumerate(cases):
        run = run_of_job_4242(f"case-{i}", status, recorded)
        before = files(run)
        monkeypatch.setenv("SLURM_JOB_ID", job)
        monkeypatch.setenv("SLURM_RESTART_COUNT", restart)
        command = [*ARGS, "--output_dir", str(run), "--overwrite_output_dir", "true", *other]
        if then == "complete":
            res = launcher_until_ranks(command, monkeypatch, capsys)
            assert res.returncode == 0 and "already complete" in res.stdout, res.stdout + res.stderr
            assert files(run) == before
            continue
        with pytest.raises(RanksWouldStart):
            launcher_until_ranks(command, monkeypatch, capsys)
        out = capsys.readouterr().out
        if then == "kept":
            assert (f"overwrite_output_dir: kept the run that Slurm job 4242 left in {run} before its requeue (the "
                    f"flag replaces what a job finds at its first start): resuming from {run / 'checkpoint-4'}") in out
            assert "removed" not in out and files(run) == before, out
        else:
            assert f"overwrite_output_dir: removed a {status} run of 4 steps from {run}" in out, out
            assert not (run / "checkpoint-4").exists() and "kept the run" not in out


def test_overwrite_keeps_the_data_and_model_this_run_reads_from_the_folder(tmp_path):
    """A .json data file (a format the pack reads, not a NOT_A_RUNS suffix), a data/ folder and the merged/ model
    this run continues from, all inside output_dir: the overwrite deleted them after the checks had read them."""
    from fsdp_recipes.checkpoint import previous_run

    out = tmp_path / "out"
    for name in ("checkpoint-2", "data", "merged"):
        (out / name).mkdir(parents=True)
    for name in ("metrics.json", "run_args.json", "train.json", "config.json", "data/train.jsonl",
                 "merged/config.json", "checkpoint-2/trainer_state.json"):
        (out / name).write_text("{}\n")
    removed = previous_run.clear(out, previous_run.read(out), keep=[str(out / "train.json"), str(out / "data"),
                                                                    str(out / "merged"), None])
    assert removed.startswith(f"removed an unfinished run from {out} (4 files and folders); kept 3"), removed
    assert sorted(p.name for p in out.iterdir()) == ["data", "merged", "train.json"]
    assert (out / "data" / "train.jsonl").is_file() and (out / "merged" / "config.json").is_file()

def test_a_second_run_in_a_busy_output_dir_is_refused_and_a_dead_runs_lock_is_taken_over(tmp_path, monkeypatch,
                                                                                           capsys):
    busy = tmp_path / "busy"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from fsdp_recipes.checkpoint.output_lock import OutputLock; "
                               "OutputLock(sys.argv[1], 'launch tiny-cpu-lora (the first run)').acquire(); "
                               "print('held', flush=True); time.sleep(120)", str(busy)],
        stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        line = one_error(launcher_checks([*ARGS, "--output_dir", str(busy)], monkeypatch, capsys))
        assert f"{busy} is in use by another run (pid {holder.pid} on " in line
        assert "launch tiny-cpu-lora (the first run)" in line and "use another --output_dir" in line
    finally:
        os.killpg(holder.pid, signal.SIGKILL)  # dies holding it: no release written
        holder.wait()
    with pytest.raises(RanksWouldStart):
        launcher_until_ranks([*ARGS, "--output_dir", str(busy)], monkeypatch, capsys)
    out = capsys.readouterr().out
    assert f"took over the lock of a run that is gone and did not record its release (pid {holder.pid} on " in out


@pytest.fixture
def small_disk(tmp_path):
    """A 16 MiB tmpfs: room for one of the tiny run's checkpoints (11 MiB), not two."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("this machine does not let the test mount a tmpfs (needs root, or CAP_SYS_ADMIN)")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_full_disk_is_one_line_and_the_rerun_resumes(small_disk, cache_dir):
    out = small_disk / "run"
    res = launch([*ARGS, "--output_dir", str(out)], cache_dir)
    lines = [line for line in res.stderr.splitlines() if line.startswith("error: ")]
    assert res.returncode == 1 and len(lines) == 1, res.stdout[-3000:] + res.stderr[-3000:]
    assert "Traceback" not in res.stdout + res.stderr
    # the errno's text, or (torch's zip writer reports no errno) the free space the launcher found
    assert "ran out of disk space" in lines[0]
    assert "No space left on device" in lines[0] or "torch could not write the file" in lines[0], lines[0]
    assert f"it resumes from {out}/checkpoint-2, which is intact" in lines[0]
    assert markers.latest_complete(out) == out / "checkpoint-2" and not markers.unreadable(out / "checkpoint-2")
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)  # space freed
    res = launch([*ARGS, "--output_dir", str(out)], cache_dir)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert f"resuming from {out}/checkpoint-2" in res.stdout
    assert json.loads((out / "metrics.json").read_text())["steps"] == 4


SAVED = {"learning_rate": 1e-3, "optim": "adamw_torch", "max_steps": 10, "num_train_epochs": 3.0, "beta": 0.1}


def test_an_optimizer_setting_never_changes_on_resume_even_with_the_override():
    from fsdp_recipes.checkpoint.resume_settings import check
    from fsdp_recipes.errors import UserError

    with pytest.raises(UserError, match=r"with optim 'adamw_torch' -> 'sgd': the checkpoint's optimizer state"):
        check("run/checkpoint-4", 4, SAVED, {**SAVED, "optim": "sgd"}, override=True)


def test_a_run_length_that_ends_before_the_checkpoint_is_refused_and_a_longer_one_reported():
    from fsdp_recipes.checkpoint.resume_settings import check
    from fsdp_recipes.errors import UserError

    with pytest.raises(UserError, match=r"it is at step 4, past max_steps 3. Fix: --max_steps 4 or more"):
        check("run/checkpoint-4", 4, SAVED, {**SAVED, "max_steps": 3}, override=True)
    assert check("run/checkpoint-4", 4, SAVED, dict(SAVED), override=False) == {}  # nothing changed: nothing to say
    assert check("run/checkpoint-4", 4, SAVED, {**SAVED, "max_steps": 20}, override=False) == {
        "checkpoint": "run/checkpoint-4", "step": 4, "length": [["max_steps", 10], ["max_steps", 20]]}


def test_a_trainer_kinds_own_setting_is_compared_like_the_learning_rate():
    from fsdp_recipes.checkpoint.resume_settings import check
    from fsdp_recipes.errors import UserError

    with pytest.raises(UserError, match=r"other settings \(beta 0.1 -> 0.5\).*--override_resumed_settings true to apply "
                                        r"the new values from step 5"):
        check("run/checkpoint-4", 4, SAVED, {**SAVED, "beta": 0.5}, override=False)
    assert check("run/checkpoint-4", 4, SAVED, {**SAVED, "beta": 0.5}, override=True)["changed"] == {"beta": [0.1, 0.5]}


def test_torchs_zip_writer_failing_on_a_full_disk_is_a_full_disk_and_elsewhere_is_not(small_disk, tmp_path):
    """torch.save's writer says "unexpected pos 64 vs 0", no errno: read as a full disk only where output_dir's file
    system is nearly full."""
    from fsdp_recipes.launch.explain_failure import describe

    (small_disk / "filler").write_bytes(bytes(8 << 20))  # 8 of its 16 MiB left: under NEARLY_FULL (1 GiB)
    record = {"rank": 1, "type": "RuntimeError", "phase": "training", "step": 3, "time": 0.0,
              "error": "[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0"}
    line, code = describe([record], 1, None, "tiny-cpu-lora", None, output_dir=str(small_disk / "run"))
    assert line.startswith("rank 1 ran out of disk space at step 3") and code == 1, line
    assert "MiB free" in line and f"df -h {small_disk}/run" in line
    line, _ = describe([record], 1, None, "tiny-cpu-lora", None, output_dir=str(tmp_path / "run"))  # plenty free
    assert line.startswith("rank 1 failed at step 3: RuntimeError") and "disk space" not in line, line


def test_a_full_disk_elsewhere_is_named_not_blamed_on_output_dir():
    """A container's small /dev/shm fills (the DataLoader's shared memory): the line names that file system, and
    does not send the user to free space where output_dir is."""
    from fsdp_recipes.launch.explain_failure import describe

    record = {"rank": 1, "type": "RuntimeError", "phase": "training", "step": 7, "time": 0.0,
              "error": "unable to write to file </torch_123_456_0>: No space left on device (28)"}
    line, code = describe([record], 1, None, "tiny-cpu-lora", "runs/x/checkpoint-5", output_dir="runs/x")
    assert line.startswith("rank 1 ran out of space writing /torch_123_456_0 at step 7") and code == 1
    assert "--shm-size" in line and "runs/x" not in line


def test_a_sampling_kinds_own_settings_are_saved_and_compared_from_its_argument_dataclass():
    """reward_funcs lives in the kind's SamplingArguments (cfg.kind_args), not in TRL's config: the checkpoint's
    settings hold it, and a resume that changes it is refused like the learning rate."""
    from types import SimpleNamespace

    from fsdp_recipes.checkpoint.resume_settings import check, current
    from fsdp_recipes.config.kind_registry import SamplingArguments
    from fsdp_recipes.errors import UserError

    training = SimpleNamespace(per_device_train_batch_size=2, gradient_accumulation_steps=1, learning_rate=1e-5)
    cfg = SimpleNamespace(training=training, script=SimpleNamespace(dataset_name="d"), trainer="rloo",
                          model=SimpleNamespace(dtype="float32"), pack=SimpleNamespace(),
                          kind_args=SamplingArguments(reward_funcs=["fsdp_recipes.rewards.exact_answer"]))
    saved = current(cfg, 2, ("reward_funcs",))
    assert saved["reward_funcs"] == ["fsdp_recipes.rewards.exact_answer"] and saved["global_batch"] == 4
    cfg.kind_args = SamplingArguments(reward_funcs=["fsdp_recipes.rewards.number_only"])
    with pytest.raises(UserError, match=r"reward_funcs \['fsdp_recipes.rewards.exact_answer'\] -> "
                                        r"\['fsdp_recipes.rewards.number_only'\]"):
        check("run/checkpoint-4", 4, saved, current(cfg, 2, ("reward_funcs",)), override=False)


def test_an_output_dir_that_is_the_model_or_holds_anothers_files_is_refused_and_left_as_it_was(tmp_path, monkeypatch,
                                                                                               capsys, cache_dir):
    """A full fine-tuning run with output_dir set to its model's folder replaced the model's weights, tokenizer and
    config without a word (and the summary then read the trained model as the base); a recipe folder or a project
    folder got the run's README.md over its own. A folder of the user's data alone is still written beside."""
    model = shutil.copytree(cache_dir / "tiny-mistral", tmp_path / "model")
    before = files(model)
    for extra in ([], ["--overwrite_output_dir", "true"]):
        line = one_error(launcher_checks([*ARGS, "--use_peft", "false", "--model_name_or_path", str(model),
                                          "--output_dir", str(model), *extra], monkeypatch, capsys))
        assert f"output_dir {model} is the folder of the model this run trains from (model_name_or_path)" in line
        assert f"Fix: a new --output_dir, e.g. {model}-trained" in line
    assert files(model) == before
    project = tmp_path / "project"
    project.mkdir()
    (project / "README.md").write_text("# my notes\n")
    (project / "train.jsonl").write_text("{}\n")
    line = one_error(launcher_checks([*ARGS, "--output_dir", str(project)], monkeypatch, capsys))
    assert f"output_dir {project} holds files that are no run's (README.md), which this run would overwrite" in line
    assert (project / "README.md").read_text() == "# my notes\n"
    (project / "README.md").unlink()  # the user's data alone: written beside, as before
    with pytest.raises(RanksWouldStart):
        launcher_until_ranks([*ARGS, "--output_dir", str(project)], monkeypatch, capsys)
    line = one_error(launcher_checks([*ARGS, "--output_dir", ""], monkeypatch, capsys))
    assert line.startswith("error: output_dir is empty. Fix: name the folder")


def test_an_explicit_resume_of_another_models_checkpoint_names_the_fix_that_applies(tmp_path):
    from fsdp_recipes.errors import UserError

    ckpt = tmp_path / "checkpoint-2"
    ckpt.mkdir()
    arch = {k: 1 for k in markers.ARCH_KEYS}
    saved = {"model": "a", "architecture": {**arch, "model_type": "mistral"}, "peft": None, "settings": {}}
    (ckpt / markers.IDENTITY).write_text(json.dumps(saved))
    now = {**saved, "architecture": {**arch, "model_type": "qwen2"}}
    with pytest.raises(UserError, match=r"another model \(model_type mistral vs qwen2\)\. Fix: point "
                                        r"--resume_from_checkpoint at a checkpoint of this model"):
        markers.check_compatible(ckpt, now, explicit=True)
    with pytest.raises(UserError, match=r"Fix: use a new output_dir, --auto_resume false"):
        markers.check_compatible(ckpt, now)  # auto_resume found it in output_dir


def test_the_files_a_run_writes_include_every_weight_and_adapter_name_a_model_folder_has():
    """The list was written by hand beside model_folders' and missed sharded .bin weights and adapter_model.bin."""
    from fsdp_recipes.checkpoint.previous_run import run_writes

    for name in ("model.safetensors", "model-00001-of-00004.safetensors", "pytorch_model.bin",
                 "pytorch_model-00002-of-00003.bin", "pytorch_model.bin.index.json", "adapter_model.bin",
                 "adapter_config.json", "README.md", "merged"):
        assert run_writes(name), name
    for name in ("train.jsonl", "notes.md", "data", "model_config.json"):
        assert not run_writes(name), name


def test_a_resume_under_another_state_dict_type_is_one_line_before_any_rank_starts(copy, tmp_path, monkeypatch,
                                                                                   capsys):
    """The run saved FULL_STATE_DICT checkpoints; the same command from a copy of the recipe whose accelerate.yaml
    says SHARDED_STATE_DICT printed four tracebacks and `CheckpointException ranks:dict_keys([0, 1])`. The ranks now
    refuse it (checkpoint/markers.py), and the launcher before they start (launch/output_dir.py)."""
    import yaml

    from conftest import REPO

    recipe = shutil.copytree(REPO / "recipes" / "tiny-cpu-lora", tmp_path / "tiny-sharded")
    acc = yaml.safe_load((recipe / "accelerate.yaml").read_text())
    acc["fsdp_config"]["fsdp_state_dict_type"] = "SHARDED_STATE_DICT"
    (recipe / "accelerate.yaml").write_text(yaml.safe_dump(acc))
    metrics = json.loads((copy / "metrics.json").read_text())
    (copy / "metrics.json").write_text(json.dumps({**metrics, "status": "preempted"}))
    line = one_error(launcher_checks([str(recipe), *ARGS[1:], "--output_dir", str(copy), "--max_steps", "6"],
                                     monkeypatch, capsys))
    assert "FULL_STATE_DICT" in line and "SHARDED_STATE_DICT" in line, line


def test_an_unfinished_run_without_a_checkpoint_is_said_to_be_replaced(copy, monkeypatch, capsys):
    """An interrupted run that saved no checkpoint, run again (here with another learning rate): it started over
    and its report replaced the old one without a word."""
    for ckpt in markers.checkpoint_dirs(copy):
        shutil.rmtree(ckpt)
    metrics = json.loads((copy / "metrics.json").read_text())
    (copy / "metrics.json").write_text(json.dumps({**metrics, "status": "interrupted", "steps": 3}))
    with pytest.raises(RanksWouldStart):
        launcher_until_ranks([*ARGS, "--output_dir", str(copy), "--learning_rate", "1e-3"], monkeypatch, capsys)
    out = capsys.readouterr().out
    assert (f"{copy} holds an unfinished run (interrupted, 3 steps) with no checkpoint this command resumes: it starts "
            "at step 0, and its report replaces that run's") in out, out
