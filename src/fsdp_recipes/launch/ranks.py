"""The ranks: `accelerate launch` of the rank entry point in a session of its own, gated until the launcher's checks
pass (train/start_gate.py), signals passed on, output relayed (rank_output.py)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

# Only light modules here: the heavy imports (torch, transformers, TRL) happen in the checks, while the ranks
# import the same in parallel.
from fsdp_recipes.config import handoff
from fsdp_recipes.config.recipes import Recipe
from fsdp_recipes.dist import free_port
from fsdp_recipes.errors import UserError
from fsdp_recipes.launch import explain_failure
from fsdp_recipes.launch.lines import say
from fsdp_recipes.launch.rank_output import RankOutput
from fsdp_recipes.train import failure_record, start_gate
from fsdp_recipes.config.preemption import grace_seconds


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
        self.interrupted = False  # Ctrl-C after release: the ranks save and stop (a second one: at once), no failure
        self.killed = False  # the second Ctrl-C killed them (their save, if it had begun, is incomplete)
        # A signal before release raised in the launcher (stopping), or abort() began (aborting): a second Ctrl-C
        # (a user pressing it twice) must not raise again out of the cleanup (a traceback, the ranks left behind)
        self.stopping = self.aborting = False
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
        if self.aborting or (self.stopping and not self.released):  # stopping already: this one changes nothing
            return
        if not self.released:  # the ranks are importing or at the gate: stop everything here
            self.stopping = True
            raise KeyboardInterrupt if signum == signal.SIGINT else Preempted(signal.Signals(signum).name)
        if signum == signal.SIGINT and not self.interrupted:
            # the first Ctrl-C stops the ranks as a preemption does: a checkpoint at the end of this step, then
            # exit (train/preemption.py); a second one kills them
            self.interrupted = True
            say("Ctrl-C: the ranks save a checkpoint at the end of this step, then stop (Ctrl-C again stops them "
                "at once, without one)")
            signum = signal.SIGTERM
        elif signum == signal.SIGINT:  # the second: torchrun would wait out its grace period again, so kill them
            self.killed = True
            self.kill_tree()
            return
        elif self.preempted_by is None:
            self.preempted_by = signum
        self.proc.send_signal(signum)

    def kill_tree(self) -> list:
        """SIGKILL to accelerate, torchrun and the ranks (each rank in a session of its own: found by parenthood);
        returns the processes signalled, for abort() to wait on."""
        import psutil

        try:
            procs = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            procs = []
        for p in [psutil.Process(self.proc.pid), *procs] if self.proc.poll() is None else procs:
            try:
                p.kill()
            except psutil.Error:
                pass
        return procs

    def release(self, log_dir: Path | None) -> None:
        self.released = True  # first: from here on a signal is passed on, never raised in the launcher
        self.gate.open()
        self.output.release(log_dir)

    def abort(self) -> None:
        """The checks failed or were interrupted: kill accelerate, torchrun and the ranks, drop their output.
        (torchrun starts each rank in a session of its own, so killing the launcher child's session is not
        enough; a rank that escapes the list below sees the gate's ABORT and exits by itself.) A signal while it
        runs is ignored (_on_signal): the cleanup finishes, and the launcher says its one line."""
        self.aborting = True  # first: a second Ctrl-C must not interrupt the cleanup
        import psutil

        self.output.drop()
        self.output.close()
        self.gate.abort()
        procs = self.kill_tree()
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
    # the recipe as the launcher reads it, written there before the ranks pass their gate (config/handoff.py)
    cmd += ["-m", "fsdp_recipes.train.entry", *handoff.rank_argv(settings_file(torchrun_logs))]
    # torchrun forwards these signals to every rank and then allows the grace period before killing them.
    os.environ.setdefault("PET_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1")
    os.environ.setdefault("PET_SHUTDOWN_TIMEOUT", str(grace_seconds(recipe)))
    return cmd


def settings_file(torchrun_logs: Path) -> Path:
    """Where the launcher hands the ranks the recipe's settings: beside their torchrun records, gone with them."""
    return torchrun_logs / "recipe_settings.json"


def overlap_checks() -> bool:
    """FSDP_RECIPES_OVERLAP_CHECKS=0: check first, then start the ranks (the order before start_gate.py), for a
    node whose host memory cannot take the ranks' imports and the launcher's dataset check at once."""
    return os.environ.get("FSDP_RECIPES_OVERLAP_CHECKS", "1") != "0"

