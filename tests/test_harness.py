"""The test harness itself: no process a test starts outlives it, even one that left its parent's session; the
fork server (tests/probes/fork_server.py) answers as a fresh process would."""

import json
import os
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import psutil

import fork_server
from bench.compare import PROBE
from conftest import REPO, kill_test_processes, pack_env, run, tagged_processes


def test_a_detached_grandchild_is_found_and_killed():
    # bash starts `sleep` in a session of its own and exits at once, as the launcher does with accelerate: the
    # sleep is then nobody's child and in no process group of ours
    subprocess.run(["bash", "-c", "setsid sleep 300 >/dev/null 2>&1 < /dev/null &"], check=True)
    deadline = time.time() + 10
    while not (found := [p for p in tagged_processes() if p.name() == "sleep"]) and time.time() < deadline:
        time.sleep(0.05)
    assert found, "the detached sleep should carry the test tag"
    assert any("sleep 300" in cmd for cmd in kill_test_processes())
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in found)


def served_by_the_fork_server() -> Path:
    """This worker's fork server, once it has imported (tests/probes/fork_server.py): its log."""
    log = Path(os.environ["FSDP_RECIPES_TEST_FORK_SERVER_LOG"])
    fork_server.serving(os.environ, timeout=180)
    assert Path(os.environ[fork_server.ADDRESS]).exists(), "the fork server did not start: " + log.read_text()
    return log


def test_a_served_command_is_a_fork_and_answers_as_a_fresh_process(cache_dir):
    """The launcher's command line becomes a stand-in for a fork of the preloaded server: same pid to its parent,
    same output and exit code as the same command in a fresh interpreter."""
    log = served_by_the_fork_server()
    cmd = [sys.executable, "-m", "fsdp_recipes.launch.launcher", "no-such-recipe"]
    forked = subprocess.Popen(cmd, cwd=REPO, env=pack_env(cache_dir), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    out, err = forked.communicate(timeout=120)
    fresh = run(cmd, cache_dir, FSDP_RECIPES_TEST_FORK_SERVER="")
    assert f"for stand-in {forked.pid}: -m fsdp_recipes.launch.launcher" in log.read_text()
    assert forked.returncode == fresh.returncode == 2, (err, fresh.stderr)
    assert (out, err) == (fresh.stdout, fresh.stderr)
    assert "no-such-recipe" in err


def test_a_killed_stand_in_takes_its_fork_and_everything_it_started_along(cache_dir, tmp_path):
    """SIGKILL to the launcher's stand-in while its checks run and the ranks wait at the gate: the fork, the
    `accelerate launch` and rank stand-ins and their forks all end (a test's cleanup finds only stand-ins by tag)."""
    server = psutil.Process(int(os.environ["FSDP_RECIPES_TEST_FORK_SERVER_PID"]))
    served_by_the_fork_server()
    proc = subprocess.Popen([sys.executable, "-m", "fsdp_recipes.launch.launcher", "tiny-cpu-lora", "--output_dir",
                             str(tmp_path / "run")], cwd=REPO, env=pack_env(cache_dir, SLOW_CHECK_S="120"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while len(server.children()) < 4:  # the launcher, `accelerate launch` and two ranks, forked
        assert proc.poll() is None and time.time() < deadline, server.children()
        time.sleep(0.2)
    proc.kill()
    proc.wait()
    deadline = time.time() + 20
    while (left := [p for p in server.children() if p.status() != psutil.STATUS_ZOMBIE]) and time.time() < deadline:
        time.sleep(0.2)
    assert not left, [" ".join(p.cmdline()) for p in left]


def test_a_stand_in_killed_before_the_answer_leaves_the_server_serving(cache_dir):
    """A stand-in SIGKILLed between its request and the server's answer (the launcher's abort of `accelerate launch`
    when a check fails within a second): the server kills that fork and goes on. It used to die of the
    BrokenPipeError and SIGKILL every fork, so a launcher that had printed its one line and exited 2 was reported as
    exit 1 (test_smoke_catches_a_wrong_wrap_class, once, under the whole suite's load)."""
    server = psutil.Process(int(os.environ["FSDP_RECIPES_TEST_FORK_SERVER_PID"]))
    log = served_by_the_fork_server()
    request = json.dumps(dict(module="fsdp_recipes.cli", argv=["--help"], unbuffered=False, env=dict(os.environ),
                              cwd=str(REPO), orig_argv=[sys.executable, "-m", "fsdp_recipes.cli", "--help"],
                              executable=sys.executable)).encode()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(os.environ[fork_server.ADDRESS])
    with open(os.devnull, "r+b") as devnull:  # what a stand-in sends (fork_server.delegate), then it is gone
        socket.send_fds(conn, [struct.pack("!I", len(request))], [devnull.fileno()] * 3)
        conn.sendall(request)
        conn.close()
    deadline = time.time() + 60
    while "its stand-in was gone before the answer" not in log.read_text() and server.is_running() \
            and server.status() != psutil.STATUS_ZOMBIE and time.time() < deadline:
        time.sleep(0.1)
    assert server.is_running() and server.status() != psutil.STATUS_ZOMBIE, log.read_text()[-2000:]
    proc = subprocess.Popen([sys.executable, "-m", "fsdp_recipes.launch.launcher", "no-such-recipe"], cwd=REPO,
                            env=pack_env(cache_dir), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "no-such-recipe" in err, err
    assert f"for stand-in {proc.pid}: -m fsdp_recipes.launch.launcher" in log.read_text()  # served, not fresh


# bench/compare.py's sitecustomize (it runs the one it shadows first; its counter is off without COMPARE_PROBE), then
# a line saying which process ran it and whether its folder came before the probes' on the path
CHAINED_SITE = PROBE + '''
import json
folders = [os.path.realpath(p) for p in sys.path if p]
with open(os.path.join(_here, f"ran-{os.getpid()}.json"), "w") as f:
    json.dump(folders.index(os.path.realpath(_here)) < folders.index(os.environ["FSDP_RECIPES_TEST_PROBES"]), f)
'''


def test_added_path_folders_are_served_unless_they_hold_an_imported_module(cache_dir, tmp_path):
    """A folder put before tests/probes on PYTHONPATH with a sitecustomize of its own that runs the probes' first
    (bench/compare.py's collective counter): the command is forked, and that sitecustomize runs in the fork, with the
    folder before the probes on the path as in a fresh process. A folder that holds a module the server imported
    (here `trl`) would not be the one a fork runs: that command starts fresh."""
    log = served_by_the_fork_server()
    probes = REPO / "tests" / "probes"
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(CHAINED_SITE)
    cmd = [sys.executable, "-m", "fsdp_recipes.launch.launcher", "no-such-recipe"]
    res = run(cmd, cache_dir, PYTHONPATH=f"{site}:{os.environ['PYTHONPATH']}", FSDP_RECIPES_TEST_PROBES=str(probes.resolve()))
    assert res.returncode == 2 and "no-such-recipe" in res.stderr
    forks = [line.split()[1] for line in log.read_text().splitlines() if line.startswith("fork ")]
    ran = {p.name: json.loads(p.read_text()) for p in site.glob("ran-*.json")}
    assert ran == {f"ran-{forks[-1]}.json": True}, (ran, forks[-1:])  # the fork's, its folder first

    shadow = tmp_path / "shadow"
    (shadow / "trl").mkdir(parents=True)
    res = run(cmd, cache_dir, PYTHONPATH=f"{os.environ['PYTHONPATH']}:{shadow}", FSDP_RECIPES_TEST_PROBES=str(probes.resolve()))
    assert res.returncode == 2
    assert "fresh: -m fsdp_recipes.launch.launcher no-such-recipe: differs in ['PYTHONPATH']" in log.read_text()


def test_test_cpu_adds_each_tests_forks_and_worker_seconds(tmp_path):
    """scripts/test_cpu.py: a fork's line and the worker's line of the same test add up; per file too."""
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import test_cpu
    finally:
        sys.path.pop(0)
    worker = tmp_path / "popen-gw0"
    worker.mkdir()
    (worker / "cpu-gw0.log").write_text("1.50 CPU-s, tests/test_a.py::test_x\n0.25 CPU-s, tests/test_b.py::test_y\n")
    (worker / "fork-server-gw0.log").write_text(
        "fork 11 for stand-in 10: -m fsdp_recipes.launch.launcher tiny-cpu-lora\n"
        "exit 11: 2.00 CPU-s, tests/test_a.py::test_x\nfresh: -m x: differs in ['LOGLEVEL']\n")
    assert test_cpu.per_test(tmp_path) == {"tests/test_a.py::test_x": 3.5, "tests/test_b.py::test_y": 0.25}
