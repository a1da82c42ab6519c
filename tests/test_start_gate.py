"""The launcher starts the ranks while it checks the recipe; they wait at a gate (start_gate.py) and touch nothing
until the checks pass. A failed or interrupted check kills them all and is still one line."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import psutil
import pytest

import fork_server
from conftest import REPO, SHORT_TINY_RUN, pack_env, publishing_shared_run
from fsdp_recipes.checkpoint.output_lock import LOCK_FILE
from fsdp_recipes.errors import EXIT_PREEMPTED
from fsdp_recipes.train import start_gate

PROBES = REPO / "tests" / "probes"
WAITER = "from fsdp_recipes.train import start_gate; start_gate.wait(poll_s=0.01); print('passed', flush=True)"


def waiter(gate_env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", WAITER], env={**os.environ, **gate_env}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_no_gate_without_the_launcher(monkeypatch):
    monkeypatch.delenv(start_gate.FILE_ENV, raising=False)
    assert start_gate.wait() == 0.0


def test_a_rank_waits_until_the_gate_opens():
    gate = start_gate.Gate()
    try:
        proc = waiter(gate.env())
        time.sleep(1.5)
        assert proc.poll() is None, proc.communicate()
        gate.open()
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0 and out.strip() == "passed", err
    finally:
        gate.remove()


def test_an_aborted_gate_ends_the_rank_quietly():
    gate = start_gate.Gate()
    try:
        proc = waiter(gate.env())
        gate.abort()
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 1 and out == "" and err == ""
    finally:
        gate.remove()


def test_a_rank_does_not_wait_for_a_launcher_that_is_gone():
    gate = start_gate.Gate()
    gone = subprocess.Popen(["true"])
    gone.wait()
    try:
        proc = waiter({**gate.env(), start_gate.PID_ENV: str(gone.pid)})
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 1 and out == ""
        assert "the launcher exited before its checks finished" in err, err
    finally:
        gate.remove()


class SlowCheckLaunch:
    """The launcher with its recipe checks made SLOW_CHECK_S longer (tests/probes), its output read line by line,
    and every process it started remembered. Fresh processes, not the fork server's: the test watches the
    launcher's process tree and the ranks' imports settle at the gate."""

    def __init__(self, args, cache_dir, slow_s=20):
        self.release_file = Path(cache_dir).parent / f"release-{uuid.uuid4().hex}"  # release(): the checks go on
        env = pack_env(cache_dir, PYTHONPATH=f"{PROBES}:{os.environ.get('PYTHONPATH', '')}", SLOW_CHECK_S=str(slow_s),
                       SLOW_CHECK_RELEASE=str(self.release_file), **fork_server.FRESH)
        self.proc = subprocess.Popen([sys.executable, "-m", "fsdp_recipes.launch.launcher", *args], cwd=REPO, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.out, self.err, self.started = [], [], set()
        self.readers = [threading.Thread(target=lambda s=s, d=d: d.extend(s), daemon=True)
                        for s, d in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))]
        for t in self.readers:
            t.start()

    def ranks(self) -> list[psutil.Process]:
        found = []
        for child in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                self.started.add(child)
                cmd = child.cmdline()
            except psutil.Error:
                continue
            if "fsdp_recipes.train.entry" in cmd and "launch" not in cmd:
                found.append(child)
        return found

    def wait_for_ranks_at_the_gate(self, n=2, timeout=120):
        """Until n ranks exist and have imported the training stack (their CPU time stops growing)."""
        deadline = time.time() + timeout
        while len(self.ranks()) < n:
            assert self.proc.poll() is None and time.time() < deadline, "".join(self.out + self.err)
            time.sleep(0.2)
        cpu = lambda: sum(sum(p.cpu_times()[:2]) for p in self.ranks())  # noqa: E731
        before = cpu()
        while True:  # importing costs seconds of CPU; waiting at the gate polls a file every 20 ms
            time.sleep(1.0)
            now = cpu()
            if now - before < 0.2:
                return
            before = now
            assert time.time() < deadline, "the ranks never settled at the gate"

    def release(self) -> None:
        """End the slowed check now rather than after slow_s: the test has seen the ranks wait."""
        self.release_file.touch()

    def finish(self, timeout=300) -> int:
        rc = self.proc.wait(timeout=timeout)
        for t in self.readers:
            t.join()
        return rc

    def leftovers(self) -> list:
        alive = []
        for p in self.started:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except psutil.NoSuchProcess:
                pass
        return alive


@pytest.mark.slow
def test_ranks_wait_at_the_gate_and_run_once_the_checks_pass(tmp_path, cache_dir):
    """The run it watches is tests/test_output_dir.py's finished one (conftest.SHORT_TINY_RUN, 4 short steps): it
    publishes it for that file's tests (conftest.publishing_shared_run) unless that file made it first."""
    with publishing_shared_run(SHORT_TINY_RUN, cache_dir, own=tmp_path / "run") as out:
        run = SlowCheckLaunch([*SHORT_TINY_RUN, "--output_dir", str(out)], cache_dir, slow_s=20)
        run.wait_for_ranks_at_the_gate()
        assert run.proc.poll() is None, "".join(run.out + run.err)
        # the launcher locks the folder before it starts the ranks (issue 42: a busy folder is one line at once)
        assert [p.name for p in out.iterdir()] == [LOCK_FILE], "a rank wrote before the checks passed"
        assert not any("[train]" in line for line in run.out), run.out  # their output is held back
        run.release()
        assert run.finish() == 0, "".join(run.out[-40:] + run.err[-40:])
        text = "".join(run.out)
        assert text.index("they wait at a gate") < text.index("checks passed in") < text.index("run report written")
        assert (out / "metrics.json").is_file()


@pytest.mark.slow
def test_a_failed_check_kills_the_waiting_ranks_and_is_one_line(tmp_path, cache_dir):
    out = tmp_path / "run"
    # a value only the built configs can check (the LoRA settings): a missing dataset, a busy folder and a value the
    # remembered fields can check (config/yaml_keys.py) are refused before any rank starts
    run = SlowCheckLaunch(["tiny-cpu-lora", "--lora_r", "0", "--output_dir", str(out)], cache_dir, slow_s=15)
    run.wait_for_ranks_at_the_gate()
    run.release()
    assert run.finish(timeout=120) == 2
    errors = [line for line in run.err if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("error: lora_r is 0"), run.err
    assert run.started and not run.leftovers(), run.leftovers()
    assert not out.exists()


@pytest.mark.slow
def test_sigterm_while_checking_stops_everything_with_the_preemption_code(tmp_path, cache_dir):
    out = tmp_path / "run"
    run = SlowCheckLaunch(["tiny-cpu-lora", "--output_dir", str(out)], cache_dir, slow_s=60)
    run.wait_for_ranks_at_the_gate()
    run.proc.send_signal(signal.SIGTERM)  # as a scheduler would, to the launcher
    t = time.time()
    assert run.finish(timeout=60) == EXIT_PREEMPTED, "".join(run.out + run.err)
    assert time.time() - t < 10
    assert "SIGTERM before the checks finished: nothing had started" in "".join(run.out)
    assert "Traceback" not in "".join(run.err), run.err
    assert run.started and not run.leftovers(), run.leftovers()
    assert not out.exists()


@pytest.mark.slow
def test_a_rank_crashing_after_a_completed_run_is_reported_as_such(tmp_path, cache_dir):
    """A rank that aborts in interpreter teardown, after the run completed (tests/probes: ABORT_AT_EXIT_RANK): the
    exit code stays non-zero, and the launcher says that the outputs are complete."""
    from conftest import run

    out = tmp_path / "run"
    res = run([sys.executable, "-m", "fsdp_recipes.launch.launcher", "tiny-cpu-lora", "--max_steps", "1", "--eval_strategy",
               "no", "--save_merged_model", "false", "--output_dir", str(out)], cache_dir,
              PYTHONPATH=f"{PROBES}:{os.environ.get('PYTHONPATH', '')}", ABORT_AT_EXIT_RANK="1")
    assert res.returncode != 0, res.stdout[-2000:]
    assert "training completed and its run report" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]
    assert f"the outputs in {out} are complete" in res.stdout
    assert json.loads((out / "metrics.json").read_text())["status"] == "completed"


def test_a_finished_runs_trainer_lives_until_the_process_exits(monkeypatch):
    """entry.run keeps the trainer of a finished run referenced: freeing its DDP reducer (and so the gloo process
    group, which joins gloo's threads) once hung a rank after a completed run; the exit frees nothing (below)."""
    import weakref

    from fsdp_recipes.train import entry

    class Trainer:
        ended = False

        def end(self):
            self.ended = True

    refs = []

    def train_once(argv):  # the run's trainer, referenced only by what run() does with it
        trainer = Trainer()
        refs.append(weakref.ref(trainer))
        return 0, trainer

    monkeypatch.setattr(entry, "train_once", train_once)
    monkeypatch.setattr(entry, "ENDED", [])
    assert entry.run([]) == 0
    (ref,) = refs
    assert ref() is not None and ref().ended and entry.ENDED == [ref()]


def test_a_rank_exits_after_its_atexit_handlers_without_interpreter_teardown():
    """entry's exit: what atexit holds still runs (logging, trackers, the probes above); the finalization that
    frees the leftovers, where the teardown crash happens, does not."""
    code = ("import atexit, sys\n"
            "from fsdp_recipes.train.entry import exit_without_teardown\n"
            "class Leftover:\n"
            "    def __del__(self):\n"
            "        print('finalized', flush=True)\n"
            "kept = Leftover()\n"
            "atexit.register(print, 'atexit ran')\n"
            "print('buffered, not flushed', end='')\n"
            "exit_without_teardown(3)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 3
    assert res.stdout == "buffered, not flushedatexit ran\n", res.stdout + res.stderr  # flushed, no finalization
    # and without it, the same process would have finalized the leftover
    res = subprocess.run([sys.executable, "-c", code.replace("exit_without_teardown(3)", "sys.exit(3)")],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 3 and "finalized" in res.stdout


def test_a_second_ctrl_c_while_aborting_finishes_the_cleanup(tmp_path, monkeypatch):
    """Ctrl-C pressed twice during the launcher's checks: the first raises KeyboardInterrupt out of the checks (the
    launcher's one line, exit 130); the second arrives while Ranks.abort waits for the killed ranks (psutil's
    wait_procs) and must not raise out of it (it did: a 185-line traceback, the cleanup unfinished). In-process: a
    sleeping child stands in for `accelerate launch`, the signals are sent to this process."""
    from fsdp_recipes.launch import ranks as ranks_module

    previous = signal.getsignal(signal.SIGINT)
    ranks = ranks_module.Ranks([sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "torchrun")
    child = psutil.Process(ranks.proc.pid)
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)  # the handler raises at the next bytecode
    wait_procs, seen = psutil.wait_procs, []

    def second_ctrl_c(procs, timeout=None):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.2)  # the handler runs here: it must return
        seen.append("signalled")
        return wait_procs(procs, timeout=timeout)

    monkeypatch.setattr(psutil, "wait_procs", second_ctrl_c)
    ranks.abort()  # raises KeyboardInterrupt without the fix
    assert seen == ["signalled"] and not child.is_running()
    assert signal.getsignal(signal.SIGINT) is previous  # the launcher's handlers back as they were
