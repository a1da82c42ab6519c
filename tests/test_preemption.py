"""Preemption and exact resume, through the real launcher and `accelerate launch` with 2 processes.

A run signalled in the middle saves a checkpoint at the next step boundary, exits with EXIT_PREEMPTED and
reports `status: preempted`; the same command run again resumes from the newest *complete* checkpoint
(skipping a half-written one) and ends with the same per-step losses, the same weights and the same
token counters as a run that was never interrupted.
"""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO, fsdp1_recipe, launch, pack_env
from fsdp_recipes.checkpoint import markers as checkpoints
from fsdp_recipes.checkpoint.save_check import LIVE_SHARDS, SAVED_COPY, read_saved
from fsdp_recipes.errors import EXIT_INTERRUPTED, EXIT_PREEMPTED
from fsdp_recipes.metrics.run_report import COUNTERS_FILE

# logging_steps 1: each logged loss is one step's loss. With longer intervals the first log after a resume
# averages fewer steps than the uninterrupted run's (the Trainer does not checkpoint its running loss sum).
PROBES = REPO / "tests" / "probes"
ARGS = ["tiny-cpu-lora", "--max_steps", "16", "--save_strategy", "steps", "--save_steps", "5",
        "--logging_steps", "1", "--eval_strategy", "no", "--save_merged_model", "false"]


def signal_launch(args, cache_dir, ready, sig, settle=0.0, **env):
    """Start the launcher, wait until `ready()` holds, send `sig` to it, and wait for it to end."""
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen([sys.executable, "-m", "fsdp_recipes.launch.launcher", *map(str, args)], cwd=REPO,
                            env=pack_env(cache_dir, **env), stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 300
    while not ready():
        if proc.poll() is not None or time.time() > deadline:
            log.seek(0)
            pytest.fail(log.read()[-3000:])
        time.sleep(0.2)
    time.sleep(settle)  # a few steps in
    proc.send_signal(sig)  # to the launcher, as a scheduler would
    signalled = time.time()
    proc.wait(timeout=300)
    log.seek(0)
    out = log.read()
    signal_launch.seconds_after_signal = time.time() - signalled
    return proc.returncode, out


def losses(run):
    history = json.loads((run / "log_history.json").read_text())["log_history"]
    return {h["step"]: h["loss"] for h in history if "loss" in h}


def assert_a_plain_full_model(out, fsdp):
    """The uninterrupted full fine-tune's final save: every weight trained, saved as a plain model directory (no
    FSDP, no flat parameters, no adapter) and checked; with FSDP2 against the live shards, with FSDP1 as a round
    trip of the gathered state dict (all it can do), after checking the weights rank 1 received by broadcast."""
    from transformers import AutoModelForCausalLM

    m = json.loads((out / "metrics.json").read_text())
    if fsdp == "fsdp2":
        assert m["final_save_check"] == {"tensors": 39, "lora_b_checked": 0, "model_shapes_checked": 39,
                                      "compared_with": LIVE_SHARDS}  # every weight of the 3M model
        assert m["params"]["trainable"] == m["params"]["total"] and m["param_shards"]["dtensor_params"] == 39
    else:
        assert m["fsdp_version"] == 1 and m["sharding_strategy"] == "FULL_SHARD" and m["world_size"] == 2
        assert m["load_check"] == {"parameters_checked": 39}  # sync_module_states' broadcast equals the file
        assert m["final_save_check"] == {"tensors": 39, "lora_b_checked": 0, "model_shapes_checked": 0,
                                      "compared_with": SAVED_COPY}
    assert not (out / "adapter_config.json").exists()
    model = AutoModelForCausalLM.from_pretrained(out)
    base = AutoModelForCausalLM.from_pretrained(json.loads((out / "run_args.json").read_text())
                                                ["model_args"]["model_name_or_path"])
    changed = [n for (n, p), (_, q) in zip(model.named_parameters(), base.named_parameters()) if not torch.equal(p, q)]
    assert len(changed) == 39  # every tensor was trained and saved unsharded


def assert_resumed_exactly(straight, resumed, first, steps: int = 16):
    """The resumed run ends where the uninterrupted one does: the same per-step losses (`steps` of them), the same
    final weights, the same token and sample counts; its training time goes on from the checkpoint's (`first`: the
    preempted report)."""
    a, b = losses(straight), losses(resumed)
    assert sorted(a) == sorted(b) == list(range(1, steps + 1))
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-4, abs=1e-5), (step, a[step], b[step])
    wa, wb = read_saved(straight), read_saved(resumed)  # the adapter, or the whole model
    assert wa.keys() == wb.keys()
    for key in wa:
        assert torch.allclose(wa[key], wb[key], atol=1e-5), key

    done, straight_m = (json.loads((run / "metrics.json").read_text()) for run in (resumed, straight))
    assert done["steps"] == straight_m["steps"] == steps
    assert done["tokens"]["non_padding"] == straight_m["tokens"]["non_padding"]
    assert done["samples"] == straight_m["samples"]
    assert done["train_time_s"] > first["train_time_s"]  # time continues from the checkpoint


def resumed_from_its_checkpoint(args, straight, out, cache_dir, step: int, **env) -> dict:
    """The same command with `--resume_from_checkpoint <straight>/checkpoint-<step>` into a new output_dir: the
    checkpoint the uninterrupted run saved on its way, resumed as a preempted run's own is (the signal, the save at
    the step where the ranks stopped and the skipped half-written checkpoint: test_preempted_run_resumes_exactly and
    the grace-period test). One launch instead of two: a preemption's checkpoint is the same Trainer save. Returns
    the counters the checkpoint holds, which the resumed run continues from."""
    ckpt = straight / f"checkpoint-{step}"
    assert checkpoints.is_complete(ckpt), sorted(p.name for p in straight.iterdir())
    res = launch([*args, "--output_dir", str(out), "--resume_from_checkpoint", str(ckpt)], cache_dir, **env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    done = json.loads((out / "metrics.json").read_text())
    assert done["status"] == "completed" and done["resumed_from"] == str(ckpt), done
    return json.loads((ckpt / COUNTERS_FILE).read_text())


FULL = ["--use_peft", "false", "--learning_rate", "1e-3"]


@pytest.mark.slow
@pytest.mark.parametrize("method, fsdp", [(FULL, "fsdp2"), (FULL, "fsdp1")], ids=["full-fsdp2", "full-fsdp1"])
def test_preempted_run_resumes_exactly(tmp_path, cache_dir, method, fsdp):
    """Resumed from the preemption's own checkpoint. Under FSDP2 the scheduler sends SIGTERM; under FSDP1 SIGUSR1,
    Slurm's `--signal=USR1@<grace>`, which the launcher and torchrun pass on to the ranks in the same way. (LoRA under
    FSDP2, the default's setting: the grace-period test below resumes it exactly from an earlier checkpoint, and
    tests/test_slurm.py preempts, requeues and resumes it; LoRA under FSDP1: the next test.)"""
    straight, preempted = tmp_path / "straight", tmp_path / "preempted"
    sig = signal.SIGTERM if fsdp == "fsdp2" else signal.SIGUSR1
    recipe = ARGS[0] if fsdp == "fsdp2" else str(fsdp1_recipe(tmp_path))  # FSDP1: the seeds' settings
    # FSDP1 full fine-tuning also checks what rank 1 received by broadcast (a check only: the numbers are the same)
    verify = ["--verify_loaded_weights", "true"] if method and fsdp == "fsdp1" else []
    args = [recipe, *ARGS[1:], *method, *verify]

    res = launch([*args, "--output_dir", str(straight)], cache_dir)
    assert res.returncode == 0, res.stderr[-3000:]
    if method:
        assert_a_plain_full_model(straight, fsdp)

    rc, out = signal_launch([*args, "--output_dir", str(preempted)], cache_dir,
                            lambda: checkpoints.is_complete(preempted / "checkpoint-5"), sig)
    assert rc == EXIT_PREEMPTED, out[-3000:]
    first = json.loads((preempted / "metrics.json").read_text())
    assert first["status"] == "preempted" and 5 <= first["steps"] < 16, first
    assert first["error"].endswith(f"{int(sig)})"), first["error"]  # the signal the ranks received
    stop = checkpoints.latest_complete(preempted)
    assert stop.name == f"checkpoint-{first['steps']}"  # saved at the step where the ranks stopped

    # a save killed half-way leaves a newer, incomplete checkpoint: it must be skipped
    partial = preempted / "checkpoint-15"
    partial.mkdir()
    (partial / "optimizer.bin").write_bytes(b"truncated")

    res = launch([*args, "--output_dir", str(preempted)], cache_dir)  # the same command again
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert f"skipping {partial}: incomplete" in res.stdout
    if verify:  # the check compares with model_name_or_path's file, which a resumed full fine-tune no longer holds
        assert "verify_loaded_weights: skipped, this run resumes full fine-tuning" in res.stdout, res.stdout[-3000:]
    done = json.loads((preempted / "metrics.json").read_text())
    assert done["status"] == "completed" and done["resumed_from"] == str(stop)
    assert_resumed_exactly(straight, preempted, first)


@pytest.mark.slow
def test_lora_under_fsdp1_resumes_exactly_from_a_checkpoint(tmp_path, cache_dir):
    """LoRA under FSDP1 (the seeds' settings): an uninterrupted run, then the same command resumed from the checkpoint
    it saved at step 5, to the same losses, adapter and counters. FSDP1's signal path: the full fine-tune above."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    args = [str(fsdp1_recipe(tmp_path)), *ARGS[1:], "--save_total_limit", "4"]  # checkpoint-5 kept
    res = launch([*args, "--output_dir", str(straight)], cache_dir)
    assert res.returncode == 0, res.stderr[-3000:]
    first = resumed_from_its_checkpoint(args, straight, resumed, cache_dir, step=5)
    assert_resumed_exactly(straight, resumed, first)


@pytest.mark.slow
def test_dpo_full_fine_tuning_preempted_resumes_exactly(tmp_path, cache_dir):
    """DPO resumes exactly: qwen3-8b-full-dpo's smoke run (a tiny Qwen3, full fine-tuning, the reference model a
    second copy sharded like the policy, synthetic preference pairs) run straight, then
    the same command resumed from the checkpoint it saved at step 5. This is also that recipe's smoke test
    (tests/test_smoke.py leaves it to this one). bf16 off: the comparison is exact in float32."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    args = ["qwen3-8b-full-dpo", *ARGS[1:], "--bf16", "false", "--save_total_limit", "4"]  # checkpoint-5 kept
    res = launch([*args, "--output_dir", str(straight)], cache_dir, FSDP_RECIPES_SMOKE="1")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    m = json.loads((straight / "metrics.json").read_text())
    assert m["trainer"] == "dpo" and m["params"]["trainable"] == m["params"]["total"]  # full fine-tuning
    assert m["sharding_strategy"] == "FULL_SHARD" and m["param_shards"]["dtensor_params"] > 0
    assert m["dpo"]["rewards/margins"]["last"] is not None

    first = resumed_from_its_checkpoint(args, straight, resumed, cache_dir, step=5, FSDP_RECIPES_SMOKE="1")
    assert_resumed_exactly(straight, resumed, first)
    a, b = (json.loads((r / "metrics.json").read_text())["dpo"] for r in (straight, resumed))
    assert b["rewards/margins"]["last"] == pytest.approx(a["rewards/margins"]["last"], rel=1e-3, abs=1e-5)


@pytest.mark.slow
def test_kto_preempted_resumes_exactly(tmp_path, cache_dir):
    """KTO resumes exactly: llama-3.1-8b-lora-kto's smoke run (a tiny Llama, LoRA, the reference the policy with its
    adapter disabled, the synthetic pairs read as alternating labelled rows) run straight, then the same command
    resumed from the checkpoint it saved at step 3. This is also that recipe's smoke test (tests/test_smoke.py leaves
    it to this one)."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    args = ["llama-3.1-8b-lora-kto", "--max_steps", "8", "--save_strategy", "steps", "--save_steps", "3",
            "--logging_steps", "1", "--save_merged_model", "false", "--per_device_train_batch_size", "2",
            "--gradient_accumulation_steps", "1", "--learning_rate", "1e-3", "--save_total_limit", "3"]
    res = launch([*args, "--output_dir", str(straight)], cache_dir, FSDP_RECIPES_SMOKE="1")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    m = json.loads((straight / "metrics.json").read_text())
    assert m["trainer"] == "kto" and m["sharding_strategy"] == "FULL_SHARD" and m["param_shards"]["dtensor_params"] > 0
    assert m["kto"]["kl"]["last"] is not None and m["final_save_check"]["lora_b_checked"] > 0
    first = resumed_from_its_checkpoint(args, straight, resumed, cache_dir, step=3, FSDP_RECIPES_SMOKE="1")
    assert_resumed_exactly(straight, resumed, first, steps=8)
    a, b = (json.loads((r / "metrics.json").read_text())["kto"] for r in (straight, resumed))
    assert b["rewards/margins"]["last"] == pytest.approx(a["rewards/margins"]["last"], rel=1e-3, abs=1e-5)


@pytest.mark.slow
def test_grace_period_bounds_a_slow_save_and_the_relaunch_resumes_exactly(tmp_path, cache_dir):
    """LoRA under FSDP2 (the default's setting), with a preemption save slower than preemption_grace_s: torchrun kills
    the ranks when the grace ends, the half-written checkpoint has no completion marker, the launcher still exits 75
    with a report that says so, and the same command resumes from the previous complete checkpoint to the
    uninterrupted run's losses and weights."""
    straight, out = tmp_path / "straight", tmp_path / "run"
    args = [*ARGS, "--preemption_grace_s", "3"]
    res = launch([*args, "--output_dir", str(straight)], cache_dir)
    assert res.returncode == 0, res.stderr[-3000:]

    probe = dict(PYTHONPATH=f"{PROBES}:{os.environ.get('PYTHONPATH', '')}", SLOW_SAVE_S="120",
                 SLOW_SAVE_AFTER_STEP="5")  # every save after checkpoint-5 sleeps 120 s (tests/probes)
    rc, text = signal_launch([*args, "--output_dir", str(out)], cache_dir,
                             lambda: checkpoints.is_complete(out / "checkpoint-5"), signal.SIGTERM, **probe)
    assert rc == EXIT_PREEMPTED, text[-3000:]
    assert signal_launch.seconds_after_signal < 60, text[-3000:]  # the grace period ended the 120 s save
    print(f"launcher returned {signal_launch.seconds_after_signal:.1f} s after SIGTERM (grace 3 s, save 120 s)")
    assert "did not finish within the grace period (3 s)" in text
    first = json.loads((out / "metrics.json").read_text())
    assert first["status"] == "preempted" and first["provisional"] is False, first
    assert f"resumes from {out / 'checkpoint-5'}" in first["error"]
    half = checkpoints.incomplete(out)
    assert len(half) == 1 and int(half[0].name.split("-")[1]) > 5, half  # written in part, never marked

    res = launch([*args, "--output_dir", str(out)], cache_dir)  # the same command, without the slow save
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert f"skipping {half[0]}: incomplete" in res.stdout
    done = json.loads((out / "metrics.json").read_text())
    assert done["status"] == "completed" and done["resumed_from"] == str(out / "checkpoint-5")
    assert_resumed_exactly(straight, out, first)


@pytest.mark.filterwarnings("ignore::FutureWarning")  # TRL's SFTConfig: gradient_checkpointing's new name
def test_a_run_resumed_at_its_last_step_trains_no_step_past_it(tmp_path, cache_dir):
    """The relaunch of a run preempted at its last step (a signal during step N-1 or N: the ranks stop one step later,
    save checkpoint-N and exit 75) resumes from checkpoint-N with N == max_steps. The Trainer checks max_steps only
    after a step, so in the middle of an epoch it trained step N+1 (`[train] step 5/4`, measured through the
    launcher under FSDP2 and under tp, 2026-11-29); the pack's trainer trains none (patches/resume_at_end.py). In
    process, the pack's SFT trainer on one process: 12 rows, 2 a step, max_steps 3."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig

    from fsdp_recipes.patches import guard
    from fsdp_recipes.train.build import make_trainer_class

    model_dir = cache_dir / "tiny-mistral"
    rows = Dataset.from_dict({"input_ids": torch.randint(4, 268, (12, 16), generator=torch.Generator().manual_seed(0))
                              .tolist()})

    def trainer():
        config = SFTConfig(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2, max_length=16,
                           learning_rate=1e-2, lr_scheduler_type="constant", logging_steps=1, save_steps=100,
                           report_to=[], use_cpu=True, disable_tqdm=True)
        return make_trainer_class("sft")(model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                                         args=config, train_dataset=rows,
                                         processing_class=AutoTokenizer.from_pretrained(model_dir))

    first = trainer()
    first.train()  # the Trainer saves checkpoint-3 at max_steps
    relaunched = trainer()
    relaunched.train(resume_from_checkpoint=str(tmp_path / "checkpoint-3"))
    assert relaunched.state.global_step == 3
    assert [h["step"] for h in relaunched.state.log_history if "loss" in h] == [1, 2, 3]
    assert [p.name for p in checkpoints.checkpoint_dirs(tmp_path)] == ["checkpoint-3"]
    for (name, p), q in zip(first.model.named_parameters(), relaunched.model.parameters()):
        assert torch.equal(p, q), name  # the checkpoint's weights (a constant rate: a 4th step would move them)
    assert "resume_at_end.no_step_past_max_steps" in [p["patch"] for p in guard.APPLIED]


def test_latest_complete_skips_unmarked(tmp_path):
    for step, complete in ((10, True), (20, True), (30, False)):
        d = tmp_path / f"checkpoint-{step}"
        d.mkdir()
        if complete:
            (d / checkpoints.MARKER).write_text(str(step))
    (tmp_path / "checkpoint-x").mkdir()  # not a checkpoint
    assert checkpoints.latest_complete(tmp_path) == tmp_path / "checkpoint-20"
    assert checkpoints.incomplete(tmp_path) == [tmp_path / "checkpoint-30"]
    assert checkpoints.latest_complete(tmp_path / "missing") is None


@pytest.mark.slow
def test_ctrl_c_saves_a_checkpoint_first_and_the_same_command_resumes(tmp_path, cache_dir):
    """The first Ctrl-C stops the ranks as a preemption does (it stopped them at once: a run that saved no
    checkpoint started again at step 0, where SIGTERM would have kept its progress)."""
    out = tmp_path / "run"
    rc, out_text = signal_launch(["tiny-cpu-lora", "--max_steps", "100000", "--eval_strategy", "no", "--output_dir",
                                  str(out)], cache_dir, (out / "run_args.json").exists, signal.SIGINT, settle=2)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["status"] == "preempted" and not metrics.get("provisional"), out_text[-3000:]
    assert metrics["tokens"]["scope"] == "all_ranks" and metrics["tokens"]["non_padding"] > 0  # a whole report
    assert rc == EXIT_INTERRUPTED and "error:" not in out_text, out_text[-3000:]  # Ctrl-C is no failure
    assert "[launch] Ctrl-C: the ranks save a checkpoint at the end of this step, then stop" in out_text
    last = checkpoints.usable(out)[0]
    assert last is not None and "interrupted (Ctrl-C): the ranks saved a checkpoint first" in out_text
    assert f"resumes from {last}" in out_text, out_text[-3000:]


def launcher_with_fake_ranks(argv, out: Path, report: dict, ended: tuple, monkeypatch, interrupted=False) -> int:
    """`launcher.main(argv)` in process, the ranks' part replaced: once released they leave `report` as
    out/metrics.json (and a complete checkpoint of its steps when it says preempted), and torchrun ends with `ended`
    (exit code, the preemption signal passed on); `interrupted`: the launcher itself received Ctrl-C. The
    environment the launcher sets (torchrun's PET_* and the like) is restored afterwards."""
    import shutil

    from fsdp_recipes.launch import launcher

    class FakeRanks:
        log_failure = None  # the logs were written
        killed = False  # no second Ctrl-C

        def __init__(self, cmd, torchrun_logs, gated=True):
            self.torchrun_logs, self.interrupted = torchrun_logs, interrupted

        def release(self, log_dir):
            out.mkdir(parents=True, exist_ok=True)
            if report["status"] == "preempted":
                (out / f"checkpoint-{report['steps']}").mkdir()
            (out / "metrics.json").write_text(json.dumps(report))

        def wait(self):
            shutil.rmtree(self.torchrun_logs, ignore_errors=True)
            return ended

    monkeypatch.chdir(REPO)
    monkeypatch.setattr(launcher, "Ranks", FakeRanks)
    saved = dict(os.environ)
    try:
        return launcher.main(argv)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def ctrl_c_ending(report: dict, torchrun_rc: int, tmp_path, monkeypatch, capsys) -> tuple[Path, str]:
    """The launcher's ending after Ctrl-C reached it, the ranks having left `report`: (output_dir, its output)."""
    out = tmp_path / "run"
    rc = launcher_with_fake_ranks(["tiny-cpu-lora", "--output_dir", str(out), "--max_steps", "100"], out, report,
                                  (torchrun_rc, None), monkeypatch, interrupted=True)
    text = capsys.readouterr().out
    assert rc == EXIT_INTERRUPTED, text[-2000:]
    return out, text


def test_ctrl_c_passed_on_as_sigterm_is_still_an_interruption(tmp_path, monkeypatch, capsys):
    """The first Ctrl-C reaches the ranks as SIGTERM (Ranks._on_signal): they save a checkpoint and report
    `preempted`, torchrun exits non-zero, and no SIGTERM or SIGUSR1 reached the launcher: an interruption (130), not
    a preemption (75), said with what the same command does."""
    report = {"status": "preempted", "provisional": False, "recipe": "tiny-cpu-lora", "steps": 8,
              "error": "stopped by a signal (rank 0 saw: 15)"}
    out, text = ctrl_c_ending(report, 1, tmp_path, monkeypatch, capsys)
    assert "interrupted (Ctrl-C): the ranks saved a checkpoint first (stopped by a signal (rank 0 saw: 15)); " \
           in text  # then what the same command does (ending.resumes_from)
    assert "preempted:" not in text
    assert json.loads((out / "metrics.json").read_text()) == report  # what the ranks did, as they reported it


def test_ctrl_c_twice_stops_at_once_and_says_nothing_was_saved(tmp_path, monkeypatch, capsys):
    report = {"status": "interrupted", "provisional": False, "recipe": "tiny-cpu-lora", "steps": 8,
              "error": "KeyboardInterrupt"}
    _, text = ctrl_c_ending(report, 130, tmp_path, monkeypatch, capsys)
    assert "interrupted (Ctrl-C): the ranks stopped at once, with no checkpoint saved on the way out; no complete " \
           "checkpoint in" in text, text[-2000:]  # a fake's Ranks: neither killed nor a save past its grace


def test_the_first_ctrl_c_reaches_the_ranks_as_sigterm_and_the_second_kills_them(tmp_path):
    """In-process: a child that records the signals it gets stands in for `accelerate launch`, released. Passed on,
    a second Ctrl-C made torchrun wait out its grace period once more (its agent shuts down with SIGTERM again)."""
    from fsdp_recipes.launch import ranks as ranks_module

    seen = tmp_path / "seen"
    child = ("import signal, sys, time\n"
             "for s in (signal.SIGTERM, signal.SIGINT):\n"
             f"    signal.signal(s, lambda n, _: open({str(seen)!r}, 'a').write(signal.Signals(n).name + ' '))\n"
             f"open({str(seen)!r}, 'w').close()\n"
             "time.sleep(60)\n")

    def wait_for(words: int) -> list[str]:
        deadline = time.time() + 60
        while not (seen.exists() and len(seen.read_text().split()) >= words) and time.time() < deadline:
            time.sleep(0.1)
        return seen.read_text().split()

    ranks = ranks_module.Ranks([sys.executable, "-c", child], tmp_path / "torchrun", gated=False)
    try:
        ranks.release(None)
        assert wait_for(0) == []  # its handlers are in
        os.kill(os.getpid(), signal.SIGINT)
        assert wait_for(1) == ["SIGTERM"] and ranks.interrupted and ranks.preempted_by is None
        os.kill(os.getpid(), signal.SIGINT)
        assert ranks.proc.wait(timeout=30) == -signal.SIGKILL and ranks.killed
        assert seen.read_text().split() == ["SIGTERM"]
    finally:
        if ranks.proc.poll() is None:
            ranks.proc.kill()
        ranks.wait()


def test_a_signal_after_the_final_report_leaves_a_completed_run_completed(tmp_path, cache_dir, monkeypatch, capsys):
    """Found by bench/first_contact.py's CPU dry run: a 12-step run ended in 0.7 s, the SIGTERM reached torchrun after
    the ranks' final report, torchrun exited non-zero for its own signal, and the launcher called the completed run
    preempted with "no complete checkpoint": a requeued job would have started over on top of its finished outputs.
    In process: the ranks' part replaced by a final `completed` report, then torchrun's exit after SIGTERM."""
    from fsdp_recipes.launch import ending, launcher

    out = tmp_path / "run"
    final = {"status": "completed", "provisional": False, "recipe": "tiny-cpu-lora", "steps": 12}
    summaries = []
    monkeypatch.setattr(ending.summary, "main", lambda argv: summaries.append(argv) or 0)
    # torchrun's exit code after it handled SIGTERM, and the signal passed on
    rc = launcher_with_fake_ranks(["tiny-cpu-lora", "--output_dir", str(out), "--max_steps", "12"], out, final,
                                  (1, signal.SIGTERM), monkeypatch)
    text = capsys.readouterr().out
    assert rc == 0, text[-2000:]
    assert "SIGTERM arrived after training completed" in text and "nothing to resume" in text
    assert json.loads((out / "metrics.json").read_text()) == final  # not rewritten as preempted
    assert summaries == []  # the node is going away: no generations


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_sampling_kinds_preempted_resume_exactly_with_the_same_samples(tmp_path, cache_dir, kind):
    """GRPO and RLOO sample their training data: an exact resume needs each rank's generators restored from the
    checkpoint, so that the resumed run samples the completions the uninterrupted one did. llama-3.1-8b-lora-<kind>'s
    smoke run (a tiny Llama, LoRA, FSDP2, sampled with the policy's generate at temperature 1) run straight, then
    resumed from the checkpoint it saved at step 3: the same reward, loss and sampled-token count at every step, the
    same adapter. This is also that recipe's smoke test (tests/test_smoke.py leaves it to this one). One micro-batch
    per step keeps it short."""
    straight, preempted = tmp_path / "straight", tmp_path / "resumed"
    args = [f"llama-3.1-8b-lora-{kind}", "--max_steps", "8", "--save_strategy", "steps", "--save_steps", "3",
            "--logging_steps", "1", "--gradient_accumulation_steps", "1", "--steps_per_generation", "1",
            "--save_merged_model", "false", "--save_total_limit", "3"]
    res = launch([*args, "--output_dir", str(straight)], cache_dir, FSDP_RECIPES_SMOKE="1")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert f"[train] {kind}: 2 completions of at most 4 tokens per prompt" in res.stdout

    resumed_from_its_checkpoint(args, straight, preempted, cache_dir, step=3, FSDP_RECIPES_SMOKE="1")

    def per_step(run):
        history = json.loads((run / "log_history.json").read_text())["log_history"]
        return {h["step"]: (h["reward"], h["loss"], h["completions/mean_length"]) for h in history if "loss" in h}

    a, b = per_step(straight), per_step(preempted)
    assert sorted(a) == sorted(b) == list(range(1, 9))
    assert len({r for r, _, _ in a.values()}) > 1  # the rewards vary: there is something to get wrong
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-4, abs=1e-6), (step, a[step], b[step])
    wa, wb = read_saved(straight), read_saved(preempted)
    assert wa.keys() == wb.keys() and all(torch.allclose(wa[k], wb[k], atol=1e-6) for k in wa)
    done, straight_m = (json.loads((run / "metrics.json").read_text()) for run in (preempted, straight))
    assert done["generated_tokens"] == straight_m["generated_tokens"] > 0
    # 8 steps x 2 processes x 8 completions, each at most 4 sampled tokens
    assert done["samples"] == straight_m["samples"] == 8 * 2 * 8 and done["generated_tokens"] <= 8 * 2 * 8 * 4
    assert done["final_save_check"]["lora_b_checked"] > 0
