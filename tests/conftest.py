"""Shared fixtures: an isolated asset cache, and a helper that runs pack commands as a user would."""

from __future__ import annotations

import contextlib
import functools
import fcntl
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "probes"))
import fork_server  # noqa: E402  (tests/probes/fork_server.py: the suite's launches forked from preloaded servers)
BIN = Path(sys.executable).parent  # the venv's bin: python, accelerate
# torchao, for the float8 tests only: `make venv` installs it here, outside site-packages (the Makefile says why)
FLOAT8_SITE = BIN.parent / "float8-site"
QLORA_SITE = BIN.parent / "qlora-site"  # bitsandbytes, outside the venv's site-packages (the Makefile says why)


# One OpenMP/MKL thread in every process of the suite (pytest's workers, the launcher and its summary, the planner,
# one-process launches; torchrun already gives each of several ranks 1): `make test` runs two workers on 2 cores, and
# torch's default of a thread per core then oversubscribes them; its spinning threads lose most of their time to each
# other (greedy generation on the tiny model under the suite's load: 24.8 s with 2 threads, 1.6 s with 1, issue 42's
# eval work, 2026-11-27). Set before any test imports torch; a variable the caller set wins.
for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

# Every process a test starts inherits this variable (pack_env copies os.environ, and so does a bare Popen). The
# launcher starts `accelerate launch` in a session of its own, so a process group or a parent's children list misses
# ranks whose launcher is gone; the tag finds them all. A daemon meant to outlive one test (the Slurm cluster's)
# starts without it.
TEST_TAG = "FSDP_RECIPES_TEST_PROCESS"
os.environ[TEST_TAG] = uuid.uuid4().hex


def tagged_processes() -> list[psutil.Process]:
    """This session's test processes still alive (not pytest itself)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.pid != os.getpid() and proc.environ().get(TEST_TAG) == os.environ[TEST_TAG]:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def kill_test_processes() -> list[str]:
    """SIGKILL every process a test started that is still running; their command lines, for the report."""
    procs = tagged_processes()
    for server in fork_server.SERVERS:  # the forks carry their server's environment, untagged
        with contextlib.suppress(psutil.NoSuchProcess):
            procs += psutil.Process(server).children()
    names = []
    for proc in procs:
        try:
            names.append(" ".join(proc.cmdline())[:200])
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)
    return names


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """The CPU-seconds of this worker and the children it reaped (fresh processes) during each test, beside the fork
    servers' per-fork figures: scripts/test_cpu.py adds them up per test and per file."""
    import resource

    def cpu() -> float:
        return sum(u.ru_utime + u.ru_stime for u in (resource.getrusage(resource.RUSAGE_SELF),
                                                     resource.getrusage(resource.RUSAGE_CHILDREN)))

    before = cpu()
    yield
    log = item.config._tmp_path_factory.getbasetemp() / f"cpu-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}.log"
    with open(log, "a") as f:
        f.write(f"{cpu() - before:.2f} CPU-s, {item.nodeid}\n")


@pytest.fixture(autouse=True)
def environment_as_it_was():
    """A test's environment variables end with it. accelerate's FSDP plugin writes FSDP_CPU_RAM_EFFICIENT_LOADING
    into os.environ when built in process, and a later test's FSDP1 plugin (the planner's) then asked for a GPU."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(autouse=True)
def no_process_outlives_its_test():
    yield
    left = kill_test_processes()
    if left:  # a test that leaves processes behind slows every later one: say so, after cleaning up
        pytest.fail(f"{len(left)} process(es) outlived the test and were killed: {left}")


# `make test` runs the suite on two pytest-xdist workers (--dist loadfile). A scope (a file, or one test of a file
# in SPLIT_BY_TEST) runs whole on one worker: a file's tests may share module fixtures (launches, the Slurm cluster),
# but those in SPLIT_BY_TEST share none, and their long tests (test_preemption.py's 20 launches) would otherwise hold
# one worker while the other idles. The workers take scopes in collection order, so the longest go first and the
# two end together (longest processing time first): seconds per test from a measured run, tests/durations.json
# (scripts/test_durations.py writes it from pytest's --junitxml; a test not in it counts UNMEASURED_S). A stale file
# costs minutes, not correctness.
SPLIT_BY_TEST = {"test_preemption.py", "test_smoke.py", "test_fsdp1.py", "test_mistakes.py", "test_start_gate.py"}
DURATIONS = Path(__file__).with_name("durations.json")
UNMEASURED_S = 5.0


def scope_of(nodeid: str) -> str:
    file = nodeid.split("::", 1)[0]
    return nodeid if Path(file).name in SPLIT_BY_TEST else file


def pytest_collection_modifyitems(config, items):
    import json

    seconds = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}
    total: dict[str, float] = {}
    first: dict[str, int] = {}
    for i, item in enumerate(items):
        scope = scope_of(item.nodeid)
        total[scope] = total.get(scope, 0.0) + seconds.get(item.nodeid, UNMEASURED_S)
        first.setdefault(scope, i)
    order = {id(item): i for i, item in enumerate(items)}
    items.sort(key=lambda it: (-total[scope_of(it.nodeid)], first[scope_of(it.nodeid)], order[id(it)]))


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: a run without xdist (-p no:xdist) does not know it
def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile, with the tests of SPLIT_BY_TEST's files scheduled one by one (scope_of), in collection order
    (xdist would otherwise put the scopes with most tests first), and a worker given its next scope only when it
    is down to its last test (xdist's default waits for two: it would hold three long tests while the other idles).
    Checked against pytest-xdist 3.8's LoadScopeScheduling."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    config.option.loadscopereorder = False

    class Scheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid)

        def _reschedule(self, node) -> None:
            if node.shutting_down:
                return
            if not self.workqueue:
                node.shutdown()
                return
            if self._pending_of(self.assigned_work[node]) <= 1:  # a worker must know its next test to run one
                self._assign_work_unit(node)

    return Scheduling(config, log)


def in_ci() -> bool:
    """The one place that decides "are we in CI": .ci/run exports CI=true (CI services set it too)."""
    return os.environ.get("CI", "").lower() in ("1", "true")


def skip_or_fail(reason: str) -> None:
    """A test whose tool or file is missing: skipped on a developer's machine, failed in CI, where nothing may
    skip silently."""
    (pytest.fail if in_ci() else pytest.skip)(reason)


def need_module(name: str):
    """Import a test-extra module, or skip_or_fail."""
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError:
        skip_or_fail(f"{name} is in the test extra: pip install -e .[test]")


def qlora_site() -> str:
    """QLORA_SITE (the Makefile), for a test that needs bitsandbytes (skip_or_fail without it)."""
    if not (QLORA_SITE / "bitsandbytes").is_dir():
        skip_or_fail(f"no bitsandbytes in {QLORA_SITE}: `make venv` installs it there")
    return str(QLORA_SITE)


@functools.cache
def library_server(site: str) -> dict:
    """The environment that puts `site` (qlora_site(), torchao_site()) on a launch's path, with a fork server of
    its own that has imported from it (tests/probes/fork_server.py), started once per pytest worker."""
    log = Path(os.environ["FSDP_RECIPES_TEST_FORK_SERVER_LOG"]).with_name(f"fork-server-{Path(site).name}.log")
    return fork_server.start(str(log), library=site, wait=True)  # only a test that needs the library waits


def torchao_site() -> str:
    """FLOAT8_SITE, for a test that needs torchao (skip_or_fail without it)."""
    if not (FLOAT8_SITE / "torchao").is_dir():
        skip_or_fail(f"no torchao in {FLOAT8_SITE}: `make venv` installs it there")
    return str(FLOAT8_SITE)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """A fresh $FSDP_RECIPES_CACHE with the tiny assets built once for the whole session."""
    root = tmp_path_factory.mktemp("cache")
    os.environ["FSDP_RECIPES_CACHE"] = str(root)
    # this worker's fork server imports while the assets are built; every later process of the suite is served by it
    log = tmp_path_factory.getbasetemp() / f"fork-server-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}.log"
    served = fork_server.start(str(log))
    os.environ.update(served)
    from fsdp_recipes.assets.tiny_assets import ensure_assets

    ensure_assets(root, quiet=True)
    fork_server.serving(served)  # the worker's first launch forked too
    return root


# The summary's before/after generations load the base and the trained model and generate for every eval prompt
# (2-4 s of one process per launch). Only the tests that read them (test_end_to_end.py, test_default_recipe.py) turn
# them back on, with GENERATIONS.
NO_GENERATIONS = {"FSDP_RECIPES_SUMMARY_GENERATIONS": "0"}
GENERATIONS = {"FSDP_RECIPES_SUMMARY_GENERATIONS": "auto"}


def pack_env(cache: Path, **extra) -> dict:
    env = dict(os.environ, **NO_GENERATIONS)
    env.update(FSDP_RECIPES_CACHE=str(cache), PATH=f"{BIN}:{env.get('PATH', '')}", PYTHONUNBUFFERED="1")
    env.pop("MASTER_PORT", None)
    env.update(extra)
    return env


def finished(proc, cmd: list[str], timeout: int) -> subprocess.CompletedProcess:
    """`proc` run to its end; on timeout, kill everything the test started and say what was running."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_test_processes()
        out, err = proc.communicate()
        pytest.fail(f"timed out after {timeout}s: {shlex.join(map(str, cmd))}\n--- its last output ---\n"
                    f"{out[-2000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def run(cmd: list[str], cache: Path, cwd: Path = REPO, timeout: int = 600, **env) -> subprocess.CompletedProcess:
    """Run a pack command as a user would."""
    return finished(subprocess.Popen(cmd, cwd=cwd, env=pack_env(cache, **env), stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True), cmd, timeout)


def launch(args: list[str], cache: Path, cwd: Path = REPO, timeout: int = 600, **env) -> subprocess.CompletedProcess:
    """`python -m fsdp_recipes.launch.launcher ...`, what every recipe's launch.sh runs."""
    return run([sys.executable, "-m", "fsdp_recipes.launch.launcher", *map(str, args)], cache, cwd, timeout, **env)


# ---- launches shared between tests and files: one run per pytest run, on whichever worker asks first

# tiny-cpu-lora for 4 steps with checkpoints at steps 2 and 4: tests/test_output_dir.py's finished run, and the run
# that tests/test_start_gate.py's gate test watches (it publishes it, so the first is not launched a second time)
SHORT_TINY_RUN = ["tiny-cpu-lora", "--max_steps", "4", "--save_strategy", "steps", "--save_steps", "2",
                  "--logging_steps", "1", "--eval_strategy", "no", "--save_merged_model", "false",
                  "--warmup_steps", "0"]


@dataclass(frozen=True)
class SharedRun:
    """A finished launch that several tests read. `out` is read-only for all of them: a test that changes it works
    on a copy (shutil.copytree). `cache` is the asset cache it ran with, which may be the other xdist worker's: its
    run_args.json and checkpoints name that cache's model and data, so a command that continues or compares with the
    run must use it (FSDP_RECIPES_CACHE), not the test's own cache_dir."""
    out: Path
    cache: Path


def shared_root(cache: Path) -> Path:
    """One folder per pytest run that both xdist workers see: the workers' basetemps (<run>/popen-gw0, -gw1) share
    their parent, which pytest removes with the run's other folders. cache_dir lies right under the basetemp."""
    basetemp = Path(cache).parent
    return (basetemp.parent if os.environ.get("PYTEST_XDIST_WORKER") else basetemp) / "shared-runs"


def _slot(args: list[str], cache: Path, env: dict) -> Path:
    key = json.dumps({"args": [str(a) for a in args], "env": env}, sort_keys=True)
    slot = shared_root(cache) / f"{Path(str(args[0])).name}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    slot.mkdir(parents=True, exist_ok=True)
    return slot


def _published(slot: Path) -> SharedRun | None:
    done = slot / "done.json"
    if not done.is_file():
        return None
    info = json.loads(done.read_text())
    return SharedRun(Path(info["out"]), Path(info["cache"]))


def _publish(slot: Path, out: Path, cache: Path) -> SharedRun:
    tmp = slot / "done.json.tmp"
    tmp.write_text(json.dumps({"out": str(out), "cache": str(cache)}))
    tmp.rename(slot / "done.json")  # atomic: a reader sees no file or the whole file
    return SharedRun(out, Path(cache))


@contextlib.contextmanager
def _slot_lock(slot: Path, wait: bool = True):
    """The slot's file lock (fcntl, so it holds between the xdist workers' processes): yields True once held, or
    False at once when `wait` is off and another process holds it. Released when the block ends, also on an error
    and when the process dies."""
    with open(slot / "lock", "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            held = True
        except BlockingIOError:
            held = False
        if not held:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def shared_run(key_args: list[str], cache_dir: Path, timeout: int = 600, **env) -> SharedRun:
    """`launch([*key_args, "--output_dir", <dir>], cache_dir, **env)` once per pytest run, across both xdist
    workers: the first caller launches (a second caller, on the other worker, waits for it on the file lock instead
    of launching the same run beside it), later callers get the same finished run. A failed launch fails its caller
    and publishes nothing: the next caller launches again (and fails with its own message)."""
    slot = _slot(key_args, cache_dir, env)
    if (done := _published(slot)) is not None:
        return done
    with _slot_lock(slot):
        if (done := _published(slot)) is not None:
            return done
        out = slot / "run"
        shutil.rmtree(out, ignore_errors=True)  # a failed earlier try's leftovers
        res = launch([*key_args, "--output_dir", str(out)], cache_dir, timeout=timeout, **env)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        return _publish(slot, out, cache_dir)


@contextlib.contextmanager
def publishing_shared_run(key_args: list[str], cache_dir: Path, own: Path):
    """For a test that must make the launch itself (it watches it: probes, output as it comes) and whose launch is
    also `shared_run(key_args)`'s: yields the output_dir to launch into. That is the shared run's folder when no run
    of `key_args` is there yet and no other process is making it; the run is published when the block ends without
    an error, for later shared_run callers to reuse. Otherwise `own` (the test never waits for another's launch).
    The test passes exactly `key_args` to its launch; only environment that changes no output may be added."""
    slot = _slot(key_args, cache_dir, {})
    with _slot_lock(slot, wait=False) as held:
        mine = held and _published(slot) is None
        if mine:
            out = slot / "run"
            shutil.rmtree(out, ignore_errors=True)
            yield out
            _publish(slot, out, cache_dir)
    if not mine:  # outside the lock: another worker's shared_run need not wait for this test's own launch
        yield own


class RanksWouldStart(BaseException):  # not an Exception: no handler in the launcher may take it for a failure
    """Raised where the launcher starts `accelerate launch`, with the command it would run."""

    def __init__(self, cmd: list[str], settings: dict | None = None, overrides: list[str] | None = None) -> None:
        super().__init__(" ".join(cmd))
        self.cmd = cmd
        self.settings = settings  # the recipe as the launcher hands it to the ranks (config/handoff.py), once written
        self.overrides = overrides  # the command line the launcher parses the recipe with: placement's, the user's


def launcher_checks(args: list[str], monkeypatch, capsys) -> subprocess.CompletedProcess:
    """The launcher's `main` in this process, for a mistake it must catch before any rank starts: starting the
    ranks fails the test. A second or less per case, where a launcher process spends ~5 s importing the libraries
    (tests that need the real process, its exit code and its streams, use `launch`)."""
    try:
        return launcher_until_ranks(args, monkeypatch, capsys)
    except RanksWouldStart:
        raise AssertionError("the launcher started the ranks for a mistake it should have caught") from None


@pytest.fixture
def checks(monkeypatch, capsys, cache_dir):
    """launcher_checks as a fixture: checks([recipe, *overrides]) -> the launcher's exit code and streams."""
    return lambda args: launcher_checks([str(a) for a in args], monkeypatch, capsys)


CHECKS_ROOT = tempfile.TemporaryDirectory(prefix="launcher-checks-")  # removed when the worker exits


def launcher_until_ranks(args: list[str], monkeypatch, capsys,
                         checks_first: bool = True) -> subprocess.CompletedProcess:
    """launcher_checks, for a command whose checks pass: raises RanksWouldStart (its .cmd the `accelerate launch`
    command) where the launcher would start the ranks, once every check has passed (checks_first=False: before the
    recipe checks, which run where the ranks import; for a command checked on hardware faked in the launcher)."""
    from fsdp_recipes.launch import launcher

    seen = {}

    def start_ranks(recipe, *a, **k):
        seen["overrides"] = list(recipe.overrides)
        return start(recipe, *a, **k)

    def ranks_would_start(cmd, torchrun_logs, *a, **k):
        import shutil

        handed = Path(cmd[cmd.index("--recipe_settings") + 1])
        settings = json.loads(handed.read_text()) if handed.is_file() else None
        shutil.rmtree(torchrun_logs, ignore_errors=True)  # made for the ranks, which Ranks would remove at the end
        raise RanksWouldStart(cmd, settings, seen.get("overrides"))

    monkeypatch.chdir(REPO)  # where launch() runs it
    if "--output_dir" not in args:  # not the recipe's runs/<name>: the launcher locks it, and another worker may too
        args = [*args, "--output_dir", str(Path(tempfile.mkdtemp(dir=CHECKS_ROOT.name)) / "run")]
    monkeypatch.setenv("FSDP_RECIPES_OVERLAP_CHECKS", "0" if checks_first else "1")  # check first, then start
    start = launcher.start_ranks
    monkeypatch.setattr(launcher, "start_ranks", start_ranks)
    monkeypatch.setattr(launcher, "Ranks", ranks_would_start)
    saved = dict(os.environ)  # main sets PET_* and others with setdefault: they must not reach later tests
    try:
        launcher.main(args)
        code = 0
    except SystemExit as stop:
        code = stop.code
    finally:
        os.environ.clear()
        os.environ.update(saved)
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["launcher.main", *args], code, out, err)


def fsdp1_recipe(parent: Path, train_lm_head: bool = False, **fsdp_config) -> Path:
    """The tiny recipe with the FSDP1 settings the seeds use (accelerate_configs/fsdp1_1node.yaml: use_orig_params,
    sync_module_states + cpu_ram_efficient_loading, backward prefetch), on 2 CPU processes. Without
    lora_modules_to_save unless `train_lm_head`: the LM head's tests are their own (peft_fsdp.py, workaround 3)."""
    import shutil

    import yaml

    dst = parent / "tiny-fsdp1"
    if not dst.exists():
        shutil.copytree(REPO / "recipes" / "tiny-cpu-lora", dst)
        acc = yaml.safe_load((REPO / "accelerate_configs" / "fsdp1_1node.yaml").read_text())
        acc.update(num_processes=2, mixed_precision="no")
        acc["fsdp_config"].update(fsdp_config)
        (dst / "accelerate.yaml").write_text(yaml.safe_dump(acc))
        if not train_lm_head:
            sft = (dst / "sft.yaml").read_text().replace("lora_modules_to_save: [lm_head]", "")
            (dst / "sft.yaml").write_text(sft)
    return dst


@pytest.fixture
def world_of_one(tmp_path):
    """A gloo process group of one in this process: enough for FSDP1 (which then runs NO_SHARD) and FSDP2 (one
    shard per tensor) on CPU, with no ranks to start."""
    import torch.distributed as dist

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def tiny_lora_model(intermediate_size: int = 128, vocab_size: int = 512):
    """A random Mistral with LoRA (r=1) on q_proj and v_proj; every trainable tensor random (B too), same seed."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    base = MistralForCausalLM(MistralConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=intermediate_size,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
    model = get_peft_model(base, LoraConfig(r=1, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():  # B starts at zero: make every trainable tensor distinct from the others
        for p in model.parameters():
            if p.requires_grad:
                p.normal_()
    return model


def expert_lora_pair(adapter: dict, fused: str, in_features: int, out_features: int):
    """PEFT's (lora_A, lora_B) in a saved adapter for the fused expert tensor `fused` (a base model's state-dict name,
    `target_parameters`): the pair whose widths are that tensor's, since a module's two targeted tensors share its
    prefix. A: (r x experts, in), B: (out, r x experts); expert e's update is B[:, e::experts] @ A[e*r:(e+1)*r]."""
    prefix = "base_model.model." + fused.rsplit(".", 1)[0] + "."
    (a, b), = [(adapter[k], adapter[k.replace("lora_A", "lora_B")]) for k in adapter
               if k.startswith(prefix) and k.endswith("lora_A.weight") and adapter[k].shape[1] == in_features
               and adapter[k.replace("lora_A", "lora_B")].shape[0] == out_features]
    return a, b
