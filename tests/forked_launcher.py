"""The launcher forked from a process that has imported its libraries already, for the suite's launches.

A launch is four processes that each import torch, transformers, TRL and PEFT: the launcher (~9 CPU-seconds of
imports on the 2-core VM, alone), `accelerate launch` and the ranks. The suite makes about 100 launches. Here the
launcher's imports happen once per pytest worker, in multiprocessing's fork server (preloading this module), and
each launch is a fresh fork of it: its own process, pid, signals, environment, working directory and output files,
running `fsdp_recipes.launch.launcher` as `python -m` would. `accelerate launch` and the ranks start as always.

What a fork cannot give, a fresh `python -m fsdp_recipes.launch.launcher` (conftest.launch falls back to it) does:
- an environment variable that a library reads when imported (a library's folder on PYTHONPATH, HF_*, OMP_*, ...):
  the fork server imported them under the worker's environment (fork_safe says what may differ; tests/probes on
  PYTHONPATH may: the fork runs its sitecustomize);
- the launcher's own import-time output (a library's warning at import), which went to the server's stderr:
  tests/test_default_recipe.py runs the copied recipe's launch.sh in a fresh environment and checks that console.
FSDP_RECIPES_TEST_FRESH_LAUNCHER=1 makes every launch a fresh process (to compare, or to rule the fork out).
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
from pathlib import Path

# The heavy imports a launch makes before its checks pass (launcher.check_recipe), made once in the fork server.
if multiprocessing.parent_process() is None and os.environ.get("FSDP_RECIPES_FORK_SERVER") == "1":
    import datasets  # noqa: F401
    import peft  # noqa: F401
    import transformers  # noqa: F401
    from transformers import AutoConfig, AutoTokenizer  # noqa: F401
    from trl import DPOConfig, GRPOConfig, KTOConfig, ModelConfig, RLOOConfig, ScriptArguments, SFTConfig  # noqa: F401

    import fsdp_recipes.launch.launcher  # noqa: F401
    from fsdp_recipes.train import data_lengths, kinds, loading, run_checks  # noqa: F401

# Variables a forked launcher may set differently from the fork server's environment: read by the pack and the
# libraries when used, not when imported. Any other difference launches a fresh process.
FORK_SAFE_PREFIXES = ("FSDP_RECIPES_", "PET_", "SLOW_", "FAKE_")
FORK_SAFE_VARIABLES = {"PATH", "PYTHONUNBUFFERED", "MASTER_PORT", "MASTER_ADDR", "TOKENIZERS_PARALLELISM",
                       "PYTORCH_CUDA_ALLOC_CONF", "CI"}
_context = None
FORKED: set[int] = set()  # the launches' pids, for conftest.kill_test_processes
PROBES = Path(__file__).parent / "probes"  # tests/probes/sitecustomize.py: hooks keyed by environment variables


def added_paths(env: dict) -> list[str]:
    """The PYTHONPATH entries `env` has and this worker's environment has not."""
    have = set(os.environ.get("PYTHONPATH", "").split(os.pathsep))
    return [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in have]


def fork_safe(env: dict) -> bool:
    """Whether `env` differs from this worker's environment only in FORK_SAFE variables, and on PYTHONPATH only by
    tests/probes (the fork runs its sitecustomize as Python's start would; a library's folder there could differ
    from what the server imported, and its availability is cached by transformers and PEFT when imported)."""
    if os.environ.get("FSDP_RECIPES_TEST_FRESH_LAUNCHER") == "1":
        return False
    changed = {k for k in env.keys() | os.environ.keys() if env.get(k) != os.environ.get(k)}
    if "PYTHONPATH" in changed and all(Path(p) == PROBES for p in added_paths(env)):
        changed.discard("PYTHONPATH")
    return all(k in FORK_SAFE_VARIABLES or k.startswith(FORK_SAFE_PREFIXES) for k in changed)


def start() -> multiprocessing.context.BaseContext:
    """This worker's fork-server context. The first call starts the server, which imports in the background until
    the first launch needs it, with this worker's environment less the suite's process tag (the server outlives
    each test, like the Slurm cluster's daemons)."""
    global _context
    if _context is None and os.environ.get("FSDP_RECIPES_TEST_FRESH_LAUNCHER") != "1":
        from multiprocessing import forkserver

        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["forked_launcher"])
        saved = dict(os.environ)
        os.environ.pop("FSDP_RECIPES_TEST_PROCESS", None)
        os.environ["FSDP_RECIPES_FORK_SERVER"] = "1"
        # Python 3.11's fork server ignores the sys.path it is given: the preload finds this module by PYTHONPATH
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parent),
                                                                 saved.get("PYTHONPATH")]))
        try:
            forkserver.ensure_running()
        finally:
            os.environ.clear()
            os.environ.update(saved)
        _context = ctx
    return _context


def preloaded() -> None:
    """In a fork: exit 0 where the server's preload imported the launcher's libraries (tests/test_harness.py)."""
    sys.exit(0 if {"trl.trainer.sft_config", "peft", "datasets", "fsdp_recipes.launch.launcher"} <= sys.modules.keys()
             else 3)


def _run(argv: list[str], env: dict, cwd: str, stdout: str, stderr: str | None) -> None:
    """In the fork: `python -m fsdp_recipes.launch.launcher *argv`, its output to files (fds 1 and 2, which
    `accelerate launch` inherits)."""
    out = os.open(stdout, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    err = os.open(stderr, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) if stderr else out
    os.dup2(out, 1)
    os.dup2(err, 2)
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True)
    added = added_paths(env)  # before the environment is the launch's: tests/probes at most (fork_safe)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for path in added:
        sys.path.insert(0, path)
        if (Path(path) / "sitecustomize.py").is_file():
            runpy.run_path(str(Path(path) / "sitecustomize.py"), run_name="sitecustomize")
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):  # as a fresh process has them
        signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    from fsdp_recipes.launch import launcher

    sys.argv = [launcher.__file__, *argv]
    sys.exit(launcher.main(argv))


class Launch:
    """subprocess.Popen's interface, as the tests use it, over a launcher forked from the server (`fork_safe(env)`)
    or started fresh (`python -m`), its output in files under `folder` (stderr into stdout with merge_stderr)."""

    def __init__(self, argv: list[str], env: dict, cwd: Path, folder: Path, merge_stderr: bool = False):
        folder.mkdir(parents=True, exist_ok=True)
        self._out = folder / "stdout"
        self._err = None if merge_stderr else folder / "stderr"
        self.forked = fork_safe(env)
        self.returncode = None
        argv = list(map(str, argv))
        if self.forked:
            self._proc = start().Process(target=_run, args=(argv, env, str(cwd), str(self._out),
                                                            self._err and str(self._err)))
            self._proc.start()
            self.pid = self._proc.pid
            FORKED.add(self.pid)  # untagged (/proc/<pid>/environ is the server's): conftest.kill_test_processes
        else:
            with open(self._out, "w") as out, open(self._err or os.devnull, "w") as err:
                self._proc = subprocess.Popen([sys.executable, "-m", "fsdp_recipes.launch.launcher", *argv], cwd=cwd,
                                              env=env, stdout=out, stderr=out if merge_stderr else err)
            self.pid = self._proc.pid

    def poll(self) -> int | None:
        if self.returncode is None:
            if not self.forked:
                self.returncode = self._proc.poll()
            elif not self._proc.is_alive():
                self._proc.join()
                self.returncode = self._proc.exitcode
                FORKED.discard(self.pid)  # reaped: the pid may be another process's from now on
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.forked:
            self._proc.join(timeout)
        else:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired("fsdp_recipes.launch.launcher", timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def output(self) -> tuple[str, str]:
        read = lambda p: p.read_text(errors="replace") if p and p.is_file() else ""  # noqa: E731
        return read(self._out), read(self._err)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        return self.output()
