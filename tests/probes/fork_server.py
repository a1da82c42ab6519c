"""The suite's Python processes started as forks of a server that has imported their libraries already.

A launch is four Python processes that each import torch, transformers, TRL and PEFT before doing anything: the
launcher, `accelerate launch` and two ranks, ~10 CPU-seconds each on the 2-core VM; the suite makes about 100
launches, and py-spy found 33.5 of 42.6 sampled seconds of a short launch's ranks in imports. Each pytest worker
starts one server (`start`) that imports them once. Every process of the suite runs tests/probes/sitecustomize.py
(tests/probes is on the suite's PYTHONPATH), which calls `delegate()` first: a process that would run the pack's or
bench/'s modules (`python -m`) or `accelerate launch` hands its command, environment, working directory and standard
streams to the server and stays as a small stand-in. The server forks; the fork sets up what a fresh interpreter
would have (streams, environment, cwd, signal defaults, sys.argv, sys.path[0], the probes' hooks, torch's loggers,
fresh random seeds: _fresh_state) and runs the module as `python -m` would. The stand-in keeps its pid, so what
started it (a test, the launcher, torchrun) sees the same process: signals sent to it are passed on, and it ends with
the fork's exit code or signal. A fork whose stand-in is gone (SIGKILL) kills itself, or the server kills it when the
stand-in went before the answer; a stand-in dies with its parent (as the ranks' own die_with_parent has them do).
Nothing one stand-in does may end the server: its exit kills every fork, whose stand-ins would then exit 1.

A fresh process is started instead (the stand-in simply goes on) when the environment differs from the server's in a
variable a library may read when imported (any not in FORK_SAFE; torch's TORCH_LOGS and LOGLEVEL the fork applies
again; PYTHONPATH may add folders, unless one holds a module the server imported), for another Python (another
environment's packages), when the interpreter gets options other than `-u`, or with FSDP_RECIPES_TEST_FORK_SERVER
unset or empty, which tests that check what only a fresh process shows do: a library's import-time output (it went to
the server's log), die_with_parent against a real parent.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import sys

ADDRESS = "FSDP_RECIPES_TEST_FORK_SERVER"  # the server's socket; unset or empty: every process starts fresh
SERVED_PACKAGES = ("fsdp_recipes.", "bench.")  # `python -m` of any of their modules: the launcher, the ranks, CLIs
SERVED_MODULES = {"accelerate.commands.launch"}
FRESH = {ADDRESS: ""}  # a test's environment for processes that must start fresh
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
# Variables that may differ from the server's environment: read when used, not when a library is imported. The
# probes' hooks (sitecustomize.py) are read again in the fork. Anything else differing starts a fresh process.
FORK_SAFE_PREFIXES = ("FSDP_RECIPES_", "PET_", "SLOW_", "FAKE_", "ACCELERATE_", "FSDP_", "TORCHELASTIC_",
                      "SAFETENSORS_READ_", "PARALLELISM_CONFIG_", "SLURM_", "SLURMD_", "NCCL_")
FORK_SAFE = {"PATH", "PYTHONUNBUFFERED", "MASTER_PORT", "MASTER_ADDR", "TOKENIZERS_PARALLELISM",
             "PYTORCH_CUDA_ALLOC_CONF", "CI", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
             "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
             "OMP_NUM_THREADS", "MAKEFLAGS", "MAKELEVEL", "MFLAGS", "REDUCE_SCATTER_COUNT_FILE",
             "ABORT_AT_EXIT_RANK", "NAN_LOSS_AT_STEP", "OLDPWD", "PWD", "SHLVL", "_", "PYTEST_CURRENT_TEST",
             "HOSTNAME", "ENVIRONMENT", "SRUN_DEBUG", "ZE_AFFINITY_MASK",  # set by Slurm in a job
             "TMPDIR",  # the fork forgets the server's tempfile.tempdir (_fresh_state)
             "COMPARE_PROBE",  # read by bench/compare.py's sitecustomize, which the fork runs (_fresh_state)
             "RECIPE", "ARGS", "PYTHON", "COMMON", "RDZV_JOIN_TIMEOUT", "FSDP_LAUNCH_BASE", "PROCS_PER_NODE",
             "MAKEOVERRIDES", "GPU", "GPUS", "NODES", "VENV", "RUN", "RUNS", "TYPE", "K8S_ARGS",  # make's and slurm/'s
             "TORCHINDUCTOR_CACHE_DIR",  # torch sets it in os.environ when imported, and reads it when compiling
             "CUDA_VISIBLE_DEVICES", "GPU_DEVICE_ORDINAL", "ROCR_VISIBLE_DEVICES"}  # read when a GPU is set up: the
# suite runs on CPU (a server that had set up CUDA could not fork a process that uses it)
_TESTS: dict[int, str] = {}  # the server's forks: the test that started each (PYTEST_CURRENT_TEST)
OWN_PATH: list[str] = []  # the server's PYTHONPATH folders: a fork puts the request's in their place
IN_FORK = False  # set in a fork: its own sitecustomize run must not delegate again


# ---- the stand-in (stdlib only: it runs in every process of the suite at start-up)

def served(orig_argv: list[str]) -> dict | None:
    """What a fork would run for this command line (`python [-u] -m <a served module> ...` or `python <venv>/bin/
    accelerate launch ...`), else None."""
    argv, unbuffered = list(orig_argv[1:]), False
    while argv[:1] == ["-u"]:
        argv, unbuffered = argv[1:], True
    if len(argv) >= 2 and argv[0] == "-m" and (argv[1] in SERVED_MODULES or argv[1].startswith(SERVED_PACKAGES)):
        return {"module": argv[1], "argv": argv[2:], "unbuffered": unbuffered}
    if len(argv) >= 2 and os.path.basename(argv[0]) == "accelerate" and argv[1] == "launch" and \
            os.path.dirname(os.path.abspath(argv[0])) == os.path.dirname(sys.executable):
        return {"script": os.path.abspath(argv[0]), "argv": argv[1:], "unbuffered": unbuffered}
    return None


def _read_line(conn: socket.socket) -> str:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(64)
        if not chunk:
            raise ConnectionError("fork server closed the connection")
        data += chunk
    return data.decode().strip()


def delegate() -> None:
    """In a process starting up: have the server fork what it would run, pass signals on, exit as it exits. Returns
    (the process goes on to start fresh) where no server is set or it says the environment is not fork-safe."""
    address = os.environ.get(ADDRESS)
    what = None if IN_FORK or not address else served(sys.orig_argv)
    if what is None:
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)  # held until the fork's pid is known
    parent = os.getppid()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(address)
        request = json.dumps(dict(what, env=dict(os.environ), cwd=os.getcwd(), orig_argv=sys.orig_argv,
                                  executable=sys.executable)).encode()
        socket.send_fds(conn, [struct.pack("!I", len(request))], [0, 1, 2])
        conn.sendall(request)
        reply = _read_line(conn)
    except OSError:
        reply = "fresh"
    if reply == "fresh":
        conn.close()
        signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
        return
    pid = int(reply.split()[1])
    _die_with_parent()  # as the ranks' own die_with_parent (the parent thread: all the pack's Popen calls are in main)
    if os.getppid() != parent:  # it died while the server answered (the kernel sends nothing now): end, as it would
        os.kill(os.getpid(), signal.SIGKILL)
    for sig in FORWARDED:
        signal.signal(sig, lambda s, _frame: _pass_on(pid, s))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
    try:
        status = int(_read_line(conn).split()[1])
    except (OSError, ValueError) as err:  # the server ended first: the fork's exit code is lost, and this says so
        print(f"[fork server] ended before it reported the exit code of fork {pid} ({err}); its log: "
              f"{os.environ.get('FSDP_RECIPES_TEST_FORK_SERVER_LOG', '?')}", file=sys.stderr, flush=True)
        os._exit(1)
    code = os.waitstatus_to_exitcode(status)
    if code < 0:  # killed by a signal: so is the stand-in, as seen from its parent
        signal.signal(-code, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [-code])
        os.kill(os.getpid(), -code)
    os._exit(code if code >= 0 else 128 - code)


def _pass_on(pid: int, sig: int) -> None:
    """A signal to the stand-in, passed on to its fork. A fork that has just ended is no error: its exit status is on
    its way (an exception here would leave the wait for it, and the stand-in would exit 1, not the fork's code)."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _die_with_parent(sig: int = signal.SIGKILL) -> None:
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, sig, 0, 0, 0)  # PR_SET_PDEATHSIG


# ---- the server

PRELOAD = [
    "datasets", "peft", "transformers", "trl", "accelerate", "accelerate.commands.launch", "torch.distributed.run",
    "torch.distributed.fsdp", "torch.distributed.checkpoint", "safetensors.torch",
    "fsdp_recipes.launch.launcher", "fsdp_recipes.train.entry", "fsdp_recipes.train.run_checks",
    "fsdp_recipes.train.build", "fsdp_recipes.train.final_save", "fsdp_recipes.speed",
    "fsdp_recipes.data.loading", "fsdp_recipes.data.lengths", "fsdp_recipes.train.console",
    "fsdp_recipes.train.preemption", "fsdp_recipes.checkpoint.markers", "fsdp_recipes.checkpoint.load_check",
    "fsdp_recipes.checkpoint.resume_check", "fsdp_recipes.checkpoint.resume_settings",
    "fsdp_recipes.checkpoint.save_check", "fsdp_recipes.checkpoint.sharded_save", "fsdp_recipes.metrics.run_report",
    "fsdp_recipes.metrics.memory_probe", "fsdp_recipes.metrics.rss_watch", "fsdp_recipes.patches.optim_resume",
    "fsdp_recipes.patches.peft_fsdp", "fsdp_recipes.dist",
    "transformers.models.llama.modeling_llama", "transformers.models.qwen2.modeling_qwen2",
    "transformers.models.mistral.modeling_mistral", "torch.utils.tensorboard",  # the recipes' report_to
]


def _preload() -> None:
    import importlib
    import importlib.util

    for name in PRELOAD:
        importlib.import_module(name)
    from fsdp_recipes.train import entry, kinds

    entry.import_training_stack()
    for name in kinds.names():
        kinds.load(name)
    trl_trainers = ("SFTTrainer", "DPOTrainer", "GRPOTrainer", "KTOTrainer", "RLOOTrainer")
    __import__("trl", fromlist=list(trl_trainers))
    for name in ("torchao.float8", "bitsandbytes"):  # a library server's folder (conftest.library_server)
        if importlib.util.find_spec(name.split(".")[0]) is not None:
            importlib.import_module(name)


def _torch_logs_reset():
    """torch's own set-up of its loggers from TORCH_LOGS, run when torch is imported and callable again (private:
    checked on torch 2.13.0); None where it is gone, and a TORCH_LOGS that differs starts a fresh process."""
    internal = sys.modules.get("torch._logging._internal")
    return getattr(internal, "_init_logs", None)


LOGLEVEL_MARK = 31  # a level no library sets: the loggers that read LOGLEVEL while the server imported have it


def _elastic_loggers_level():
    """The level a fresh import gives torch's elastic loggers (torch.distributed.elastic.utils.logging's
    _setup_logger: LOGLEVEL, else its get_log_level(); checked on torch 2.13.0); None where that is gone, and a
    LOGLEVEL that differs then starts a fresh process."""
    elastic = sys.modules.get("torch.distributed.elastic.utils.logging")
    get_log_level = getattr(elastic, "get_log_level", None)
    return None if get_log_level is None else os.environ.get("LOGLEVEL", get_log_level())


def _elastic_loggers_reset() -> None:
    """In the fork: the loggers the server's imports set from LOGLEVEL (they carry LOGLEVEL_MARK) at this process's
    LOGLEVEL, as torchrun's launch config (printed at INFO) shows in a fresh process."""
    import logging

    level = _elastic_loggers_level()
    for logger in list(logging.root.manager.loggerDict.values()) if level is not None else []:
        if isinstance(logger, logging.Logger) and logger.level == LOGLEVEL_MARK:
            logger.setLevel(level)


def _paths(value: str | None) -> list[str]:
    return list(dict.fromkeys(os.path.realpath(p) for p in (value or "").split(os.pathsep) if p))


def added_folders(env: dict, own: dict) -> list[str] | None:
    """The folders the request's PYTHONPATH adds to the server's, which it keeps in their order; None where it drops
    or reorders one of the server's."""
    mine, theirs = _paths(own.get("PYTHONPATH")), _paths(env.get("PYTHONPATH"))
    return [p for p in theirs if p not in mine] if [p for p in theirs if p in mine] == mine else None


def shadowed(folder: str) -> list[str]:
    """The modules this process has imported that `folder` holds another file for: a fork would run the imported one
    where a fresh process imports the folder's."""
    names = []
    for entry in os.listdir(folder) if os.path.isdir(folder) else []:
        name = entry[:-3] if entry.endswith(".py") else entry if os.path.isdir(os.path.join(folder, entry)) else ""
        module = sys.modules.get(name) if name != "sitecustomize" else None  # sitecustomize: run in the fork
        where = os.path.realpath(getattr(module, "__file__", None) or "")
        if module is not None and not where.startswith(os.path.realpath(folder) + os.sep):
            names.append(name)
    return names


def fork_safe(env: dict, own: dict) -> list[str]:
    """The variables that differ from the server's environment and are not FORK_SAFE (empty: the fork may run). A
    PYTHONPATH that adds folders is fork-safe unless one holds a module imported here already: the fork puts them on
    its path where a fresh process has them, and runs the first sitecustomize found there (_fresh_state)."""
    changed = {k for k in env.keys() | own.keys() if env.get(k) != own.get(k)}
    if _torch_logs_reset() is not None:  # the fork sets torch's logging up again from TORCH_LOGS (_fresh_state)
        changed.discard("TORCH_LOGS")
    if _elastic_loggers_level() is not None:  # and torch's elastic loggers from LOGLEVEL
        changed.discard("LOGLEVEL")
    added = added_folders(env, own)
    if added is not None and not any(shadowed(p) for p in added):
        changed.discard("PYTHONPATH")
    return sorted(k for k in changed if k not in FORK_SAFE and not k.startswith(FORK_SAFE_PREFIXES))


def serve(address: str) -> None:
    """Until the pytest worker that started it exits: accept stand-ins, fork, report each fork's exit status."""
    _die_with_parent(signal.SIGTERM)  # the pytest worker gone: end, and take the forks along
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    own = dict(os.environ)  # before the imports: torch sets TORCHINDUCTOR_CACHE_DIR in it
    OWN_PATH.extend(_paths(own.get("PYTHONPATH")))
    import logging

    logging.addLevelName(LOGLEVEL_MARK, "FORK_SERVER_LOGLEVEL")
    os.environ["LOGLEVEL"] = "FORK_SERVER_LOGLEVEL"  # the level torch's elastic loggers take when imported: a mark
    try:
        _preload()
    finally:
        os.environ.pop("LOGLEVEL")
        if "LOGLEVEL" in own:
            os.environ["LOGLEVEL"] = own["LOGLEVEL"]
    import gc

    # what the imports made, out of every later collection: each rank's gc.collect() at train start (accelerate's
    # free_memory) walked the whole preloaded heap, 0.4 CPU-s per rank, and touched pages the forks share
    gc.collect()
    gc.freeze()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address + ".tmp")
    listener.listen(64)
    os.rename(address + ".tmp", address)  # connectable once it exists: clients before that start fresh
    forks: dict[int, socket.socket] = {}
    try:
        _loop(listener, own, forks)
    finally:
        for pid in forks:
            os.kill(pid, signal.SIGKILL)


def _loop(listener: socket.socket, own: dict, forks: dict) -> None:
    import select

    while True:
        if select.select([listener], [], [], 0.2)[0]:
            conn, _ = listener.accept()
            try:
                _answer(conn, own, listener, forks)
            except OSError as err:  # one stand-in's socket: never the end of the server, which ends all its forks
                print(f"a stand-in's request failed: {err!r}", flush=True)
                conn.close()
        while forks:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
            if pid == 0:
                break
            # the fork's CPU with its reaped children's, for scripts/test_cpu.py: which test spends the suite's time
            print(f"exit {pid}: {usage.ru_utime + usage.ru_stime:.2f} CPU-s, {_TESTS.pop(pid, '?')}", flush=True)
            conn = forks.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(f"exit {status}\n".encode())
                except OSError:
                    pass
                conn.close()


def _answer(conn: socket.socket, own: dict, listener: socket.socket, forks: dict) -> None:
    try:
        header, fds, _, _ = socket.recv_fds(conn, 4, 3)
        while len(header) < 4:
            header += conn.recv(4 - len(header))
        size, body = struct.unpack("!I", header)[0], b""
        while len(body) < size:
            body += conn.recv(size - len(body))
        request = json.loads(body)
    except (OSError, ValueError, struct.error):
        conn.close()
        return
    unsafe = fork_safe(request["env"], own)
    if request["executable"] != sys.executable:  # another environment's Python: its own packages
        unsafe.append(request["executable"])
    if unsafe or len(fds) != 3:
        print(f"fresh: {' '.join(request['orig_argv'][1:4])}: differs in {unsafe}", flush=True)
        try:
            conn.sendall(b"fresh\n")
        except OSError:  # the stand-in was killed meanwhile: nothing runs
            pass
        conn.close()
        for fd in fds:
            os.close(fd)
        return
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        try:
            listener.close()
            for other in forks.values():
                other.close()
            _run(request, fds, conn)
        finally:
            os._exit(70)
    for fd in fds:
        os.close(fd)
    try:
        conn.sendall(f"pid {pid}\n".encode())
        peer = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
    except OSError as err:
        # The stand-in was killed between its request and this answer: the launcher's abort of `accelerate launch`
        # when a check fails within a second (seen under load, tests/test_smoke.py's wrong wrap class). So is its
        # fork, as for a stand-in killed later. Before, the BrokenPipeError ended the server, whose exit SIGKILLs
        # every fork: the launcher that had just printed its one line and exited 2 was reported as exit 1.
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)  # reaped here: it is in no list of forks
        conn.close()
        print(f"fork {pid}: its stand-in was gone before the answer ({err.strerror or err}): fork killed", flush=True)
        return
    print(f"fork {pid} for stand-in {peer}: {' '.join(request['orig_argv'][1:4])}", flush=True)
    forks[pid] = conn
    _TESTS[pid] = request["env"].get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]


def _run(request: dict, fds: list[int], conn: socket.socket) -> None:
    """In the fork: what a fresh interpreter would have, then the module or script as `python` would run it."""
    import atexit
    import runpy
    import threading
    import traceback

    global IN_FORK
    IN_FORK = True
    for target, fd in enumerate(fds):  # the stand-in's stdin, stdout, stderr; sys.std* objects stay (loggers hold them)
        os.dup2(fd, target)
        os.close(fd)
    if request["unbuffered"] or request["env"].get("PYTHONUNBUFFERED"):
        sys.stdout.reconfigure(write_through=True)
        sys.stderr.reconfigure(write_through=True)
    for sig in FORWARDED:
        signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    # the stand-in killed (SIGKILL, or dead with its parent): so is this fork
    threading.Thread(target=lambda: (conn.recv(1), os.kill(os.getpid(), signal.SIGKILL)), daemon=True).start()
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    _fresh_state(request)
    code, interrupted = 0, False
    try:
        if "module" in request:
            sys.modules.pop(request["module"], None)  # run afresh as __main__, as `python -m` does (runpy warns)
            sys.argv = ["-m", *request["argv"]]
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        else:
            sys.argv = [request["script"], *request["argv"]]
            runpy.run_path(request["script"], run_name="__main__")
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if not isinstance(stop.code, (int, type(None))):
            print(stop.code, file=sys.stderr)
    except KeyboardInterrupt:
        traceback.print_exc()
        interrupted = True
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if interrupted:  # as Python ends on an uncaught KeyboardInterrupt
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code & 0xFF)


def _fresh_state(request: dict) -> None:
    """What differs between a fork and a fresh interpreter and could change a run: sys.path[0], sys.orig_argv,
    tempfile's folder, the probes' hooks (read from this environment), torch's loggers (TORCH_LOGS), OpenMP's thread
    count, random generators seeded at import."""
    import tempfile

    sys.orig_argv = request["orig_argv"]
    tempfile.tempdir = None  # found again from this environment's TMPDIR when next asked
    sys.path[0] = request["cwd"] if "module" in request else os.path.dirname(request["script"])
    # the request's PYTHONPATH folders where the server's were, right after sys.path[0] (as Python puts them)
    rest = [p for p in sys.path[1:] if os.path.realpath(p) not in OWN_PATH]
    requested = (request["env"].get("PYTHONPATH") or "").split(os.pathsep)
    sys.path[1:] = [*dict.fromkeys(os.path.abspath(p) for p in requested if p), *rest]
    # the sitecustomize a fresh process would import (the probes', or one before them that runs theirs: bench/)
    first = next((f for f in (os.path.join(p, "sitecustomize.py") for p in sys.path[1:]) if os.path.isfile(f)), None)
    if first is not None:
        import runpy

        runpy.run_path(first, run_name="sitecustomize")
    if os.environ.get("TORCH_LOGS") and _torch_logs_reset() is not None:
        _torch_logs_reset()()
    _elastic_loggers_reset()
    if "torch" in sys.modules and os.environ.get("OMP_NUM_THREADS", "").isdigit():
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    fingerprint = sys.modules.get("datasets.fingerprint")
    if fingerprint is not None and hasattr(fingerprint, "fingerprint_rng"):
        fingerprint.fingerprint_rng.seed()


# ---- the pytest worker's side

SERVERS: dict = {}  # pid -> Popen of the servers this pytest worker started (conftest.kill_test_processes: forks)


def start(log: str, library: str | None = None, wait: bool = False) -> dict:
    """Start a server (it imports in the background), its socket in a folder of its own under the temporary folder
    (removed when this process exits; a socket's path is limited to 108 bytes), what it says in `log` (a line per
    process: forked, or fresh and why); the variables a process needs to be served by it. Processes started
    before its socket exists start fresh. `library`: a folder of packages kept outside the venv (torchao,
    bitsandbytes: the Makefile says why), put on the server's path after tests/probes, as the tests put it on
    their launches' path; the server imports what it has. `wait`: return once the server serves (its imports take
    5-10 s), so that the first launch is forked too, not started fresh beside the server's imports."""
    import atexit
    import shutil
    import subprocess
    import tempfile

    folder = tempfile.mkdtemp(prefix="fsdp-recipes-fork-server-")
    atexit.register(shutil.rmtree, folder, True)
    address = os.path.join(folder, "fork-server.sock")
    env = {k: v for k, v in os.environ.items() if k != "FSDP_RECIPES_TEST_PROCESS"}  # it outlives each test
    probes = os.path.dirname(os.path.abspath(__file__))
    path = os.pathsep.join([probes, *([library] if library else []),
                            *(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != probes)])
    variables = {"PYTHONPATH": path, ADDRESS: address}
    env.update(variables)
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, __file__, address], env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    SERVERS[proc.pid] = proc
    variables.update(FSDP_RECIPES_TEST_FORK_SERVER_PID=str(proc.pid), FSDP_RECIPES_TEST_FORK_SERVER_LOG=log)
    if wait:
        serving(variables)
    return variables


def serving(variables: dict, timeout: float = 120) -> None:
    """Wait until the server of `variables` (start's) serves, or has ended (its log says why), or `timeout` passed:
    its processes then start fresh, slower and never wrong."""
    import time

    proc = SERVERS[int(variables["FSDP_RECIPES_TEST_FORK_SERVER_PID"])]
    deadline = time.monotonic() + timeout
    while not os.path.exists(variables[ADDRESS]) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)


if __name__ == "__main__":  # the forks run this file's functions as the module `fork_server`, which the probes import
    import fork_server

    fork_server.serve(sys.argv[1])
